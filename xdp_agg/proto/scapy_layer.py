"""A scapy layer for the SwitchML headers, built from the field tables in xdp_agg.proto.wire.

    from xdp_agg.proto.scapy_layer import SwitchML, Exponents, sml_frame
    pkt = sml_frame(src_ip="198.18.0.10", values=[1, 2, 3, ...], slot=3)

UDP packets to or from ports 0xBEE0..0xBEEF decode as UDP / SwitchML / Exponents, in wire order:
the SwitchML header, then the exponent header, whose layer also holds the k int32 of the payload
that follow it (`values`, k from the SwitchML layer's size code). A sparse packet (msg_type 2 or
3) decodes as UDP / SwitchML / Exponents / Sparse: the sparse header's layer holds the values
(k of them for msg_type 2, none for the header-only 3).
"""

from __future__ import annotations

import numpy as np
from scapy.fields import AnyField, BitField, FieldListField, SignedByteField, SignedIntField
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Packet, Raw, bind_layers

from . import wire


def _fields(header: wire.Header) -> list[AnyField]:
    out: list[AnyField] = []
    for f in header.fields:
        if f.signed and f.bits == 8:
            out.append(SignedByteField(f.name, 0))
        else:
            out.append(BitField(f.name, 0, f.bits))
    return out


def _payload_elems(pkt) -> int:
    """k of the SwitchML layer below (0 without one, for an unknown size code, or for a sparse
    packet, whose values follow the sparse header)."""
    under = pkt.underlayer
    if not isinstance(under, SwitchML) or under.msg_type in wire.SPARSE_TYPES:
        return 0
    return wire.SIZE_CODE_ELEMS.get(under.size, 0)


def _sparse_elems(pkt) -> int:
    """k of the SwitchML layer two below for a sparse packet with data; 0 for an empty one."""
    sml = pkt.underlayer.underlayer if isinstance(pkt.underlayer, Exponents) else None
    if not isinstance(sml, SwitchML) or sml.msg_type != wire.MSG_TYPE_SPARSE:
        return 0
    return wire.SIZE_CODE_ELEMS.get(sml.size, 0)


def _values(count_from) -> FieldListField:
    return FieldListField(
        "values", [], SignedIntField("value", 0), count_from=count_from, max_count=wire.MAX_ELEMS
    )


class SwitchML(Packet):
    """SwitchML header (8 bytes), fields from wire.SWITCHML."""

    name = "SwitchML"
    fields_desc = _fields(wire.SWITCHML)


class Exponents(Packet):
    """Exponent header (2 bytes, fields from wire.EXPONENTS) and the payload's int32 after it."""

    name = "SwitchMLExponents"
    fields_desc = _fields(wire.EXPONENTS) + [_values(_payload_elems)]

    def guess_payload_class(self, payload):
        under = self.underlayer
        if isinstance(under, SwitchML) and under.msg_type in wire.SPARSE_TYPES:
            return Sparse
        return super().guess_payload_class(payload)


class Sparse(Packet):
    """Sparse header (12 bytes, fields from wire.SPARSE) and, for msg_type 2, the int32 after it."""

    name = "SwitchMLSparse"
    fields_desc = _fields(wire.SPARSE) + [_values(_sparse_elems)]


bind_layers(SwitchML, Exponents)
for _port in range(wire.UDP_PORT, wire.UDP_PORT + wire.UDP_PORT_COUNT):
    bind_layers(UDP, SwitchML, dport=_port)
    bind_layers(UDP, SwitchML, sport=_port)


def sml_frame(
    *,
    src_ip: str,
    dst_ip: str = "198.18.0.1",
    src_mac: str = "02:00:00:00:00:0a",
    dst_mac: str = "02:00:00:00:00:01",
    sport: int = wire.UDP_PORT,
    dport: int = wire.UDP_PORT,
    values=(),
    size: int | None = None,
    slot: int = 0,
    version: int = 0,
    job_number: int = 0,
    tsi: int = 0,
    e0: int = 0,
    e1: int = 0,
    msg_type: int = wire.MSG_TYPE_DATA,
    pool_index: int | None = None,
    udp_checksum: bool = False,
    sparse: wire.Sparse | None = None,
    wire_bits: int = 32,
) -> Packet:
    """A whole Ethernet frame carrying one SwitchML message (values as int32 words, big-endian;
    `wire_bits` 16: a 16-bit job's, whose width bit it sets and whose words are
    wire.pack_pairs() of its elements).
    The UDP checksum is 0 (none, as results carry) unless `udp_checksum`. With `sparse`, a
    sparse message: msg_type 2 with `values`, or 3 (header only) without; `size` then gives the
    size code (the job's) since an empty message has no values to count. msg_type 3 with
    `values`: an empty message padded with them (docs/protocol.md section 8.1)."""
    vals = np.asarray(values, dtype=np.int64).astype(np.int32)
    if size is None:
        size = wire.size_code_for(len(vals))
    if sparse is not None and msg_type == wire.MSG_TYPE_DATA:  # the sparse kind its values say
        msg_type = wire.MSG_TYPE_SPARSE if len(vals) else wire.MSG_TYPE_SPARSE_EMPTY
    pidx = pool_index if pool_index is not None else int(wire.pool_index(slot, version))
    ints = [int(v) for v in vals]
    if sparse is not None:
        b, n, m = sparse.block, sparse.next, sparse.blocks
        if msg_type == wire.MSG_TYPE_SPARSE_EMPTY and ints:  # an empty one padded: raw bytes
            pad = Raw(vals.astype(">i4").tobytes())
            exps = Exponents(e0=e0, e1=e1) / Sparse(block=b, next=n, blocks=m) / pad
        else:
            exps = Exponents(e0=e0, e1=e1) / Sparse(block=b, next=n, blocks=m, values=ints)
    else:
        exps = Exponents(e0=e0, e1=e1, values=ints)
    return (
        Ether(src=src_mac, dst=dst_mac)
        / IP(src=src_ip, dst=dst_ip, ttl=64)
        / UDP(sport=sport, dport=dport, chksum=None if udp_checksum else 0)
        / SwitchML(
            msg_type=msg_type,
            wire16=int(wire.check_wire_bits(wire_bits) == 16),
            size=size,
            job_number=job_number,
            tsi=tsi,
            pool_index=pidx,
        )
        / exps
    )
