"""A two-level tree on a one-arm netns testbed: a root aggregator, one rack aggregator per rack,
and each rack's workers (docs/protocol.md section 3.7, docs/striping-and-trees.md).

    tb = Testbed(workers=tree_hosts(2, 3), topology="one-arm")
    with tb, TreeCluster(tb, racks=2, per_rack=3, loss=0.01) as tc:
        reports = tc.run_workers([{"dtype": "int32", "count": 100_000}])

Layout: every namespace sits on the testbed's one bridge (one subnet). The testbed's aggregator
namespace is the root (xdp-agg attach + serve, as Cluster does); of the testbed's "workers",
hosts 0 .. racks*per_rack-1 are the workers (rack r has hosts r*per_rack ..), and the last
`racks` hosts are the rack aggregators, each running `xdp-agg attach eth0` and
`xdp-agg serve --parent-endpoint ROOT:48800 --rack-rank r --racks R`. A rack's workers talk to
their rack's endpoint and aggregator only; the racks talk to the root.

One bridge for all is harmless for the results: a rack sends the parent's result to the subnet
broadcast, so the other racks' workers may receive a copy too, but it is the same sum for the
same packet (the racks' slots line up), which their dedupe counts as a duplicate; the root's
results go to the racks' uplink port, where no worker listens.

Loss (`loss`): the testbed's own rules on every worker link (both ways), and
netns_testbed.faults.port_loss_script on the bridge ports of the root and the racks, both ways,
since the XDP programs there would bypass rules in their own namespaces.

Racks in `bmv2_racks` run the P4 program in bmv2 instead (`xdp-agg serve --target bmv2 --ports
eth0 --parent-endpoint ...`, p4c and simple_switch on PATH): simple_switch on the rack host's
one interface, one-arm as the XDP racks are (each result copy out of that port, addressed to its
worker), the host's kernel told to ignore the aggregation traffic it also sees, and the rack's
workers sending without UDP GSO/GRO (libpcap must see one datagram per frame).
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

from netns_testbed import faults, xdp_pass

from . import cluster_worker
from .cluster import CONTROL_PORT, Cluster, ClusterError, run_cli


def tree_hosts(racks: int, per_rack: int) -> int:
    """The testbed workers a TreeCluster needs: the workers and one host per rack aggregator."""
    return racks * per_rack + racks


class TreeCluster:
    """The root aggregator, the rack aggregators with their endpoints, and the workers."""

    def __init__(
        self,
        tb,
        *,
        racks: int,
        per_rack: int,
        loss: float = 0.0,
        name: str | None = None,
        bmv2_racks: tuple[int, ...] = (),
        workdir: str = "/tmp/xdp-agg-tree-bmv2",
    ) -> None:
        if tb.topology != "one-arm" or len(tb.workers) != tree_hosts(racks, per_rack):
            raise ValueError(
                f"a tree of {racks} x {per_rack} needs a one-arm testbed of "
                f"{tree_hosts(racks, per_rack)} workers"
            )
        self.tb = tb
        self.racks, self.per_rack = racks, per_rack
        self.loss = faults.check_probability("loss", loss)
        self.name = name or f"t{uuid.uuid4().hex[:6]}"
        # The root's workers are the rack aggregators: XDP programs, which join no multicast
        # group, so a snooping bridge would keep the root's results from them (they would come
        # only as unicast answers to re-sent partials): the root sends to the broadcast.
        self.root = Cluster(tb, name=f"{self.name}r", serve_args=("--results", "broadcast"))
        self.rack_hosts = [tb.workers[racks * per_rack + r] for r in range(racks)]
        self.bmv2_racks = frozenset(bmv2_racks)
        self.workdir = workdir  # where each bmv2 rack compiles the program (a folder per rack)
        self._attached: list[int] = []
        self._servers: list[subprocess.Popen] = []

    def rack_name(self, r: int) -> str:
        return f"{self.name}k{r}"

    def cli(self, r: int | None, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """`xdp-agg ARGS` for rack r's aggregator (None: the root's)."""
        if r is None:
            return self.root.cli(*args, timeout=timeout)
        return run_cli(self.tb, self.rack_hosts[r], self.rack_name(r), args, timeout, f"rack {r}: ")

    def __enter__(self) -> "TreeCluster":
        self.root.__enter__()
        try:
            sw = self.tb.switch_netns
            ports = [f"w{h.index}" for h in self.rack_hosts]
            # The bridge's ends of the racks' links receive the racks' XDP_TX'd frames.
            xdp_pass.attach_pass({sw: ports})
            faults.apply(sw, faults.port_loss_script(["ag", *ports], self.loss))
            for r in range(self.racks):
                self._start_rack(r)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start_rack(self, r: int) -> None:
        """Rack r's aggregator (XDP attached, or bmv2 started by serve) and its endpoint."""
        host = self.rack_hosts[r]
        cmd = [sys.executable, "-m", "xdp_agg.app.cli", "--name", self.rack_name(r)]
        if r in self.bmv2_racks:
            faults.apply(host.netns, faults.kernel_ignores_data_script())
            target = ["--target", "bmv2", "--ports", host.ifname]
            target += ["--workdir", f"{self.workdir}/{self.rack_name(r)}"]
            cmd[-2:-2] = ["--netns", host.netns]  # simple_switch via `ip netns exec`
        else:
            self.cli(r, "attach", host.ifname)
            self._attached.append(r)
            target = []
        root_ip = self.tb.aggregator.ips[0]
        cmd += ["serve", *target, "--listen", f"0.0.0.0:{CONTROL_PORT}"]
        cmd += ["--parent-endpoint", f"{root_ip}:{CONTROL_PORT}", "--rack-rank", str(r)]
        cmd += ["--racks", str(self.racks), "--tree-workers", str(self.racks * self.per_rack)]
        # one secret for the tree: the rack proves it to the root, its workers to the rack
        cmd += ["--secret-file", self.root.secret_file]
        srv = self.tb.popen(host, cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._servers.append(srv)
        line = srv.stderr.readline()
        if "listening" not in line:
            raise ClusterError(f"rack {r}: xdp-agg serve did not start: {line}")

    def __exit__(self, *exc) -> None:
        for srv in self._servers:
            srv.terminate()
            try:
                srv.wait(timeout=10)
            except subprocess.TimeoutExpired:
                srv.kill()
                srv.wait()
        self._servers.clear()
        errors = []
        for r in list(self._attached):
            try:
                self.cli(r, "detach")
            except ClusterError as e:
                errors.append(str(e))
            self._attached.remove(r)
        self.root.__exit__(*exc)
        if errors:
            raise ClusterError("; ".join(errors))

    def start_workers(
        self,
        plan: list[dict],
        *,
        job: str = "tree",
        elems: int = 256,
        window: int | None = None,
        timeout: float = 30.0,
    ) -> list[tuple[int, subprocess.Popen]]:
        """One cluster_worker per worker host: rank i of its rack's job, input and exact sum as
        worker r*per_rack + i of all racks*per_rack. Collect them with `collect`."""
        procs = []
        total = self.racks * self.per_rack
        for r, rack in enumerate(self.rack_hosts):
            for i in range(self.per_rack):
                g = r * self.per_rack + i
                cmd = cluster_worker.argv(
                    i,
                    self.per_rack,
                    f"{rack.ip}:{CONTROL_PORT}",
                    job,
                    plan,
                    data_rank=g,
                    data_world=total,
                    elems=elems,
                    window=window,
                    timeout=timeout,
                    no_offload=r in self.bmv2_racks,
                )
                p = self.tb.popen(
                    self.tb.workers[g],
                    cmd,
                    env=self.root.worker_env(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                procs.append((g, p))
        return procs

    collect = staticmethod(Cluster.collect)

    def run_workers(self, plan: list[dict], deadline: float = 600.0, **kw) -> list[list[dict]]:
        """start_workers then collect: per worker (r*per_rack + i), its reports."""
        return self.collect(self.start_workers(plan, **kw), deadline)

    def stats(self) -> dict:
        """`xdp-agg stats --json` of the root ("root") and of each XDP rack ("racks"; None for
        a bmv2 rack, whose counters its endpoint's status reports)."""
        return {
            "root": json.loads(self.cli(None, "stats", "--json").stdout),
            "racks": [
                None if r in self.bmv2_racks else json.loads(self.cli(r, "stats", "--json").stdout)
                for r in range(self.racks)
            ],
        }
