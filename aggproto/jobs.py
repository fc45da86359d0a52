"""A job, as the control plane creates it and as the hosts are told about it.

JobSpec is what a backend (an aggregator target) is asked to create, WorkerSpec one registered
worker, and JobDescription what the control endpoint answers a worker about its job: one
dataclass, written as JSON by the server (aggctl.server) and read back by the host library
(hostlib.rendezvous), so both sides name the same fields.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import IntEnum

from . import wire

DEFAULT_CONTROL_PORT = 48800  # TCP port of the control endpoint (xdp-agg serve)


class Delivery(IntEnum):
    """How a job's results reach its workers."""

    GROUP_TX = 0  # one-arm: the result once to the job's group address
    BROADCAST = 1  # switch: one copy per port, each addressed to that port's worker


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
        if isinstance(self.delivery, str):  # the JSON form (to_dict) names it
            self.delivery = Delivery[self.delivery.upper()]
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


@dataclass(frozen=True)
class JobDescription:
    """What the control endpoint tells a worker about its job (the "job" of its answers)."""

    key: str  # the job's name, as hostlib.init(job=...) gave it
    spec: JobSpec  # the job as the aggregator runs it
    world_size: int  # ranks in the job
    window: int  # slots per worker: slot_base .. slot_base + window - 1
    worker_port: int  # UDP port every worker binds (results are sent there)
    send_to: tuple[str, int]  # where contributions go: the aggregator's address and port
    group: tuple[str, int] | None = None  # one-arm multicast group to join, if any
    workers: tuple[dict, ...] = ()  # registered ranks so far: {"rank", "ip", "port"}

    def to_dict(self) -> dict:
        """The JSON form: the spec's fields, flat, and the description's own."""
        d = self.spec.to_dict()
        d.update(
            key=self.key,
            world_size=self.world_size,
            window=self.window,
            worker_port=self.worker_port,
            send_to=list(self.send_to),
            group=list(self.group) if self.group else None,
            workers=list(self.workers),
        )
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "JobDescription":
        """Read the JSON form back; ValueError naming what is missing or malformed."""
        try:
            spec_fields = {f.name for f in fields(JobSpec)}
            spec = JobSpec(**{k: v for k, v in d.items() if k in spec_fields})
            host, port = d["send_to"]
            group = tuple(d["group"]) if d.get("group") else None
            return cls(
                key=str(d["key"]),
                spec=spec,
                world_size=int(d["world_size"]),
                window=int(d["window"]),
                worker_port=int(d["worker_port"]),
                send_to=(str(host), int(port)),
                group=group,
                workers=tuple(d.get("workers") or ()),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a job description ({type(e).__name__}: {e}): {d!r}") from None
