"""Job leases: the control endpoint removes a job whose members have all gone quiet.

A job normally ends when its ranks leave or their control connections close. A member can also
go quiet without either: its process frozen or hung, its host gone without a FIN (TCP keepalive
notices that only after about 2 minutes), a torchrun attempt that crashed and left a stuck
rank behind. Its job would then keep its slots, aggregator port and job id for as long as the
connection looks open. So every job has a lease of `seconds`, renewed whenever
- a connection that holds the job sends a request (hostlib's control link sends a `ping` every
  hostlib.control_link.RENEW_INTERVAL seconds while it is open, so a live rank renews it even
  when it does not all-reduce), or
- the aggregator counts new contributions of the job (backend.worker_counters: the members'
  traffic).
A job whose lease runs out is deleted from the backend like a job whose ranks all left; its
members' next requests are told the job does not exist. `seconds` <= 0 turns leases off.

The lease's length is xdp_agg.ctl.auth.Limits.job_lease (default DEFAULT_LEASE), `xdp-agg serve
--job-lease SECONDS` on the command line. The server's hooks (xdp_agg.ctl.server.ControlEndpoint)
are JobLease.start/stop with the server, and renew(conn) after each answered request.
"""

from __future__ import annotations

import logging
import threading
import time

from .auth import Limits
from .backend import WorkerCounters
from .registry import Holder

log = logging.getLogger(__name__)

DEFAULT_LEASE = Limits.job_lease  # 60 s: 6 renewals of a live control link (a ping per 10 s)


class JobLease:
    """Expires the jobs of `registry` (a ControlEndpoint's JobRegistry) that nobody renewed for
    `seconds`."""

    def __init__(self, registry, seconds: float) -> None:
        self.registry = registry
        self.seconds = float(seconds)
        # per job (by its token, unique per creation): when last renewed, and its traffic then
        self._renewed: dict[str, float] = {}
        self._traffic: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.expired: list[str] = []  # keys of the jobs removed for a lapsed lease
        self.expiries = 0  # how many, as a counter for the metrics (xdp_agg.ctl.status.overview)

    @property
    def enabled(self) -> bool:
        return self.seconds > 0

    def start(self) -> None:
        """Start the sweeping thread (once; nothing when leases are off)."""
        if not self.enabled or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="job-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def renew(self, conn: int) -> None:
        """A request came on connection `conn`: renew every job it holds."""
        if not self.enabled:
            return
        now = time.monotonic()
        me = Holder.connection(conn)
        with self.registry.cond:
            for job in self.registry.jobs.values():
                if me in job.holders:
                    self._renewed[job.token] = now

    def _run(self) -> None:
        # a lapse is noticed within a quarter of the lease (at most 5 s) of happening
        interval = min(self.seconds / 4, 5.0)
        while not self._stop.wait(interval):
            try:
                self.sweep()
            except Exception:  # a failed sweep must not end leases for good
                log.exception("job lease sweep failed")

    def sweep(self) -> list[str]:
        """Renew the jobs with new traffic, delete those whose lease lapsed; their keys."""
        if not self.enabled:
            return []
        now = time.monotonic()
        with self.registry.cond:
            jobs = list(self.registry.jobs.values())
        # the backend's counters outside the server's lock (they may take the backend's own)
        traffic = {job.token: self._contributions(job) for job in jobs}
        gone = []
        with self.registry.cond:
            live = {j.token for j in self.registry.jobs.values()}
            for job in jobs:
                self._renewed.setdefault(job.token, now)  # a new job's lease starts now
                seen = traffic[job.token]
                if seen is not None and seen != self._traffic.get(job.token):
                    self._traffic[job.token] = seen
                    self._renewed[job.token] = now
                # still in its register barrier, which has its timeout; or a job no lease ends
                if not job.complete or not job.leased:
                    self._renewed[job.token] = now
                quiet = now - self._renewed.get(job.token, now)
                if job.token in live and quiet > self.seconds:
                    log.warning(
                        "job %r: no request from its members' connections and no traffic for "
                        "%.0f s (the lease is %g s): deleted",
                        job.key,
                        quiet,
                        self.seconds,
                    )
                    self.registry.delete(job)
                    gone.append(job.key)
            for token in set(self._renewed) - live:  # ended jobs: forget them
                self._renewed.pop(token, None)
                self._traffic.pop(token, None)
        self.expired += gone
        self.expiries += len(gone)
        return gone

    def _contributions(self, job) -> int | None:
        """The aggregator's count of the job's contributions, all workers; None if unknown."""
        backend = self.registry.backend
        if not isinstance(backend, WorkerCounters):
            return None
        try:
            per = backend.worker_counters(job.spec.job_id)
        except Exception:  # the job just went, or the backend cannot tell: no renewal
            return None
        return sum(int(c.get("contributions", 0)) for c in per.values())
