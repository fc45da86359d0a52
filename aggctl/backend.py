"""The job/worker vocabulary every aggregator target speaks (XDP, the software model, bmv2).

The control endpoint (`xdp-agg serve`), the CLI and the tests talk to an aggregator only through
this interface, so the host library drives each target the same way.
"""

from __future__ import annotations

from typing import Protocol


class Backend(Protocol):
    """An aggregator target the control plane can configure."""

    def create_job(self, spec: JobSpec) -> None:
        """Create a job; its slot state starts cleared. Raises ValueError on a bad spec."""

    def delete_job(self, job_id: int) -> None:
        """Delete a job and its workers."""

    def add_worker(self, worker: WorkerSpec) -> None:
        """Register a worker of an existing job."""

    def remove_worker(self, job_id: int, index: int) -> None:
        """Unregister a worker."""

    def jobs(self) -> list[dict]:
        """The configured jobs, each a JobSpec.to_dict() with a 'workers' list."""
