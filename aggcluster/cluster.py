"""An aggregator and its workers on a netns testbed: what the demo, the end-to-end tests and the
benchmarks share.

    with Testbed(workers=4) as tb, Cluster(tb) as cl:
        reports = cl.run_workers([{"dtype": "int32", "count": 1000}])

`Cluster` attaches the XDP aggregator to the testbed's aggregator interfaces (xdp-agg attach,
run in the aggregator's namespace), starts the control endpoint there (xdp-agg serve) with a
deployment secret of its own (a temporary file, mode 0600, that every worker process gets as
$XDP_AGG_SECRET_FILE: `worker_env`), runs one aggcluster.cluster_worker process per worker
namespace, and undoes all of it on exit.
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

from aggproto import control

CONTROL_PORT = 48800


class ClusterError(RuntimeError):
    """A step of the run failed; the message carries the failing process's output."""


class Cluster:
    """The XDP aggregator, its control endpoint and worker processes on a Testbed."""

    def __init__(
        self,
        tb,
        *,
        name: str | None = None,
        xdp_mode: str = "native",
        pool_slots: int = 1024,
        serve_args: tuple[str, ...] = (),
    ) -> None:
        """`serve_args`: more `xdp-agg serve` options, e.g. ("--results", "broadcast")."""
        self.tb = tb
        self.serve_args = tuple(serve_args)
        self.name = name or f"c{uuid.uuid4().hex[:8]}"
        self.xdp_mode = xdp_mode
        self.pool_slots = pool_slots
        self._server: subprocess.Popen | None = None
        self._attached = False
        self.warnings: list[str] = []  # what xdp-agg serve warned about as it started
        self.serve_line = ""  # its "control endpoint listening on ..." line
        self._secret_dir: str | None = None
        self.secret_file: str | None = None  # the deployment secret serve checks

    def worker_env(self, base: dict | None = None) -> dict:
        """The environment of a worker process: `base` (default: ours) plus the secret file."""
        return {**(os.environ if base is None else base), control.SECRET_ENV: self.secret_file}

    # --- lifecycle ------------------------------------------------------------------------
    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run `xdp-agg --name NAME ARGS` in the aggregator's namespace."""
        cmd = [sys.executable, "-m", "xdp_switch.cli", "--name", self.name, *args]
        r = self.tb.run("agg", cmd, timeout=timeout)
        if r.returncode != 0:
            raise ClusterError(f"xdp-agg {' '.join(args)} failed: {r.stderr.strip()}")
        return r

    def __enter__(self) -> "Cluster":
        try:
            self._secret_dir = tempfile.mkdtemp(prefix=f"xdp-agg-{self.name}-")
            self.secret_file = os.path.join(self._secret_dir, "secret")
            control.create_secret(self.secret_file)
            self.cli(
                "attach",
                *self.tb.agg_interfaces,
                "--xdp-mode",
                self.xdp_mode,
                "--pool-slots",
                str(self.pool_slots),
            )
            self._attached = True
            self.start_server()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def start_server(self) -> None:
        """Start the control endpoint (xdp-agg serve) in the aggregator's namespace; returns
        once it listens. It recovers the jobs an earlier one left (a restart)."""
        self._server = self.tb.popen(
            "agg",
            [
                sys.executable,
                "-m",
                "xdp_switch.cli",
                "--name",
                self.name,
                "serve",
                "--listen",
                # every address: in the switch topology each port has its own
                f"0.0.0.0:{CONTROL_PORT}",
                "--secret-file",
                self.secret_file,
                *self.serve_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self._server.stderr.readline()  # "control endpoint listening ..." or an error
        if line.startswith("warning:"):  # e.g. results falling back to the broadcast
            self.warnings.append(line.strip())
            line = self._server.stderr.readline()
        if "listening" not in line:
            raise ClusterError(f"xdp-agg serve did not start: {line}{self._server.stderr.read()}")
        self.serve_line = line.strip()

    def stop_server(self, sig: int = signal.SIGTERM) -> str:
        """Stop the control endpoint with `sig` (the jobs go on in the data plane); returns
        what it wrote to stderr."""
        p, self._server = self._server, None
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
        self.stop_server()
        try:
            self.detach()
        finally:
            if self._secret_dir is not None:
                shutil.rmtree(self._secret_dir, ignore_errors=True)
                self._secret_dir = None

    def detach(self, force: bool = True) -> None:
        """Detach the aggregator now (the control endpoint keeps running until exit); `force`:
        even with live jobs (xdp-agg detach --force)."""
        if self._attached:
            self._attached = False
            self.cli("detach", *(["--force"] if force else []))

    # --- work -----------------------------------------------------------------------------
    def control_address(self, worker) -> str:
        return f"{worker.agg_ip}:{CONTROL_PORT}"

    def start_workers(
        self,
        plan: list[dict],
        *,
        hosts: list[int] | None = None,
        job: str = "e2e",
        elems: int = 256,
        window: int = 128,
        timeout: float = 30.0,
        progress: bool = False,
    ) -> list[tuple[int, subprocess.Popen]]:
        """Start one cluster_worker per host (testbed worker indices, default all): the i-th host
        is rank i of a job of len(hosts) workers. Collect them with `collect`."""
        hosts = list(range(len(self.tb.workers))) if hosts is None else hosts
        procs = []
        for rank, h in enumerate(hosts):
            w = self.tb.workers[h]
            cmd = [
                sys.executable,
                "-m",
                "aggcluster.cluster_worker",
                "--rank",
                str(rank),
                "--world",
                str(len(hosts)),
                "--control",
                self.control_address(w),
                "--job",
                job,
                "--elems",
                str(elems),
                "--window",
                str(window),
                "--timeout",
                str(timeout),
                "--plan",
                json.dumps(plan),
            ]
            if progress:
                cmd.append("--progress")
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

    def stats(self) -> dict:
        return json.loads(self.cli("stats", "--json").stdout)
