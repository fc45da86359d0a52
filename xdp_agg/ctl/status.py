"""The control endpoint's answers about a job: `status` (who registered, who is missing) and
`diagnose` (what the aggregator counted, who lags, why the job is gone)."""

from __future__ import annotations

import time

from . import auth
from .backend import JobCounters, JobLoss, ParentStatus, WorkerCounters
from .fields import float_field, request_key
from .registry import JobRegistry, _EndpointJob


class JobStatus:
    """The ops status and diagnose, answered from `registry`'s job table and its backend's
    counters (ControlEndpoint owns one, beside the registry)."""

    def __init__(self, registry: JobRegistry) -> None:
        self.registry = registry

    def status(self, conn, req, local, peer):
        """op status: one job (waiting up to `wait` s for it), or all (server.py's docstring)."""
        if req.get("job") is None:
            self.registry.guard.need_secret(req, "status of all jobs")
            with self.registry.cond:
                return {"jobs": [self._summary(j, local) for j in self.registry.jobs.values()]}
        key = request_key(req)
        wait = float_field(req, "wait") if req.get("wait") is not None else 0.0
        if not self.registry.guard.has_credentials(req):  # refused now, not after a wait
            self.registry.guard.need_secret(req, f"status of job {key!r} (without its token)")
        with self.registry.cond:
            deadline = time.monotonic() + min(wait, self.registry.defaults.barrier_timeout)
            while not self.registry.stopping:
                job = self.registry.jobs.get(key)
                if job is not None and job.state != "closing":
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.registry.cond.wait(left)
            # raises the explanation if there is none
            job = self.registry.live_job(key, waited=wait, reveal=req.proven)
            self.registry.guard.need_job(req, key, job.token)
            out = self._summary(job, local)
            if req.proven:  # a holder of the secret may learn the token (ranks > 0 do)
                out["token"] = job.token
        # backend calls outside our lock: they may take the backend's own locks
        if isinstance(self.registry.backend, WorkerCounters):
            counters = self.registry.backend.worker_counters(job.spec.job_id)
            out["counters"] = {str(k): v for k, v in counters.items()}
        if isinstance(self.registry.backend, ParentStatus):  # a rack of a two-level tree
            out["parent"] = self.registry.backend.parent_status(job.spec.job_id)
        return out

    def diagnose(self, conn, req, local, peer):
        """op diagnose: status, plus what the aggregator counted, who lags, who is gone."""
        # the same credentials as status; `wait` is not diagnose's, and the proof (checked once
        # in handle) comes along as `proven`
        inner = auth.Checked({k: v for k, v in req.items() if k != "wait"})
        inner.proven = req.proven
        out = self.status(conn, inner, local, peer)
        out.pop("token", None)
        counters = {int(k): v for k, v in out.get("counters", {}).items()}
        if isinstance(self.registry.backend, JobCounters):
            out["reasons"] = self.registry.backend.counters(out["job"]["job_id"])
        if isinstance(self.registry.backend, JobLoss):  # the aggregator's state for it is gone
            lost = self.registry.backend.job_lost(out["job"]["job_id"])
            if lost:
                out["lost"] = lost
        out["absent"] = sorted(set(out["missing"]) | set(out["left"]))
        contrib = {r: counters.get(r, {}).get("contributions", 0) for r in out["registered"]}
        lagging = {}
        if counters and contrib:
            top = max(contrib.values())
            lagging = {str(r): c for r, c in contrib.items() if c < top}
        out["most_contributions"] = max(contrib.values()) if contrib else 0
        out["gone"] = self._gone_detail(out["job"]["key"])
        for r in out["gone"]:
            lagging.pop(r, None)  # a gone rank's counters are removed with it: "gone" says more
        out["lagging"] = lagging
        return out

    def _gone_detail(self, key: str) -> dict:
        """Rank -> {state, at (epoch s), contributions (when it went)} for ranks that left or
        whose control connection closed."""
        with self.registry.cond:
            job = self.registry.jobs.get(key)
            if job is None:
                return {}
            return {
                str(r): {"state": x.state, "at": x.gone_at, "contributions": x.contributions}
                for r, x in sorted(job.ranks.items())
                if x.state != "registered"
            }

    def _summary(self, job: _EndpointJob, local) -> dict:
        return {
            "job": self.registry.describe(job, local),
            "state": job.state,
            "registered": sorted(job.ranks),
            "missing": job.missing(),
            "left": job.gone,
            # ranks holding the job through a live control connection (not recovered-only)
            "connected": sorted(
                r for r, x in job.ranks.items() if x.state == "registered" and x.holder is not None
            ),
        }
