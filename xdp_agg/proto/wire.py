"""The SwitchML wire format: the one definition every implementation derives from.

This module is the single source of truth for the bytes on the wire (docs/protocol.md section 1).
The BPF C header (bpf/generated/wire.h), the P4 header (p4/include/wire.p4) and the scapy layer
(xdp_agg.proto.scapy_layer) are generated or built from the tables below; tests fail when a
generated file drifts or when the compiled BPF object's BTF disagrees with the offsets here.

Frame: Ethernet (14) | IPv4 (20, no options) | UDP (8) | SwitchML (8) | exponents (2) | payload,
payload being k big-endian int32 words, k given by the size code. A 32-bit job's word is one
element; a 16-bit job's (the `wire16` bit of byte 0 set, ours) carries two 16-bit elements as
the integer a * 2^16 + b (docs/protocol.md section 5.6), which every aggregator sums as int32.
This is p4app-switchML's order at its newest commit b5c74a0 (docs/protocol.md section 1 cites
the lines): its parser extracts the SwitchML header, then the exponents, then the data; its DPDK
host writes the exponents right after the SwitchML header and the values after them. (Revisions
before September 2021 had one 16-bit exponent behind the data; they are not the protocol.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy itself is imported by what uses it: the control verbs need none of it
    import numpy as np

# --- addressing -------------------------------------------------------------------------------
UDP_PORT = 0xBEE0  # the aggregator's base port (48864)
UDP_PORT_MASK = 0xFFF0  # it accepts 0xBEE0..0xBEEF
UDP_PORT_COUNT = 16
# A host's lanes: lane l sends from and listens on worker_port + l; on AF_XDP one socket per lane,
# which the queue's redirect program tells apart by that port (an XSKMAP entry each, and a bit
# each in the group's mask: hostlib/_xsk.c)
MAX_LANES = 64

# --- message types (4 bits) -------------------------------------------------------------------
MSG_TYPE_DATA = 1  # a contribution, and a result (SwitchML does not distinguish them)
# A sparse job's two kinds (docs/protocol.md section 8): the sparse header follows the exponents,
# then the payload (SPARSE) or nothing (SPARSE_EMPTY: the sender has no data at this block; as a
# result, no worker had). Ours: p4app-switchML's hosts send only MSG_TYPE_DATA.
MSG_TYPE_SPARSE = 2  # a sparse contribution or result with a block of data
MSG_TYPE_SPARSE_EMPTY = 3  # the empty-contribution marker: header only, no payload
SPARSE_TYPES = (MSG_TYPE_SPARSE, MSG_TYPE_SPARSE_EMPTY)

# --- size codes (3 bits): elements per packet -------------------------------------------------
# 4 and 5 are our extension; 6 and 7 (the last free values) are jumbo frames: 1024 and 2048 int32
# (4148- and 8244-byte frames) need more than a page, so an XDP program sees them only through
# multi-buffer (frags, docs/protocol.md section 1.1), and a 9000-byte MTU carries 2048.
SIZE_CODE_ELEMS = {0: 32, 1: 64, 2: 128, 3: 256, 4: 512, 5: 768, 6: 1024, 7: 2048}
SWITCHML_SIZE_CODES = (0, 1, 2, 3)
JUMBO_SIZE_CODES = (6, 7)  # frames larger than one XDP buffer (a page) on veth
MAX_ELEMS = max(SIZE_CODE_ELEMS.values())

# --- element widths (docs/protocol.md section 5.6) ----------------------------------------------
# A job's elements are 32 bits (one per payload word, p4app-switchML's) or 16 bits (two per word,
# ours). The bit of byte 0 that p4app-switchML calls `unused` (and whose hosts send 0) says which:
# an aggregator drops a packet whose width is not its job's (drop_bad_width).
WIRE_BITS = (32, 16)
PAIR_SHIFT = 16  # a 16-bit job's word is a * 2^PAIR_SHIFT + b (a: the even element, b: the odd)

# --- pool index (16 bits) ---------------------------------------------------------------------
POOL_VERSION_BIT = 0x8000  # bit 15: which of the two shadow copies
POOL_RESERVED_BIT = 0x4000  # bit 14: reserved, must be 0
POOL_SLOT_MASK = 0x3FFF  # bits 13..0: slot index
MAX_SLOTS = POOL_SLOT_MASK + 1

# --- lengths and offsets ----------------------------------------------------------------------
ETH_HLEN = 14
IPV4_HLEN = 20
UDP_HLEN = 8
SWITCHML_HLEN = 8
EXP_HLEN = 2
SPARSE_HLEN = 12  # block, next, blocks (sparse jobs only)
ELEM_BYTES = 4
SWITCHML_OFFSET = ETH_HLEN + IPV4_HLEN + UDP_HLEN  # 42: from the start of the Ethernet frame
EXPONENTS_AT = SWITCHML_HLEN  # the exponent header, from the start of the UDP payload
VALUES_AT = SWITCHML_HLEN + EXP_HLEN  # the first int32, from the start of the UDP payload: 10
UDP_HDRS_LEN = SWITCHML_HLEN + EXP_HLEN  # bytes of our two headers in a UDP payload, together
PAYLOAD_OFFSET = SWITCHML_OFFSET + VALUES_AT  # 52: the first int32, from the frame's start
SPARSE_AT = VALUES_AT  # a sparse packet's sparse header, from the UDP payload's start: 10
SPARSE_VALUES_AT = SPARSE_AT + SPARSE_HLEN  # its first int32 (an empty one's length): 22

# --- how a result leaves the aggregator (as p4app-switchML's sender writes it) ----------------
RESULT_TTL = 64  # IPv4 TTL of every result, whatever the request carried
RESULT_IP_ID = 0  # IPv4 identification of every result
RESULT_TOS = 0  # IPv4 DSCP and ECN (the ToS byte) of every result
RESULT_IP_FLAGS = 0  # IPv4 flags of every result: DF (and MF) clear


@dataclass(frozen=True)
class Field:
    """One header field, in wire order, big-endian, `bits` wide."""

    name: str
    bits: int
    doc: str
    signed: bool = False


@dataclass(frozen=True)
class Header:
    """A header: its fields in wire order. C, P4 and scapy are generated from this."""

    name: str
    fields: tuple[Field, ...]
    doc: str

    @property
    def length(self) -> int:
        return sum(f.bits for f in self.fields) // 8


SWITCHML = Header(
    "switchml",
    (
        Field("msg_type", 4, "1 = data; 2 = sparse data, 3 = sparse empty (ours); others reserved"),
        Field("wire16", 1, "1: two 16-bit elements per 32-bit word (ours); 0: int32 elements"),
        Field("size", 3, "payload size code, see SIZE_CODE_ELEMS"),
        Field("job_number", 8, "low 8 bits of the host's job counter, echoed"),
        Field("tsi", 32, "packet id chosen by the host, echoed, never interpreted"),
        Field("pool_index", 16, "bit 15 version, bit 14 reserved, bits 13..0 slot"),
    ),
    "SwitchML header (p4app-switchML UDP format)",
)

EXPONENTS = Header(
    "exponents",
    (
        Field("e0", 8, "block exponent of a future chunk; max over workers in a result", True),
        Field("e1", 8, "second exponent (SwitchML's); max over workers in a result", True),
    ),
    "exponent header",
)

SPARSE = Header(
    "sparse",
    (
        Field("block", 32, "the block (packet-sized chunk) of the tensor this packet is about"),
        Field("next", 32, "the sender's next non-zero block after it; result: the minimum"),
        Field("blocks", 32, "the tensor's blocks; next = blocks: none left in this column"),
    ),
    "sparse header (ours, msg_type 2 and 3 only), after the exponents",
)

HEADERS = (SWITCHML, EXPONENTS, SPARSE)
DENSE_HEADERS = (SWITCHML, EXPONENTS)  # a dense packet's headers, p4app-switchML's

assert SWITCHML.length == SWITCHML_HLEN and EXPONENTS.length == EXP_HLEN
assert SPARSE.length == SPARSE_HLEN


@dataclass(frozen=True)
class Member:
    """A byte-aligned member of a header as C and numpy see it.

    Fields narrower than a byte are grouped into one u8 member named after its fields of more
    than one bit (flags and reserved bits left out of the name); `parts` gives each such field's
    (name, shift, width).
    """

    name: str
    nbytes: int
    offset: int
    signed: bool
    parts: tuple[tuple[str, int, int], ...]


def members(header: Header) -> tuple[Member, ...]:
    """Group a header's fields into byte-aligned members, in wire order."""
    out: list[Member] = []
    group: list[Field] = []  # sub-byte fields not yet a whole byte
    group_bits, offset = 0, 0
    for f in header.fields:
        if f.bits % 8 == 0 and not group:
            out.append(Member(f.name, f.bits // 8, offset, f.signed, ((f.name, 0, f.bits),)))
            offset += f.bits // 8
            continue
        group.append(f)
        group_bits += f.bits
        if group_bits == 8:
            shift, parts = 8, []
            for g in group:
                shift -= g.bits
                parts.append((g.name, shift, g.bits))
            name = "_".join(g.name for g in group if g.bits > 1)
            out.append(Member(name, 1, offset, False, tuple(parts)))
            offset, group, group_bits = offset + 1, [], 0
        elif group_bits > 8:
            raise ValueError(f"{header.name}: fields do not group into bytes")
    return tuple(out)


def _np_type(m: Member) -> str:
    return (
        ("i" if m.signed else "u") + str(m.nbytes)
        if m.nbytes == 1
        else ((">i" if m.signed else ">u") + str(m.nbytes))
    )


@functools.cache
def _dtypes() -> dict[str, np.dtype]:
    """The numpy views of our headers (module attributes: SML_DTYPE, ...), made on first use: the
    SwitchML header opens the UDP payload and the exponent header follows it (EXPONENTS_AT);
    HDR_DTYPE is both together, the 10 bytes before the values; SPARSE_HDR_DTYPE a sparse
    packet's 22 header bytes: the dense ones, then block, next, blocks."""
    import numpy as np

    def dtype(*headers: Header) -> np.dtype:
        return np.dtype([(m.name, _np_type(m)) for h in headers for m in members(h)])

    d = {
        "SML_DTYPE": dtype(SWITCHML),
        "EXP_DTYPE": dtype(EXPONENTS),
        "HDR_DTYPE": dtype(*DENSE_HEADERS),
        "SPARSE_DTYPE": dtype(SPARSE),
        "SPARSE_HDR_DTYPE": dtype(*HEADERS),
    }
    hdr, sparse = d["HDR_DTYPE"], d["SPARSE_HDR_DTYPE"]
    assert d["SML_DTYPE"].itemsize == SWITCHML_HLEN and d["EXP_DTYPE"].itemsize == EXP_HLEN
    assert hdr.itemsize == UDP_HDRS_LEN == VALUES_AT
    assert hdr.fields is not None and hdr.fields["e0"][1] == EXPONENTS_AT
    assert sparse.itemsize == SPARSE_VALUES_AT
    assert sparse.fields is not None and sparse.fields["block"][1] == SPARSE_AT
    return d


def __getattr__(name: str):
    """SML_DTYPE, EXP_DTYPE, HDR_DTYPE, SPARSE_DTYPE and SPARSE_HDR_DTYPE (_dtypes)."""
    try:
        return _dtypes()[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def part_mask(m: Member, name: str) -> int:
    """The bits of the field `name` in a grouped member."""
    return sum(((1 << w) - 1) << shift for n, shift, w in m.parts if n == name)


def reserved_mask(m: Member) -> int:
    """The bits of a grouped member that are reserved (0 on every packet the aggregator sends)."""
    return part_mask(m, "reserved")


# byte 0 of the SwitchML header (msg_type, wire16, size): the width bit, echoed in results
TYPE_SIZE_WIRE16_MASK = part_mask(members(SWITCHML)[0], "wire16")
assert TYPE_SIZE_WIRE16_MASK == 0x08


def check_wire_bits(bits: int) -> int:
    """`bits` if it is an element width of the wire (16 or 32); ValueError otherwise."""
    if bits not in WIRE_BITS:
        raise ValueError(f"an element is 32 or 16 bits on the wire, not {bits!r}")
    return bits


def elems_per_word(bits: int) -> int:
    """Elements per 32-bit payload word at an element width of `bits`: 1 or 2."""
    return 32 // check_wire_bits(bits)


def pair_range(n: int) -> int:
    """The largest |a| and |b| each of n workers may put into a 16-bit job's words, so that
    both sums keep |sum| <= 2^15 - 1 and the word sum, sum(a) * 2^16 + sum(b), fits int32."""
    return (2**15 - 1) // n


def pack_pairs(q: np.ndarray) -> np.ndarray:
    """int32 words of a 16-bit job from (..., 2k) integers (each within +-(2^15 - 1)): word i
    is q[2i] * 2^16 + q[2i + 1]."""
    import numpy as np

    q = np.asarray(q, dtype=np.int32)
    return (q[..., 0::2] << PAIR_SHIFT) + q[..., 1::2]


def unpack_pairs(words: np.ndarray) -> np.ndarray:
    """The (..., 2k) elements of (..., k) summed words of a 16-bit job: b is the low half read
    as a signed 16-bit number (|sum b| < 2^15), a = (w - b) / 2^16, exactly."""
    import numpy as np

    w = np.asarray(words).astype(np.int32)
    b = ((w & 0xFFFF) ^ 0x8000) - 0x8000
    out = np.empty(w.shape[:-1] + (2 * w.shape[-1],), dtype=np.int32)
    out[..., 0::2] = (w - b) >> PAIR_SHIFT
    out[..., 1::2] = b
    return out


def size_code_for(elems: int) -> int:
    """The size code for `elems` elements per packet; ValueError if there is none."""
    for code, n in SIZE_CODE_ELEMS.items():
        if n == elems:
            return code
    raise ValueError(
        f"{elems} elements per packet is not a wire size; use one of "
        f"{sorted(SIZE_CODE_ELEMS.values())}"
    )


def elems_for_mtu(mtu: int) -> int:
    """The most payload words per packet whose IPv4 datagram fits an MTU of `mtu` bytes (1500:
    256, 3500: 768, 9000: 2048; a 16-bit job carries twice as many elements); ValueError when
    not even the smallest size fits."""
    fits = [n for n in SIZE_CODE_ELEMS.values() if IPV4_HLEN + UDP_HLEN + udp_payload_len(n) <= mtu]
    if not fits:
        raise ValueError(
            f"MTU {mtu} holds no packet of ours (the smallest needs {frame_len(32) - ETH_HLEN})"
        )
    return max(fits)


def elems_for(size_code: int) -> int:
    """Elements per packet for a size code; ValueError for an unknown code."""
    try:
        return SIZE_CODE_ELEMS[size_code]
    except KeyError:
        raise ValueError(f"unknown size code {size_code}") from None


def type_size(msg_type: int, size_code: int, wire_bits: int = 32) -> int:
    """The first byte of the SwitchML header: the type, the width bit, the size code."""
    if not 0 <= msg_type <= 15 or not 0 <= size_code <= 7:
        raise ValueError("msg_type is 4 bits and size code 3 bits")
    wide = TYPE_SIZE_WIRE16_MASK if check_wire_bits(wire_bits) == 16 else 0
    return (msg_type << 4) | wide | size_code


def pool_index(slot, version):
    """Pool index field from slot and version (scalars or numpy arrays)."""
    import numpy as np

    return (np.asarray(version, dtype=np.uint16) << 15) | (
        np.asarray(slot, dtype=np.uint16) & POOL_SLOT_MASK
    )


def split_pool_index(pidx):
    """(slot, version) from a pool index field."""
    import numpy as np

    pidx = np.asarray(pidx, dtype=np.uint16)
    return pidx & POOL_SLOT_MASK, (pidx >> 15) & 1


def udp_payload_len(elems: int) -> int:
    """Bytes of UDP payload for a packet of `elems` elements."""
    return UDP_HDRS_LEN + elems * ELEM_BYTES


def frame_len(elems: int) -> int:
    """Bytes of a whole Ethernet frame for a packet of `elems` elements."""
    return SWITCHML_OFFSET + udp_payload_len(elems)


def build_payloads(
    *,
    job_number: int,
    size_code: int,
    tsi,
    slot,
    version,
    values: np.ndarray,
    e0=0,
    e1=0,
    msg_type: int = MSG_TYPE_DATA,
    wire_bits: int = 32,
) -> np.ndarray:
    """UDP payloads for m packets at once, as an (m, 8 + 2 + 4k) uint8 array.

    `values` is an (m, k) integer array of payload words (k = elems of size_code; a 16-bit
    job's words are pack_pairs() of its elements, `wire_bits` 16 sets the width bit); tsi,
    slot, version, e0, e1 are scalars or length-m arrays. Vectorised: no per-packet Python.
    """
    import numpy as np

    k = elems_for(size_code)
    values = np.asarray(values)
    if values.ndim != 2 or values.shape[1] != k:
        raise ValueError(f"values must have shape (m, {k}) for size code {size_code}")
    m = values.shape[0]
    out = np.empty((m, udp_payload_len(k)), dtype=np.uint8)
    hdr = out[:, :VALUES_AT].view(_dtypes()["HDR_DTYPE"]).reshape(m)
    hdr["msg_type_size"] = type_size(msg_type, size_code, wire_bits)
    hdr["job_number"] = job_number & 0xFF
    hdr["tsi"] = tsi
    hdr["pool_index"] = pool_index(slot, version)
    hdr["e0"] = e0
    hdr["e1"] = e1
    out[:, VALUES_AT:].view(">i4")[:] = values
    return out


def sparse_payload_len(elems: int, empty: bool) -> int:
    """Bytes of UDP payload of a sparse packet: the 22 header bytes, plus the block unless empty."""
    return SPARSE_VALUES_AT + (0 if empty else elems * ELEM_BYTES)


def build_sparse_payload(
    *,
    job_number: int,
    size_code: int,
    tsi: int,
    slot: int,
    version: int,
    block: int,
    next: int,
    blocks: int,
    values=None,
    e0: int = 0,
    e1: int = 0,
    padded: bool = False,
    wire_bits: int = 32,
) -> bytes:
    """One sparse UDP payload (docs/protocol.md section 8): MSG_TYPE_SPARSE with the k int32 of
    `values`, or MSG_TYPE_SPARSE_EMPTY when `values` is None: header only, or `padded` with k
    zero int32 (room for a result with data, for an aggregator that cannot grow a frame).
    `values` are payload words, as in build_payloads (`wire_bits` sets the width bit)."""
    import numpy as np

    k = elems_for(size_code)
    empty = values is None
    out = np.zeros(sparse_payload_len(k, empty and not padded), dtype=np.uint8)
    hdr = out[:SPARSE_VALUES_AT].view(_dtypes()["SPARSE_HDR_DTYPE"])
    kind = MSG_TYPE_SPARSE_EMPTY if empty else MSG_TYPE_SPARSE
    hdr["msg_type_size"] = type_size(kind, size_code, wire_bits)
    hdr["job_number"] = job_number & 0xFF
    hdr["tsi"] = tsi
    hdr["pool_index"] = pool_index(slot, version)
    hdr["e0"], hdr["e1"] = e0, e1
    hdr["block"], hdr["next"], hdr["blocks"] = block, next, blocks
    if not empty:
        vals = np.asarray(values).reshape(-1)
        if vals.shape != (k,):
            raise ValueError(f"values must have {k} elements for size code {size_code}")
        out[SPARSE_VALUES_AT:].view(">i4")[:] = vals
    return out.tobytes()


@dataclass(frozen=True)
class Sparse:
    """A sparse packet's own fields (the SPARSE header)."""

    block: int
    next: int
    blocks: int


@dataclass(frozen=True)
class Message:
    """One decoded SwitchML message (header fields and payload), for tests and tools."""

    msg_type: int
    size: int
    job_number: int
    tsi: int
    slot: int
    version: int
    e0: int
    e1: int
    values: np.ndarray  # the payload words (int32); empty for a SPARSE_EMPTY message
    wire16: int = 0  # the width bit: 1, two 16-bit elements per word (elements())
    sparse: Sparse | None = None  # the sparse header, for msg_type SPARSE and SPARSE_EMPTY

    @property
    def wire_bits(self) -> int:
        """The element width the width bit says: 16 or 32."""
        return 16 if self.wire16 else 32

    def elements(self) -> np.ndarray:
        """The payload's elements: the words, or a 16-bit message's unpacked pairs."""
        return unpack_pairs(self.values) if self.wire16 else self.values

    def to_bytes(self) -> bytes:
        """The UDP payload."""
        names = ("job_number", "tsi", "slot", "version", "e0", "e1")
        header: dict[str, Any] = {n: getattr(self, n) for n in names}
        header["size_code"] = self.size
        header["wire_bits"] = self.wire_bits
        sp = self.sparse
        if sp is None:
            import numpy as np

            values = np.asarray(self.values).reshape(1, -1)
            return build_payloads(**header, values=values, msg_type=self.msg_type).tobytes()
        data = None if self.msg_type == MSG_TYPE_SPARSE_EMPTY else self.values
        return build_sparse_payload(
            **header, block=sp.block, next=sp.next, blocks=sp.blocks, values=data
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> "Message":
        """Decode a UDP payload, dense or sparse; ValueError when it is truncated or the size code
        is unknown."""
        import numpy as np

        if len(data) < SWITCHML_HLEN:
            raise ValueError(f"truncated: {len(data)} bytes, the header needs {SWITCHML_HLEN}")
        dt = _dtypes()
        hdr = np.frombuffer(data[:EXPONENTS_AT], dtype=dt["SML_DTYPE"])[0]
        ts = int(hdr["msg_type_size"])
        k = elems_for(ts & 7)
        sparse, at, need = None, VALUES_AT, udp_payload_len(k)
        if ts >> 4 in SPARSE_TYPES:
            at, need = SPARSE_VALUES_AT, sparse_payload_len(k, ts >> 4 == MSG_TYPE_SPARSE_EMPTY)
        if len(data) < need:
            raise ValueError(f"truncated: {len(data)} bytes, its type and size need {need}")
        if ts >> 4 in SPARSE_TYPES:
            sp = np.frombuffer(data[SPARSE_AT:SPARSE_VALUES_AT], dtype=dt["SPARSE_DTYPE"])[0]
            sparse = Sparse(int(sp["block"]), int(sp["next"]), int(sp["blocks"]))
        pidx = int(hdr["pool_index"])
        exp = np.frombuffer(data[EXPONENTS_AT:VALUES_AT], dtype=dt["EXP_DTYPE"])[0]
        vals = np.frombuffer(data[at:need], dtype=">i4").astype(np.int32)
        return cls(
            msg_type=ts >> 4,
            wire16=int(bool(ts & TYPE_SIZE_WIRE16_MASK)),
            size=ts & 7,
            job_number=int(hdr["job_number"]),
            tsi=int(hdr["tsi"]),
            slot=pidx & POOL_SLOT_MASK,
            version=pidx >> 15,
            e0=int(exp["e0"]),
            e1=int(exp["e1"]),
            values=vals,
            sparse=sparse,
        )
