"""Two-level trees from the control side: a rack's control endpoint joins the parent's job.

`xdp-agg serve --parent-endpoint ROOT:PORT --rack-rank R --racks N` runs a rack's endpoint in front
of a TreeBackend. When the rack's rank 0 creates job NAME there, the backend first makes the rack
rank R of the job NAME of N ranks at the parent's endpoint (the parent's rank-0 rack creates it, the
others wait for it and register), exactly as a host joins a job (docs/protocol.md section 6.3), then
creates the rack job with the parent link filled in from the parent's description: the parent's
address and aggregator port (its `send_to`), its MAC (`agg_mac`: the parent is on the rack's uplink
segment; `--parent-mac` names a next hop instead), its slots, and the uplink port, the UDP port the
rack sends up from and the parent's results come to (the parent job's `worker_port`: the rack-0 rack
chooses it, its own job's aggregator port, and every other rack uses the same, as every worker of a
one-arm job does).

The rack endpoint proves the parent's deployment secret (`--parent-secret-file`, by default
its own secret: one secret per tree) to create and join the parent's job; the job's token comes
back in the answers, as for a host.

The connection to the parent holds the rack's place in the parent's job for the life of the rack
job (the parent's endpoint treats its close as the rack leaving); deleting the rack job closes
it. The register barrier of the parent's job waits for every rack, so the rack endpoint answers
its own rank 0's `create` only once every rack has a job.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from hostlib.errors import RendezvousError
from hostlib.rendezvous import ControlClient
from xdp_agg.proto.jobs import JobSpec, WorkerSpec

from .backend import (
    AllWorkerCounters,
    CounterRows,
    ForwardingStats,
    Generation,
    JobCounters,
    JobLoss,
    KernelStats,
    ParentStatus,
    ProgramStats,
    UplinkAddress,
    WorkerCounters,
    elem_sizes,
)

log = logging.getLogger("xdp_agg.ctl.tree")


class ParentRefused(ValueError):
    """The parent refused the rack, or could not be reached: the Backend contract's refusal
    (a ValueError), which the control endpoint answers to the rack's rank 0."""


def parse_endpoint(text: str) -> tuple[str, int]:
    """'HOST:PORT' of a parent (its control endpoint, or its job's address and port)."""
    from hostlib.rendezvous import parse_endpoint as parse

    return parse(text)


@dataclasses.dataclass(frozen=True)
class ParentLink:
    """Where a rack's endpoint finds its parent and which rack it is."""

    endpoint: tuple[str, int]  # the parent's control endpoint
    rank: int  # this rack's rank in the parent's jobs
    racks: int  # ranks of the parent's jobs (the racks under it)
    total_workers: int = 0  # workers under the root; 0: racks x this rack job's workers
    parent_mac: str | None = None  # next hop toward the parent (None: the parent's own MAC)
    barrier_timeout: float = 120.0  # how long to wait for the other racks
    # the parent endpoint's deployment secret (xdp_agg.proto.control), proven to create and join
    # the parent's job; None: the parent runs without authentication
    secret: bytes | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.racks <= 64 or not 0 <= self.rank < self.racks:
            raise ValueError(f"rack rank {self.rank} is not in 0..{self.racks - 1}")


class TreeBackend:
    """A Backend (xdp_agg.ctl.backend) in front of another (the XDP aggregator's) whose jobs are
    racks of a parent's.

    The control endpoint calls join_parent(name, spec, ...) before create_job (the one hook it
    knows): that joins the parent's job and returns the spec with the parent link."""

    def __init__(self, inner, link: ParentLink) -> None:
        self.inner = inner
        self.link = link
        self._parents: dict[int, ControlClient] = {}  # rack job id -> connection to the parent
        self._lock = threading.Lock()

    def join_parent(self, name: str, spec: JobSpec, *, window: int, worker_port: int) -> JobSpec:
        """Join job `name` at the parent as rank link.rank; the spec of the rack job to create.
        Raises ParentRefused (a ValueError) with the parent's explanation."""
        link = self.link
        uplink = spec.agg_port
        ip, mac = spec.agg_ip, spec.agg_mac
        ctl = None
        try:
            if isinstance(self.inner, UplinkAddress):  # bmv2: its port toward the parent
                ip, mac = self.inner.uplink_address(link.endpoint[0])
            ctl = ControlClient(link.endpoint, timeout=link.barrier_timeout, secret=link.secret)
            wait = link.barrier_timeout
            if link.rank == 0:
                ctl.request(
                    "create",
                    job=name,
                    world_size=link.racks,
                    elems=spec.elems,
                    window=window,
                    worker_port=uplink,
                )
            else:
                desc = ctl.job("status", job=name, wait=wait, reply_timeout=wait + 5)
                uplink = desc.worker_port
            desc = ctl.job(
                "register",
                job=name,
                rank=link.rank,
                port=uplink,
                ip=ip,
                mac=mac,
                timeout=wait,
                reply_timeout=wait + 5,
            )
        except (RendezvousError, OSError, ValueError) as e:
            if ctl is not None:
                ctl.close()
            raise ParentRefused(
                f"joining job {name!r} at the parent {_ep(link.endpoint)}: {e}"
            ) from e
        p = desc.spec
        problem = None
        if p.elems != spec.elems:
            problem = f"the parent's job has {p.elems} elements per packet, this one {spec.elems}"
        elif desc.window < window:
            problem = f"the parent's job has a window of {desc.window}, this one {window}"
        if problem:
            ctl.close()
            raise ParentRefused(f"job {name!r}: {problem}: use the same on every rack")
        out = dataclasses.replace(
            spec,
            parent_ip=desc.send_to[0],
            parent_mac=link.parent_mac or p.agg_mac,
            parent_port=desc.send_to[1],
            parent_slot_base=p.slot_base,
            uplink_port=uplink,
            worker_port=worker_port,
            total_workers=link.total_workers or link.racks * spec.num_workers,
        )
        with self._lock:
            old = self._parents.pop(spec.job_id, None)
            self._parents[spec.job_id] = ctl
        if old is not None:
            old.close()
        log.info("job %r joined the parent %s as rack %d", name, _ep(link.endpoint), link.rank)
        return out

    # --- the Backend contract, the rest delegated ------------------------------------------
    def create_job(self, spec: JobSpec) -> None:
        """Create the rack job (after join_parent); leave the parent's job if that fails."""
        try:
            self.inner.create_job(spec)
        except BaseException:
            self._leave(spec.job_id)
            raise

    def delete_job(self, job_id: int) -> None:
        """Delete the rack job and leave the parent's."""
        try:
            self.inner.delete_job(job_id)
        finally:
            self._leave(job_id)

    def add_worker(self, worker: WorkerSpec) -> None:
        """Register a worker of the rack job (the inner backend's)."""
        self.inner.add_worker(worker)

    def remove_worker(self, job_id: int, index: int) -> None:
        """Unregister a worker of the rack job."""
        self.inner.remove_worker(job_id, index)

    def jobs(self) -> list[dict]:
        """The inner backend's jobs."""
        return self.inner.jobs()

    # --- the capabilities, each the inner backend's (its neutral answer where it has none) ---
    def worker_counters(self, job_id: int) -> dict[int, dict]:
        """Per-worker counters of the rack job ({} where the inner backend counts none)."""
        inner = self.inner
        return inner.worker_counters(job_id) if isinstance(inner, WorkerCounters) else {}

    def counters(self, job_id: int) -> dict:
        """The job's counters by reason, the parent link's among them ({} without)."""
        inner = self.inner
        return inner.counters(job_id) if isinstance(inner, JobCounters) else {}

    def parent_status(self, job_id: int) -> dict | None:
        """The parent link and its counters, when the inner backend knows them."""
        inner = self.inner
        return inner.parent_status(job_id) if isinstance(inner, ParentStatus) else None

    def job_lost(self, job_id: int) -> str | None:
        """Why the inner backend lost the job (None: it has it, or cannot tell)."""
        return self.inner.job_lost(job_id) if isinstance(self.inner, JobLoss) else None

    def elem_sizes(self) -> tuple[int, ...]:
        """The inner backend's packet sizes (every wire size where it does not say)."""
        return tuple(elem_sizes(self.inner))

    def sparse_elems(self) -> tuple[int, ...]:
        """None: a rack job has a parent, and two levels are dense only (JobSpec)."""
        return ()

    def pads_empty(self) -> bool:
        """No sparse jobs (sparse_elems): nothing to pad."""
        return False

    def generation(self):
        """The inner backend's generation (None where it has none)."""
        return self.inner.generation() if isinstance(self.inner, Generation) else None

    def counter_rows(self, rows: list[int]) -> dict[int, dict[str, int]]:
        """The inner backend's counters of `rows` in one call where it has one, else row by
        row."""
        if isinstance(self.inner, CounterRows):
            return self.inner.counter_rows(rows)
        return {row: self.counters(row) for row in rows}

    def all_worker_counters(self) -> dict[int, dict[int, dict]]:
        """The inner backend's per-worker counters of every job, in one call where it has
        one."""
        if isinstance(self.inner, AllWorkerCounters):
            return self.inner.all_worker_counters()
        every = {j["job_id"]: self.worker_counters(j["job_id"]) for j in self.jobs()}
        return {j: ws for j, ws in every.items() if ws}

    def program_stats(self) -> KernelStats | None:
        """The inner backend's BPF programs (None where it has none)."""
        return self.inner.program_stats() if isinstance(self.inner, ProgramStats) else None

    def forwarding_stats(self) -> dict | None:
        """The inner backend's forwarding (None where it does not forward)."""
        return self.inner.forwarding_stats() if isinstance(self.inner, ForwardingStats) else None

    def _leave(self, job_id: int) -> None:
        with self._lock:
            ctl = self._parents.pop(job_id, None)
        if ctl is not None:
            ctl.close()  # the parent's endpoint takes the close as the rack leaving


def _ep(endpoint: tuple[str, int]) -> str:
    return f"{endpoint[0]}:{endpoint[1]}"
