"""An aggregator and its workers on a netns testbed: what the demo, the end-to-end tests and the
benchmarks share.

    with Testbed(workers=4) as tb, Cluster(tb) as cl:
        reports = cl.run_workers([{"dtype": "int32", "count": 1000}])

`Cluster` attaches the XDP aggregator to the testbed's aggregator interfaces (xdp-agg attach,
run in the aggregator's namespace), starts the control endpoint there (xdp-agg serve) with a
deployment secret of its own (a temporary file, mode 0600, that every worker process gets as
$XDP_AGG_SECRET_FILE: `worker_env`), runs one xdp_agg.cluster.cluster_worker process per worker
namespace, and undoes all of it on exit.

On a testbed of several aggregators (Testbed(aggregators=K)) it does so in each aggregator's
namespace: one XDP aggregator (named NAME, NAME-1, NAME-2, ...) and one control endpoint per
aggregator, each giving its jobs multicast groups from its own block
(plan.aggregator_group_base), all with the one secret, and the workers stripe their job over
the first `aggregators` of them (start_workers).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from netns_testbed.plan import aggregator_group_base
from xdp_agg.app import serving
from xdp_agg.app.options import AttachOptions, attach_args
from xdp_agg.proto import control

from . import cluster_worker

CONTROL_PORT = 48800


class ClusterError(RuntimeError):
    """A step of the run failed; the message carries the failing process's output."""


def run_cli(
    tb, host, name: str, args, timeout: float, what: str = ""
) -> subprocess.CompletedProcess:
    """`xdp-agg --name NAME ARGS` in testbed `tb`'s namespace of `host`; ClusterError (prefixed
    with `what`) when it fails."""
    cmd = [sys.executable, "-m", "xdp_agg.app.cli", "--name", name, *args]
    r = tb.run(host, cmd, timeout=timeout)
    if r.returncode != 0:
        raise ClusterError(f"{what}xdp-agg {' '.join(args)} failed: {r.stderr.strip()}")
    return r


class Cluster:
    """The XDP aggregator, its control endpoint and worker processes on a Testbed."""

    def __init__(
        self,
        tb,
        *,
        name: str | None = None,
        attach: AttachOptions | None = None,
        serve_args: tuple[str, ...] = (),
    ) -> None:
        """`attach`: how `xdp-agg attach` attaches each aggregator (default: AttachOptions(),
        e.g. AttachOptions(frags=True) for jumbo MTUs, 1024 and 2048 elements); `serve_args`:
        more `xdp-agg serve` options, e.g. ("--results", "broadcast")."""
        self.tb = tb
        self.attach = attach or AttachOptions()
        self.serve_args = tuple(serve_args)
        self.name = name or f"c{uuid.uuid4().hex[:8]}"
        self.warnings: list[str] = []  # what xdp-agg serve warned about as it started
        self.serve_line = ""  # its "control endpoint listening on ..." line (aggregator 0)
        self._secret_dir: str | None = None
        self.secret_file: str | None = None  # the deployment secret every serve checks
        hosts = getattr(tb, "aggregators", None) or [tb.aggregator]
        self.aggregators = list(hosts)  # the testbed's aggregator hosts, in stripe order
        self._servers: list[subprocess.Popen | None] = [None] * len(self.aggregators)
        self._attached = [False] * len(self.aggregators)
        self._served: set[int] = set()  # aggregators whose serve this cluster started

    def worker_env(self, base: dict | None = None) -> dict:
        """The environment of a worker process: `base` (default: ours) plus the secret file."""
        return {**(os.environ if base is None else base), control.SECRET_ENV: self.secret_file}

    def agg_name(self, j: int = 0) -> str:
        """The XDP aggregator name (pins, state file) of aggregator j: NAME, NAME-1, ..."""
        return self.name if j == 0 else f"{self.name}-{j}"

    @property
    def _server(self) -> subprocess.Popen | None:
        """Aggregator 0's control endpoint process."""
        return self._servers[0]

    # --- lifecycle ------------------------------------------------------------------------
    def cli(self, *args: str, timeout: float = 120, aggregator: int = 0):
        """Run `xdp-agg --name NAME ARGS` in aggregator `aggregator`'s namespace."""
        return run_cli(
            self.tb, self.aggregators[aggregator], self.agg_name(aggregator), args, timeout
        )

    def __enter__(self) -> "Cluster":
        try:
            self._secret_dir = tempfile.mkdtemp(prefix=f"xdp-agg-{self.name}-")
            self.secret_file = os.path.join(self._secret_dir, "secret")
            control.create_secret(self.secret_file)  # one secret for all the aggregators
            for j, host in enumerate(self.aggregators):
                self.cli("attach", *host.ifnames, *attach_args(self.attach), aggregator=j)
                self._attached[j] = True
                self.start_server(j)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def start_server(self, j: int = 0) -> None:
        """Start aggregator j's control endpoint (xdp-agg serve) in its namespace; returns
        once it listens. It recovers the jobs an earlier one left (a restart)."""
        # several aggregators: each gives its jobs groups from its own block, so that one
        # aggregator's results never go to a group of another's (and the bridge keeps them
        # off the other aggregators' links)
        blocks = ["--group-base", aggregator_group_base(j)] if len(self.aggregators) > 1 else []
        server = self.tb.popen(
            self.aggregators[j],
            [
                sys.executable,
                "-m",
                "xdp_agg.app.cli",
                "--name",
                self.agg_name(j),
                "serve",
                "--listen",
                # every address: in the switch topology each port has its own
                f"0.0.0.0:{CONTROL_PORT}",
                "--secret-file",
                self.secret_file,
                *blocks,
                *self.serve_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._servers[j] = server
        line = server.stderr.readline()  # "control endpoint listening ..." or an error
        if line.startswith("warning:"):  # e.g. results falling back to the broadcast
            self.warnings.append(line.strip())
            line = server.stderr.readline()
        if "listening" not in line:
            raise ClusterError(
                f"xdp-agg serve ({self.agg_name(j)}) did not start: {line}{server.stderr.read()}"
            )
        self._served.add(j)  # it holds the serve lock of agg_name(j) now
        if j == 0:
            self.serve_line = line.strip()

    def stop_server(self, sig: int = signal.SIGTERM, j: int = 0) -> str:
        """Stop aggregator j's control endpoint with `sig` (the jobs go on in the data plane);
        returns what it wrote to stderr."""
        p, self._servers[j] = self._servers[j], None
        if p is None:
            return ""
        p.send_signal(sig)
        try:
            _, err = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        return err or ""

    def __exit__(self, *exc) -> None:
        for j in range(len(self.aggregators)):
            self.stop_server(j=j)
        errors = []
        try:
            for j in range(len(self.aggregators)):
                try:
                    self.detach(aggregator=j)
                except ClusterError as e:  # detach the others all the same
                    errors.append(str(e))
        finally:
            for j in sorted(self._served):
                # its serve has ended (stop_server waited), so nobody holds the lock: remove
                # the file, or every test run would leave one per cluster in the state dir
                serving.lock_path(self.agg_name(j)).unlink(missing_ok=True)
            self._served.clear()
            if self._secret_dir is not None:
                shutil.rmtree(self._secret_dir, ignore_errors=True)
                self._secret_dir = None
        if errors:
            raise ClusterError("; ".join(errors))

    def detach(self, aggregator: int = 0, *, force: bool = True) -> None:
        """Detach aggregator `aggregator` now (its control endpoint keeps running until exit);
        `force`: even with live jobs (xdp-agg detach --force)."""
        if self._attached[aggregator]:
            self._attached[aggregator] = False
            self.cli("detach", *(["--force"] if force else []), aggregator=aggregator)

    # --- work -----------------------------------------------------------------------------
    def control_address(self, worker, aggregators: int = 1) -> str:
        """The control endpoint(s) `worker` reaches: of its aggregator, or, striping over the
        first `aggregators` of several (one-arm), theirs comma-separated (hostlib.init's form)."""
        if aggregators == 1:
            return f"{worker.agg_ip}:{CONTROL_PORT}"
        return ",".join(f"{a.ips[0]}:{CONTROL_PORT}" for a in self.aggregators[:aggregators])

    def start_workers(
        self,
        plan: list[dict],
        *,
        hosts: list[int] | None = None,
        job: str = "e2e",
        elems: int | str = 256,
        window: int | None = None,
        timeout: float = 30.0,
        progress: bool = False,
        aggregators: int = 1,
    ) -> list[tuple[int, subprocess.Popen]]:
        """Start one cluster_worker per host (testbed worker indices, default all): the i-th host
        is rank i of a job of len(hosts) workers, striped over the first `aggregators` of the
        cluster's aggregators; window None: hostlib's default (HostOptions). Collect them with
        `collect`."""
        if not 1 <= aggregators <= len(self.aggregators):
            raise ValueError(f"aggregators must be in 1..{len(self.aggregators)}")
        hosts = list(range(len(self.tb.workers))) if hosts is None else hosts
        procs = []
        for rank, h in enumerate(hosts):
            w = self.tb.workers[h]
            cmd = cluster_worker.argv(
                rank,
                len(hosts),
                self.control_address(w, aggregators),
                job,
                plan,
                elems=elems,
                window=window,
                timeout=timeout,
                progress=progress,
            )
            err = None if progress else subprocess.PIPE
            procs.append(
                (
                    rank,
                    self.tb.popen(
                        w, cmd, env=self.worker_env(), stdout=subprocess.PIPE, stderr=err, text=True
                    ),
                )
            )
        return procs

    @staticmethod
    def collect(
        procs: list[tuple[int, subprocess.Popen]], deadline: float = 600.0
    ) -> list[list[dict]]:
        """Wait for started workers; per rank, its JSON reports. Raises ClusterError with the
        failing workers' stderr."""
        end = time.monotonic() + deadline
        out, errors = [], []
        for rank, p in procs:
            try:
                stdout, stderr = p.communicate(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                stdout, stderr = p.communicate()
                tail = (stderr or "").strip()[-1500:]
                errors.append(f"rank {rank}: no answer within {deadline:g} s: {tail}")
                continue
            if p.returncode != 0:
                errors.append(
                    f"rank {rank} exited {p.returncode}: {(stderr or '').strip()[-2000:]}"
                )
                continue
            out.append([json.loads(line) for line in stdout.splitlines() if line.startswith("{")])
        if errors:
            raise ClusterError("; ".join(errors))
        return out

    def run_workers(self, plan: list[dict], deadline: float = 600.0, **kw) -> list[list[dict]]:
        """start_workers then collect: per rank, its reports."""
        return self.collect(self.start_workers(plan, **kw), deadline)

    def stats(self, aggregator: int = 0) -> dict:
        """`xdp-agg stats --json` of aggregator `aggregator`."""
        return json.loads(self.cli("stats", "--json", aggregator=aggregator).stdout)
