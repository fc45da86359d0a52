"""The job/worker vocabulary every aggregator target speaks (XDP, the software model, bmv2).

The control endpoint (`xdp-agg serve`), the CLI and the tests talk to an aggregator only through
this interface, so the host library drives each target the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from aggproto.jobs import JobSpec, WorkerSpec
from aggproto.limits import MAX_JOBS, MAX_WORKERS


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


# --- the checks every backend makes, written once ---------------------------------------------
class _JobShape(Protocol):
    """What check_worker needs of a job: a JobSpec, or a target's own record of one."""

    num_workers: int
    agg_port: int


def check_job(spec: JobSpec, ranges: Mapping[int, tuple[int, int]], pool_slots: int) -> None:
    """ValueError when `spec` cannot be created beside the jobs a backend has.

    `ranges`: job id -> (slot_base, slot_count) of the jobs that exist (the spec's own id may be
    among them: re-creating a job replaces it, so its old range does not count); `pool_slots`:
    the slots this target has (0..pool_slots-1).
    """
    if not 0 <= spec.job_id < MAX_JOBS:
        raise ValueError(f"job id {spec.job_id} is not in 0..{MAX_JOBS - 1}")
    if not 1 <= spec.num_workers <= MAX_WORKERS:
        raise ValueError(f"{spec.num_workers} workers: a job has 1..{MAX_WORKERS}")
    end = spec.slot_base + spec.slot_count
    if spec.slot_count < 1 or spec.slot_base < 0 or end > pool_slots:
        raise ValueError(
            f"slots {spec.slot_base}..{end - 1} are outside the pool of {pool_slots} "
            "(a larger pool, or a smaller range)"
        )
    for other_id, (base, count) in sorted(ranges.items()):
        if other_id != spec.job_id and base < end and spec.slot_base < base + count:
            raise ValueError(
                f"slots {spec.slot_base}..{end - 1} overlap job {other_id}'s "
                f"{base}..{base + count - 1}"
            )


def check_worker(
    worker: WorkerSpec, job: _JobShape | None, owners: Mapping[tuple[str, int], tuple[int, int]]
) -> None:
    """ValueError when `worker` cannot be registered.

    `job`: the worker's job as the backend has it (None: no such job); `owners`: (ip, agg_port)
    -> (job id, index) of every worker registered, in any job. A worker is recognised by its
    address and the port it sends to, so an address may be one worker only; an index is
    re-registered only from the address it has (the same worker coming back).
    """
    if job is None:
        raise ValueError(f"job {worker.job_id} does not exist: create it first")
    if not 0 <= worker.index < job.num_workers:
        raise ValueError(f"worker index {worker.index} is outside 0..{job.num_workers - 1}")
    if worker.agg_port != job.agg_port:
        raise ValueError(
            f"worker sends to port {worker.agg_port:#x} but job {worker.job_id} listens on "
            f"{job.agg_port:#x}"
        )
    me = (worker.job_id, worker.index)
    owner = owners.get((worker.ip, worker.agg_port))
    if owner is not None and owner != me:
        raise ValueError(
            f"{worker.ip} -> port {worker.agg_port:#x} is already worker {owner[1]} "
            f"of job {owner[0]}"
        )
    for (ip, _), who in owners.items():
        if who == me and ip != worker.ip:
            raise ValueError(f"job {worker.job_id} already has a worker {worker.index} ({ip})")
