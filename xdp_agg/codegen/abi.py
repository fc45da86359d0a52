"""The XDP aggregator's internal ABI: map layouts and constants shared by BPF and Python.

Like the wire format, this is defined once here (the protocol's limits and reasons come from
xdp_agg.proto, and are written into the same header). bpf/generated/abi.h is generated from it (as
libbpf-bootstrap shares one header between BPF and user space), and the ctypes structures the
control plane uses to read and write the pinned maps are built from the same tables, so the two
sides cannot disagree on an offset. Tests compare both against the BTF of the loaded program.
"""

from __future__ import annotations

import ctypes as ct
from dataclasses import dataclass
from enum import IntFlag

from xdp_agg.proto.limits import MAX_ELEMS, MAX_JOBS, MAX_PORTS, MAX_WORKERS, NO_JOB, PARENT_INDEX
from xdp_agg.proto.reasons import NUM_REASONS


class JobFlag(IntFlag):
    """Per-job options of the data path (bits of agg_job.flags)."""

    VERIFY_UDP_CSUM = 1  # drop contributions whose (nonzero) UDP checksum is wrong
    TREE = 2  # a rack job: completed slots go to the parent aggregator (the parent_* fields)
    SPARSE = 4  # a sparse job: takes sparse contributions too (docs/protocol.md section 8)
    WIRE16 = 8  # a job of 16-bit elements: its packets carry the width bit (protocol.md 5.6)


# --- structures --------------------------------------------------------------------------------
_CTYPES = {
    "__u8": ct.c_uint8,
    "__u16": ct.c_uint16,
    "__u32": ct.c_uint32,
    "__u64": ct.c_uint64,
    "__s8": ct.c_int8,
    "__s32": ct.c_int32,
    "__be16": ct.c_uint16,  # raw network order; see ctl_maps for conversion
    "__be32": ct.c_uint32,
}


@dataclass(frozen=True)
class F:
    """One structure member: C type, array length (1 = scalar), purpose."""

    name: str
    ctype: str
    doc: str
    count: int = 1


@dataclass(frozen=True)
class Struct:
    """A structure shared by BPF C and Python (no implicit padding allowed)."""

    name: str
    doc: str
    fields: tuple[F, ...]

    def ctypes(self) -> type[ct.Structure]:
        """A ctypes.Structure with exactly this layout."""
        fs = []
        for f in self.fields:
            t = _CTYPES[f.ctype]
            fs.append((f.name, t * f.count if f.count > 1 else t))
        cls = type(self.name, (ct.Structure,), {"_fields_": fs})
        unpadded = sum(ct.sizeof(t) for _, t in fs)
        if ct.sizeof(cls) != unpadded:
            raise TypeError(f"struct {self.name} has implicit padding")
        return cls


JOB = Struct(
    "agg_job",
    "a job: value of map `jobs`, key = job id",
    (
        F("active", "__u32", "1 when configured"),
        F("num_workers", "__u32", "n, 1..MAX_WORKERS"),
        F("elems", "__u32", "int32 elements per packet"),
        F("size_code", "__u32", "wire size code of elems"),
        F("slot_base", "__u32", "first slot of the job's range"),
        F("slot_count", "__u32", "slots in the range"),
        F("delivery", "__u32", "enum Delivery"),
        F("epoch", "__u32", "unique per creation; tags per-CPU partial sums"),
        F("agg_port", "__u32", "UDP port the job's workers send to (control-plane record)"),
        F("flags", "__u32", "enum JobFlag bits"),
        F("agg_mac", "__u8", "one-arm: source MAC of results", 6),
        F("group_mac", "__u8", "one-arm: destination MAC of results", 6),
        F("agg_ip", "__be32", "source address of results"),
        F("group_ip", "__be32", "one-arm: destination address of results"),
        F("parent_mac", "__u8", "tree: destination MAC of partial sums sent up", 6),
        F("parent_port", "__be16", "tree: the parent job's aggregator port"),
        F("uplink_port", "__be16", "tree: our source port up, where parent results arrive"),
        F("down_port", "__be16", "tree: our workers' port, where parent results go down"),
        F("parent_ip", "__be32", "tree: the parent aggregator's address"),
        F("parent_slot_base", "__u32", "tree: the parent job's slot for our slot_base"),
    ),
)

WORKER_KEY = Struct(
    "agg_worker_key",
    "key of map `workers`: how a packet's job and worker are found",
    (
        F("addr", "__be32", "worker's IPv4 source address"),
        F("port", "__be16", "aggregator UDP port it sends to (0xBEE0..0xBEEF)"),
        F("pad", "__u16", "0"),
    ),
)

WORKER = Struct(
    "agg_worker",
    "value of map `workers`",
    (
        F("job", "__u32", "job id"),
        F("index", "__u32", "worker index 0..n-1"),
        F("mac", "__u8", "its source MAC, matched too when match_mac is 1", 6),
        F("match_mac", "__u8", "1: a frame must come from mac (the worker is on-link)"),
        F("pad", "__u8", "0"),
    ),
)

SLOT = Struct(
    "agg_slot",
    "shared state of one slot, both versions: value of map `slots`, key = slot",
    (
        F("seen", "__u64", "per version: bitmap of workers seen in the current round", 2),
        F("arrivals", "__u64", "per version: new contributions ever (round = arrivals / n)", 2),
        F("added", "__u64", "per version: contributions whose addition finished", 2),
        F("published", "__u64", "per version: rounds whose result is stored", 2),
        F("up", "__u64", "tree, per version: rounds complete here and sent up", 2),
        F("up_round", "__u64", "tree, per version: tsi << 8 | job_number of the last sent up", 2),
        F(
            "round_key",
            "__u64",
            "sparse, per version: kind, block, blocks of the round in progress; 0 between rounds",
            2,
        ),
    ),
)

PARTIAL = Struct(
    "agg_partial",
    "one CPU's partial sum: value of per-CPU map `partials`, key = slot * 2 + version",
    (
        F("tag", "__u64", "epoch << 32 | round this sum belongs to"),
        F("e0", "__s32", "max e0 of the contributions added here"),
        F("e1", "__s32", "max e1 of the contributions added here"),
        F("count", "__u32", "contributions of this round added here"),
        F("next", "__u32", "sparse: the smallest next added here (e0: the max of those naming it)"),
        F("has_data", "__u32", "sparse: 1 when a contribution with data was added here (sum)"),
        F("pad", "__u32", "0"),
        F(
            "sum",
            "__s32",
            "partial sums, host order, each pair swapped (bpf/aggregate.h)",
            MAX_ELEMS,
        ),
    ),
)

RESULT = Struct(
    "agg_result",
    "a published result: value of map `results`, key = slot * 2 + version",
    (
        F("e0", "__s32", "max e0"),
        F("e1", "__s32", "max e1"),
        F("key", "__u64", "sparse: the round's kind, block and blocks (bpf/aggregate.h)"),
        F("next", "__u32", "sparse: the smallest next of the round"),
        F("has_data", "__u32", "sparse: 1 when a contribution carried data (else no payload)"),
        F("data", "__be32", "the sum, network order", MAX_ELEMS),
    ),
)

PORT_KEY = Struct(
    "agg_port_key",
    "key of map `port_workers`: an egress port and a job",
    (F("ifindex", "__u32", "egress interface"), F("job", "__u32", "job id")),
)

PORT_WORKER = Struct(
    "agg_port_worker",
    "switch mode: how to address the worker of a job behind a port",
    (
        F("mac", "__u8", "worker MAC", 6),
        F("agg_mac", "__u8", "our MAC on that port", 6),
        F("ip", "__be32", "worker address"),
        F("agg_ip", "__be32", "our address as the worker knows it"),
        F("port", "__be16", "worker's registered UDP port (results: the request's source port)"),
        F("agg_port", "__be16", "our UDP port"),
        F("index", "__u32", "worker index"),
    ),
)

WORKER_STATS = Struct(
    "agg_worker_stats",
    "per-CPU counters per worker: map `worker_stats`, key = job * MAX_WORKERS + index",
    (
        F("packets", "__u64", "packets of ours from this worker"),
        F("contributions", "__u64", "new contributions"),
        F("duplicates", "__u64", "retransmissions and duplicates"),
        F("answered", "__u64", "retransmissions answered with the stored result"),
        F("dropped", "__u64", "dropped by a check (type, size, length, slot, checksum, sparse)"),
    ),
)

STRUCTS = (JOB, WORKER_KEY, WORKER, SLOT, PARTIAL, RESULT, PORT_KEY, PORT_WORKER, WORKER_STATS)

Job = JOB.ctypes()
WorkerKey = WORKER_KEY.ctypes()
Worker = WORKER.ctypes()
Slot = SLOT.ctypes()
Partial = PARTIAL.ctypes()
Result = RESULT.ctypes()
PortKey = PORT_KEY.ctypes()
PortWorker = PORT_WORKER.ctypes()
WorkerStats = WORKER_STATS.ctypes()

# Constants exported to C as #defines (name -> value, comment).
CONSTANTS = {
    "AGG_MAX_JOBS": (MAX_JOBS, "job ids 0..AGG_MAX_JOBS-1"),
    "AGG_MAX_WORKERS": (MAX_WORKERS, "workers per job (u64 bitmap)"),
    "AGG_MAX_PORTS": (MAX_PORTS, "devmap entries"),
    "AGG_MAX_ELEMS": (MAX_ELEMS, "int32 per packet, upper bound"),
    "AGG_NO_JOB": (NO_JOB, "counter row of packets without a job"),
    "AGG_NUM_REASONS": (NUM_REASONS, "counters per job"),
    "AGG_PARENT_INDEX": (PARENT_INDEX, "worker index of a tree job's parent aggregator"),
}
