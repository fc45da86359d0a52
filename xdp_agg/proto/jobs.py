"""A job, as the control plane creates it and as the hosts are told about it.

JobSpec is what a backend (an aggregator target) is asked to create, WorkerSpec one registered
worker, and JobDescription what the control endpoint answers a worker about its job: one
dataclass, written as JSON by the server (xdp_agg.ctl.server) and read back by the host library
(hostlib.rendezvous), so both sides name the same fields.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import IntEnum

from . import wire
from .limits import MAX_TREE_WORKERS

DEFAULT_CONTROL_PORT = 48800  # TCP port of the control endpoint (xdp-agg serve)


def mac_bytes(mac: str) -> bytes:
    """The 6 bytes of a MAC written aa:bb:cc:dd:ee:ff; ValueError for anything else."""
    parts = mac.split(":")
    if len(parts) != 6:
        raise ValueError(f"not a MAC address: {mac!r}")
    return bytes(int(p, 16) for p in parts)


class Delivery(IntEnum):
    """How a job's results reach its workers."""

    GROUP_TX = 0  # one-arm: the result once to the job's group address
    BROADCAST = 1  # switch: one copy per port, each addressed to that port's worker
    UNICAST = 2  # one-arm: one copy per worker, to its own MAC and address (no group to join)


@dataclass
class JobSpec:
    """A job as the control plane creates it."""

    job_id: int  # 0..MAX_JOBS-1, the aggregator's own id
    num_workers: int  # n
    elems: int  # payload words per packet (a wire size): int32 elements, or 16-bit pairs
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
    # over the payload per packet (docs/design.md, "UDP checksums"), and NIC offload makes it
    # rarely needed.
    udp_checksum: bool = False
    # Two levels (docs/protocol.md section 3.7): a rack job with a parent forwards each slot it
    # completes as one contribution to the parent aggregator's job, where this aggregator is one
    # worker, and sends its workers the parent's result. parent_ip 0.0.0.0: no parent.
    parent_ip: str = "0.0.0.0"  # the parent aggregator's address
    parent_mac: str = "00:00:00:00:00:00"  # its MAC, or the next hop's
    parent_port: int = 0  # the parent job's aggregator port (0xBEE0..0xBEEF)
    parent_slot_base: int = 0  # the parent job's first slot: our slot_base + i is its base + i
    uplink_port: int = 0  # our UDP port toward the parent (0xBEE0..0xBEEF; 0: agg_port)
    worker_port: int = 0  # the UDP port of our workers, where the parent's results go down
    total_workers: int = 0  # workers under the root (float scaling's n); 0: num_workers
    # A sparse job (docs/protocol.md section 8) takes sparse contributions (msg_type 2 and 3) as
    # well as dense ones, a round's first contribution deciding which; a dense job drops them.
    sparse: bool = False
    # A sparse job whose hosts pad their empty contributions to a block's length (8.1): room
    # for a result with data, for a target that cannot grow a frame in place (XDP).
    pad_empty: bool = False
    # The element width (docs/protocol.md section 5.6): 32, one int32 per word (p4app-switchML's
    # format), or 16, two block-scaled 16-bit elements per word; packets of the other width
    # are dropped as drop_bad_width.
    wire_bits: int = 32

    def __post_init__(self) -> None:
        wire.size_code_for(self.elems)  # raises on a size that is not on the wire
        wire.check_wire_bits(self.wire_bits)
        if (self.agg_port & wire.UDP_PORT_MASK) != wire.UDP_PORT:
            raise ValueError(f"aggregator port {self.agg_port:#x} is not in 0xBEE0..0xBEEF")
        if isinstance(self.delivery, str):  # the JSON form (to_dict) names it
            self.delivery = Delivery[self.delivery.upper()]
        self.delivery = Delivery(self.delivery)
        if self.has_parent:
            self._check_parent()
        if self.sparse and self.has_parent:
            raise ValueError("a sparse job cannot have a parent (two levels are dense only)")

    @property
    def has_parent(self) -> bool:
        """True for a rack job of a two-level tree."""
        return self.parent_ip not in ("", "0.0.0.0")

    @property
    def elems_per_packet(self) -> int:
        """Elements a packet carries: elems words, two elements each at 16 bits."""
        return self.elems * wire.elems_per_word(self.wire_bits)

    @property
    def scale_workers(self) -> int:
        """The n of float scaling (docs/protocol.md section 5.1): every worker under the root."""
        return self.total_workers or self.num_workers

    def _check_parent(self) -> None:
        if not self.uplink_port:
            self.uplink_port = self.agg_port
        for name in ("parent_port", "uplink_port"):
            p = getattr(self, name)
            if (p & wire.UDP_PORT_MASK) != wire.UDP_PORT:
                raise ValueError(f"{name} {p:#x} is not in 0xBEE0..0xBEEF")
        if not 1 <= self.worker_port <= 65535:
            raise ValueError("a job with a parent needs its workers' UDP port (worker_port)")
        if self.num_workers > MAX_TREE_WORKERS:
            raise ValueError(f"a job with a parent has at most {MAX_TREE_WORKERS} workers")
        if self.total_workers and self.total_workers < self.num_workers:
            raise ValueError("total_workers counts every worker under the root: >= num_workers")
        if self.parent_slot_base < 0 or self.parent_slot_base + self.slot_count > 1 << 14:
            raise ValueError("the parent's slots are outside the 14-bit slot field")

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
    # every rank's lanes (hostlib HostOptions.lanes: ports worker_port .. + lanes - 1), as rank 0
    # created the job; 1 where it did not say (an older rank 0)
    lanes: int = 1

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
            lanes=self.lanes,
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
                lanes=int(d.get("lanes") or 1),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a job description ({type(e).__name__}: {e}): {d!r}") from None
