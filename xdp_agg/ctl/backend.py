"""The job/worker vocabulary every aggregator target speaks (XDP, the software model, bmv2).

The control endpoint (`xdp-agg serve`), the CLI and the tests talk to an aggregator only through
this interface, so the host library drives each target the same way. Backend is what every
target has; the capabilities below it are what some have, each a protocol of its own that the
endpoint and the metrics (xdp_agg.app.metrics) test with isinstance (they are runtime_checkable)
before they use it:

| capability | who uses it, for what | targets |
|---|---|---|
| JobCounters | `diagnose` answers the job's counters by reason; metrics too | xdp, soft, bmv2 |
| WorkerCounters | `status` and `diagnose` say how far each rank got; metrics | xdp, soft |
| JobLoss | `diagnose` says why the aggregator no longer has a job | xdp |
| Generation | the saved job table names the attachment it was made on | xdp |
| ParentStatus | `status` shows a rack job's parent link and its counters | xdp, bmv2 |
| ParentJoin | `create` joins the parent's job first (a rack of a two-level tree) | tree |
| ElemSizes | `ping` says which packet sizes the target takes (elems="auto") | xdp, bmv2 |
| CounterRows | metrics read every job's counters in one call | bmv2 |
| AllWorkerCounters | metrics read every job's per-worker counters in one call | xdp |
| ProgramStats | metrics show the kernel programs' run time, memory, id and tag | xdp |
| SparseJobs | `create` makes jobs sparse (ServerDefaults.sparse) at its sizes | xdp, soft, bmv2 |
| ForwardingStats | metrics show how the switch topology forwards other traffic | xdp |

tests/root/test_backend_contract.py checks each target against each capability it claims, and that
it claims those of the table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable

from xdp_agg.proto import wire
from xdp_agg.proto.jobs import JobSpec, WorkerSpec
from xdp_agg.proto.limits import MAX_JOBS, MAX_WORKERS


@runtime_checkable
class Backend(Protocol):
    """An aggregator target the control plane can configure (runtime_checkable, so that a test
    can ask whether a target has the whole contract)."""

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


# --- the optional capabilities -----------------------------------------------------------------
@runtime_checkable
class JobCounters(Protocol):
    """Packets counted by reason for a job."""

    def counters(self, job_id: int) -> dict[str, int]:
        """{reason name: packets} of job `job_id` (limits.NO_JOB: packets of no job)."""


@runtime_checkable
class WorkerCounters(Protocol):
    """Per-worker counters of a job."""

    def worker_counters(self, job_id: int) -> dict[int, dict]:
        """{worker index: {counter name: value}}, with at least `contributions`."""


@runtime_checkable
class JobLoss(Protocol):
    """Whether the target lost a job's state behind the endpoint's back (e.g. detached)."""

    def job_lost(self, job_id: int) -> str | None:
        """Why job `job_id` is no longer in the aggregator, or None while it is there."""


@runtime_checkable
class Generation(Protocol):
    """An identity of the target's current state, which a restart must find unchanged."""

    def generation(self):
        """A JSON-able value that changes when the target's state starts over."""


@runtime_checkable
class ParentStatus(Protocol):
    """Two-level trees: a rack job's link to its parent."""

    def parent_status(self, job_id: int) -> dict | None:
        """The job's parent link and its counters; None for a job without a parent."""


@runtime_checkable
class ParentJoin(Protocol):
    """A rack endpoint's backend: a job is created as a rack of the parent's job."""

    def join_parent(self, name: str, spec: JobSpec, *, window: int, worker_port: int) -> JobSpec:
        """Join job `name` at the parent; the spec of the rack job to create (with the link)."""


@runtime_checkable
class UplinkAddress(Protocol):
    """Two levels, a target with several ports (bmv2): its own address toward a parent, which
    a rack registers as at the parent. Without it a rack registers as the job's agg_ip/agg_mac
    (the XDP target's one interface). Not a capability of the endpoint's: TreeBackend asks."""

    def uplink_address(self, ip: str) -> tuple[str, str]:
        """Our (IPv4 address, MAC) toward the parent at `ip`; ValueError when none leads there."""


@runtime_checkable
class ElemSizes(Protocol):
    """The packet sizes (int32 per packet) a target aggregates; without it, every wire size."""

    def elem_sizes(self) -> tuple[int, ...]:
        """The sizes of xdp_agg.proto.wire.SIZE_CODE_ELEMS this target takes now, ascending."""


@runtime_checkable
class CounterRows(Protocol):
    """JobCounters of several rows in one call (bmv2: one simple_switch_CLI run, not one per
    row)."""

    def counter_rows(self, rows: list[int]) -> dict[int, dict[str, int]]:
        """{row: counters(row)} for each of `rows` (job ids, limits.NO_JOB)."""


@runtime_checkable
class AllWorkerCounters(Protocol):
    """WorkerCounters of every job in one call (XDP: the workers map read once)."""

    def all_worker_counters(self) -> dict[int, dict[int, dict]]:
        """{job id: worker_counters(job id)} of every job that has workers."""


@dataclass(frozen=True)
class KernelProgram:
    """One attached BPF program as the kernel reports it (bpf_prog_info, /proc fdinfo)."""

    run_time_ns: int  # counted only while kernel.bpf_stats_enabled = 1
    run_cnt: int  # the same
    memlock: int  # bytes of kernel memory
    id: int  # the kernel's program id (bpftool prog show id ID)
    tag: str  # the hash of its instructions, 16 hex digits (bpftool's tag)


@dataclass(frozen=True)
class KernelStats:
    """What ProgramStats reads: whether the kernel counts run time, each attached program by
    name, and each map's kernel memory in bytes by name."""

    bpf_stats_enabled: bool
    programs: dict[str, KernelProgram]
    maps: dict[str, int]

    def to_dict(self) -> dict:
        """As JSON: {"bpf_stats_enabled", "programs": {name: {field: value}}, "maps"}."""
        return asdict(self)


@runtime_checkable
class ProgramStats(Protocol):
    """A target whose aggregator is kernel BPF programs: their statistics."""

    def program_stats(self) -> KernelStats | None:
        """The attached programs and maps now; None where the target has no BPF programs."""


@runtime_checkable
class ForwardingStats(Protocol):
    """A target that forwards the traffic that is not aggregation traffic between its ports
    (the XDP switch topology, xdp_switch.forwarding)."""

    def forwarding_stats(self) -> dict | None:
        """{"mode": routed, switched or off, "counters": {outcome: frames}, "mac_table":
        {"entries", "size"}}; None where the target does not forward."""


@runtime_checkable
class SparseJobs(Protocol):
    """A target that runs sparse rounds (docs/protocol.md section 8)."""

    def sparse_elems(self) -> tuple[int, ...]:
        """The packet sizes (int32 per packet) at which it runs sparse jobs, ascending."""

    def pads_empty(self) -> bool:
        """Whether its sparse jobs need empty contributions padded to a block's length (it
        writes a result into the packet that completes or asks, and cannot grow one)."""


CAPABILITIES = (
    JobCounters,
    WorkerCounters,
    JobLoss,
    Generation,
    ParentStatus,
    ParentJoin,
    ElemSizes,
    CounterRows,
    AllWorkerCounters,
    ProgramStats,
    SparseJobs,
    ForwardingStats,
)


def sparse_elems(backend) -> list[int]:
    """The packet sizes at which `backend` runs sparse jobs (SparseJobs); none without it."""
    return sorted(backend.sparse_elems()) if isinstance(backend, SparseJobs) else []


def elem_sizes(backend) -> list[int]:
    """The packet sizes `backend` aggregates (ElemSizes), else every wire size."""
    if isinstance(backend, ElemSizes):
        return sorted(backend.elem_sizes())
    return sorted(wire.SIZE_CODE_ELEMS.values())


def capabilities(backend) -> set[str]:
    """The names of the capabilities `backend` has."""
    return {c.__name__ for c in CAPABILITIES if isinstance(backend, c)}


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
