"""torchrun on a netns testbed: one torchrun node per worker namespace, the XDP aggregator beside.

    sudo .venv/bin/python -m xdp_agg.cluster.torchrun --workers 4 -- examples/train.py --backend
    xdpagg

brings up a one-arm testbed of --workers namespaces (optionally --rate 1gbit), attaches the XDP
aggregator and runs its control endpoint (xdp_agg.cluster.cluster.Cluster), then starts in each
worker namespace

    torchrun --nnodes N --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint <worker 0's address>:29400 --rdzv-id <run id> \\
        --rdzv-conf is_host=<1 on worker 0, else 0> --local-addr <own address> \\
        --max-restarts <--max-restarts, default 0> SCRIPT ARGS...

with XDP_AGG_CONTROL (the control endpoint as that worker reaches it) and GLOO_SOCKET_IFNAME set,
so that the script's init_process_group("xdpagg") (or "gloo") finds both. torchrun's c10d
rendezvous runs over the testbed's addresses (worker 0 hosts its store, which is_host says
because torchrun's guess compares with the machine's addresses, not the namespace's);
--local-addr keeps torchrun from advertising the machine's host name, which resolves outside
the namespaces. The nodes' stdout is ours (train.py prints on rank 0 only); a failing node's
stderr is reported. Everything is torn down on exit.

From Python: `start_torchrun(tb, cluster, script, args)` on a Testbed and Cluster of your own.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid

from xdp_agg.proto import control

RDZV_PORT = 29400


def torchrun_command(
    script: str,
    args: list[str],
    *,
    nnodes: int,
    endpoint: str,
    run_id: str,
    local_addr: str,
    is_host: bool,
    max_restarts: int = 0,
) -> list[str]:
    """The torchrun command line of one node (one process per node).

    max_restarts: torchrun's --max-restarts: after a worker fails, every node stops its
    workers and the run starts again (a new rendezvous round, TORCHELASTIC_RESTART_COUNT one
    more), this many times before the run fails.

    is_host: whether this node hosts the rendezvous store. torchrun guesses it by comparing the
    endpoint with the machine's host name and its addresses, which are not the namespace's, so
    every node would guess "no" and none would serve it: it is said explicitly.
    """
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        f"is_host={int(is_host)},join_timeout=120",
        "--local-addr",
        local_addr,
        "--max-restarts",
        str(max_restarts),
        "--monitor-interval",
        "0.5",
        script,
        *args,
    ]


def start_torchrun(
    tb,
    cluster,
    script: str,
    args: list[str],
    *,
    run_id: str | None = None,
    env: dict | None = None,
    port: int = RDZV_PORT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    max_restarts: int = 0,
) -> list[subprocess.Popen]:
    """Start one torchrun node in every worker namespace of `tb`; their processes, node 0 first.

    env: extra environment for the training processes (XDP_AGG_* settings, ...);
    max_restarts: torchrun's --max-restarts (torchrun_command).
    """
    run_id = run_id or f"run-{uuid.uuid4().hex[:8]}"
    endpoint = f"{tb.workers[0].ip}:{port}"
    procs = []
    for i, w in enumerate(tb.workers):
        e = dict(os.environ)
        e.update(
            {
                "XDP_AGG_CONTROL": cluster.control_address(w),
                control.SECRET_ENV: cluster.secret_file,
                "GLOO_SOCKET_IFNAME": w.ifname,
                "OMP_NUM_THREADS": e.get("OMP_NUM_THREADS", "1"),
            }
        )
        if max_restarts > 0:
            # torch 2.13's c10d rendezvous shares one TCPStore across rounds and hands workers
            # no per-round prefix (rendezvous._create_c10d_store: "a new TCPStore for every
            # retry", but dynamic_rendezvous keeps the shared server), so a restarted round
            # reads the crashed round's keys: gloo's connectFullMesh dials dead addresses,
            # with plain gloo as with xdpagg. Unshared, the round's store is fresh.
            e["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        e.update(env or {})
        cmd = torchrun_command(
            script,
            args,
            nnodes=len(tb.workers),
            endpoint=endpoint,
            run_id=run_id,
            local_addr=w.ip,
            is_host=i == 0,
            max_restarts=max_restarts,
        )
        procs.append(tb.popen(w, cmd, env=e, stdout=stdout, stderr=stderr, text=True))
    return procs


def wait_all(procs: list[subprocess.Popen], deadline: float) -> list[tuple[int, str, str]]:
    """(returncode, stdout, stderr) of each node; kills what still runs after `deadline` s,
    the node's training processes with it."""
    end = time.monotonic() + deadline
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_tree(p.pid)
            so, se = p.communicate(timeout=30)
            se = (se or "") + f"\n(killed after {deadline:g} s)"
        out.append((p.returncode, so or "", se or ""))
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and its descendants. torchrun starts each worker in a session of its own
    (elastic's SubprocessHandler: start_new_session=True), so killing torchrun's process group
    would leave the workers running, holding our pipes open."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry))
    todo, tree = [pid], []
    while todo:
        q = todo.pop()
        tree.append(q)
        todo += children.get(q, [])
    for q in tree:
        try:
            os.kill(q, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [--workers N] [--rate R] [--mtu M] -- SCRIPT [ARGS...]",
    )
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rate", default=None, help="per-worker link rate, e.g. 1gbit")
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--deadline", type=float, default=900.0)
    ap.add_argument("--max-restarts", type=int, default=0, help="torchrun's --max-restarts")
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="K=V",
        help="extra environment of the training processes (repeatable)",
    )
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)

    from netns_testbed.testbed import Testbed
    from xdp_agg.cluster.cluster import Cluster

    env = dict(kv.split("=", 1) for kv in a.env)
    with (
        Testbed(workers=a.workers, topology="one-arm", rate=a.rate, mtu=a.mtu) as tb,
        Cluster(tb) as cl,
    ):
        procs = start_torchrun(
            tb,
            cl,
            os.path.abspath(a.script),
            a.args,
            env=env,
            stdout=None,
            stderr=subprocess.PIPE,
            max_restarts=a.max_restarts,
        )
        results = wait_all(procs, a.deadline)
    failed = [(i, rc, se) for i, (rc, _, se) in enumerate(results) if rc != 0]
    for i, rc, se in failed:
        print(f"node {i} exited {rc}:\n{se[-3000:]}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
