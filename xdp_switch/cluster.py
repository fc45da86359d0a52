"""An aggregator and its workers on a netns testbed: what the demo, the end-to-end tests and the
benchmarks share.

    with Testbed(workers=4) as tb, Cluster(tb) as cl:
        reports = cl.run_workers([{"dtype": "int32", "count": 1000}])

`Cluster` attaches the XDP aggregator to the testbed's aggregator interfaces (xdp-agg attach,
run in the aggregator's namespace), starts the control endpoint there (xdp-agg serve), runs one
xdp_switch.cluster_worker process per worker namespace, and undoes all of it on exit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

CONTROL_PORT = 48800


class ClusterError(RuntimeError):
    """A step of the run failed; the message carries the failing process's output."""


class Cluster:
    """The XDP aggregator, its control endpoint and worker processes on a Testbed."""

    def __init__(self, tb, *, name: str | None = None, xdp_mode: str = "native", pool_slots: int = 1024) -> None:
        self.tb = tb
        self.name = name or f"c{uuid.uuid4().hex[:8]}"
        self.xdp_mode = xdp_mode
        self.pool_slots = pool_slots
        self._server: subprocess.Popen | None = None
        self._attached = False

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
            self.cli("attach", *self.tb.agg_interfaces, "--mode", self.xdp_mode, "--pool-slots", str(self.pool_slots))
            self._attached = True
            self._server = self.tb.popen(
                "agg",
                [sys.executable, "-m", "xdp_switch.cli", "--name", self.name, "serve", "--listen", f"0.0.0.0:{CONTROL_PORT}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            )
            line = self._server.stderr.readline()  # "control endpoint listening ..." or an error
            if "listening" not in line:
                raise ClusterError(f"xdp-agg serve did not start: {line}{self._server.stderr.read()}")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._server is not None:
            self._server.terminate()
            try:
                self._server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
            self._server = None
        if self._attached:
            self._attached = False
            self.cli("detach")

    # --- work -----------------------------------------------------------------------------
    def control_address(self, worker) -> str:
        return f"{worker.agg_ip}:{CONTROL_PORT}"

    def run_workers(
        self, plan: list[dict], *, job: str = "e2e", elems: int = 256, window: int = 128, timeout: float = 30.0,
        ranks: list[int] | None = None, progress: bool = False, deadline: float = 600.0,
    ) -> list[list[dict]]:
        """Run `plan` on every worker (or those in `ranks`, for failure tests); per worker, its
        JSON reports. Raises ClusterError with the worker's stderr when one fails."""
        ranks = list(range(len(self.tb.workers))) if ranks is None else ranks
        procs = []
        for r in ranks:
            w = self.tb.workers[r]
            cmd = [
                sys.executable, "-m", "xdp_switch.cluster_worker", "--rank", str(r),
                "--world", str(len(self.tb.workers)), "--control", self.control_address(w), "--job", job,
                "--elems", str(elems), "--window", str(window), "--timeout", str(timeout), "--plan", json.dumps(plan),
            ]
            if progress:
                cmd.append("--progress")
            procs.append(self.tb.popen(w, cmd, stdout=subprocess.PIPE, stderr=None if progress else subprocess.PIPE, text=True))
        end = time.monotonic() + deadline
        out, errors = [], []
        for r, p in zip(ranks, procs):
            try:
                stdout, stderr = p.communicate(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                stdout, stderr = p.communicate()
                errors.append(f"rank {r}: no answer within {deadline:g} s")
                continue
            if p.returncode != 0:
                errors.append(f"rank {r} exited {p.returncode}: {(stderr or '').strip()[-2000:]}")
                continue
            out.append([json.loads(line) for line in stdout.splitlines() if line.startswith("{")])
        if errors:
            raise ClusterError("; ".join(errors))
        return out

    def stats(self) -> dict:
        return json.loads(self.cli("stats", "--json").stdout)
