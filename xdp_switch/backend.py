"""The job/worker vocabulary every aggregator target speaks (XDP, the software model, bmv2).

The control endpoint (`xdp-agg serve`), the CLI and the tests talk to an aggregator only through
this interface, so the host library drives each target the same way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Protocol

from . import wire
from .abi import Delivery


@dataclass
class JobSpec:
    """A job as the control plane creates it."""

    job_id: int  # 0..MAX_JOBS-1, the aggregator's own id
    num_workers: int  # n
    elems: int  # int32 elements per packet (a wire size)
    slot_base: int  # first slot of the job's range in the pool
    slot_count: int  # slots in the range (>= the hosts' window)
    agg_port: int = wire.UDP_PORT  # UDP port the job's workers send to (0xBEE0..0xBEEF)
    delivery: Delivery = Delivery.GROUP_TX
    agg_ip: str = "0.0.0.0"  # source address of results (one-arm)
    agg_mac: str = "00:00:00:00:00:00"  # source MAC of results (one-arm)
    group_ip: str = "0.0.0.0"  # one-arm: where results go (multicast or subnet broadcast)
    group_mac: str = "ff:ff:ff:ff:ff:ff"  # one-arm: MAC of group_ip
    job_number: int = 0  # the hosts' job counter (low 8 bits on the wire), informational
    # Verify the UDP checksum of each contribution (a zero checksum means the sender sent none,
    # legal for IPv4) and drop wrong ones as drop_bad_checksum. Off by default: it costs a pass
    # over the payload per packet (README, "UDP checksums"), and NIC offload makes it rarely needed.
    udp_checksum: bool = False

    def __post_init__(self) -> None:
        wire.size_code_for(self.elems)  # raises on a size that is not on the wire
        if (self.agg_port & wire.UDP_PORT_MASK) != wire.UDP_PORT:
            raise ValueError(f"aggregator port {self.agg_port:#x} is not in 0xBEE0..0xBEEF")
        self.delivery = Delivery(self.delivery)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["delivery"] = self.delivery.name.lower()
        return d


@dataclass
class WorkerSpec:
    """One worker of a job: how the aggregator recognises it and reaches it."""

    job_id: int
    index: int  # 0..n-1 (its rank)
    ip: str  # its IPv4 address
    port: int  # its UDP port (results go there)
    agg_port: int = wire.UDP_PORT  # the aggregator port it sends to
    mac: str = "00:00:00:00:00:00"  # its MAC (switch mode)
    extra: dict = field(default_factory=dict)  # target-specific (e.g. ifindex)

    def to_dict(self) -> dict:
        return asdict(self)


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
