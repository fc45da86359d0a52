"""An independent p4app-switchML host, byte for byte: how its DPDK worker builds a request and
reads a result, written from p4app-switchML's sources at its newest commit, not from our wire
module (so that a layout error of ours cannot hide in both sides of a test).

Sources, p4lang/p4app-switchML at b5c74a04fa66faa82acab154a4e21c8f76d913f2 (2022-07-14), under
dev_root/client_lib/src/backends/dpdk/:
- dpdk_worker_thread_utils.inc, BuildPacket (lines 67-135): Ethernet (worker MAC -> switch MAC,
  IPv4), IPv4 (version_ihl 0x45, total length, TTL 128, UDP; id, ToS and fragment fields left as
  a fresh mbuf has them: 0; checksums offloaded to the NIC, so on the wire they are right), UDP
  (worker port -> 48864, the switch's port: dpdk_backend.cc line 136), then the SwitchML header
  (dpdk_backend.h lines 56-84: job_type_size, short_job_id, pkt_id, switch_pool_index, packed),
  with `job_type_size = (1 << 4) + size` (line 128), pkt_id in host byte order (line 126: "only
  switch_pool_index and job_type_size will be used by the switch"), the pool index big-endian
  (line 127); then the 2-byte exponent slot at `switchml_pkt_hdr+1` and the int32 entries after
  it (lines 132-134), big-endian (cpu_exponent_quantizer_ppp.cc: htonl; the float path writes its
  int8 exponent into the first byte of the slot, line 154);
- the size code from the elements per packet (lines 113-122): < 64 -> 0, < 128 -> 1, < 256 -> 2,
  else 3;
- dpdk_worker_thread.cc, the receive path (lines 308-338): the SwitchML header right after the
  UDP header, pkt_id and short_job_id read from it, the exponent slot at `switchml_hdr+1` (its
  first byte is the int8 exponent PostprocessSingle reads: cpu_exponent_quantizer_ppp.cc line
  256), the entries at `extra_info_ptr+1`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

SWITCH_PORT = 48864  # dpdk_backend.cc line 136
SML_AT = 14 + 20 + 8  # the SwitchML header: right after the UDP header (receive path, line 311)


def size_code(packet_numel: int) -> int:
    """BuildPacket's pkt_len_enum (lines 113-122)."""
    if packet_numel < 64:
        return 0
    if packet_numel < 128:
        return 1
    if packet_numel < 256:
        return 2
    return 3


def _csum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def _mac(text: str) -> bytes:
    return bytes(int(x, 16) for x in text.split(":"))


def _ip(text: str) -> bytes:
    return bytes(int(x) for x in text.split("."))


@dataclass(frozen=True)
class Endpoint:
    """A worker thread's or the switch's end-to-end address (E2eAddress: MAC, IP, UDP port)."""

    mac: str
    ip: str
    port: int


def build_packet(
    *,
    worker: Endpoint,
    switch: Endpoint,
    job_id: int,
    pkt_id: int,
    pool_index: int,
    values,
    exponent: int = 0,
    extra_byte: int = 0,
) -> bytes:
    """The frame BuildPacket sends: `values` int32 entries (packet_numel = len(values)), the
    int8 `exponent` in the first byte of the exponent slot and `extra_byte` in the second (a
    fresh mbuf's; the switch takes the max of both bytes as e0 and e1)."""
    vals = np.asarray(values, dtype=np.int64).astype(np.int32)
    hdr = struct.pack(
        "=BBIH", (1 << 4) + size_code(len(vals)), job_id & 0xFF, pkt_id, pool_index
    )  # native (host) order, packed, as the C struct lies in memory...
    hdr = hdr[:6] + struct.pack("!H", pool_index)  # ...with the pool index big-endian
    body = hdr + struct.pack("bB", exponent, extra_byte) + vals.astype(">i4").tobytes()
    udp_len = 8 + len(body)
    ip_len = 20 + udp_len
    src, dst = _ip(worker.ip), _ip(switch.ip)
    ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, ip_len, 0, 0, 128, 17, 0, src, dst))
    ip[10:12] = struct.pack("!H", _csum(bytes(ip)))  # offloaded: the NIC writes it
    udp = bytearray(struct.pack("!HHHH", worker.port, switch.port, udp_len, 0))
    pseudo = src + dst + struct.pack("!BBH", 0, 17, udp_len)
    udp[6:8] = struct.pack("!H", _csum(pseudo + bytes(udp) + body) or 0xFFFF)  # offloaded too
    eth = _mac(switch.mac) + _mac(worker.mac) + b"\x08\x00"
    return eth + bytes(ip) + bytes(udp) + body


@dataclass(frozen=True)
class Received:
    """What the receive path reads from a result."""

    short_job_id: int
    pkt_id: int
    exponent: int  # int8, the first byte of the exponent slot
    entries: np.ndarray  # int32, from big-endian


def read_result(frame: bytes, packet_numel: int) -> Received:
    """A result frame as dpdk_worker_thread.cc lines 308-338 read it."""
    h = SML_AT
    short_job_id = frame[h + 1]
    (pkt_id,) = struct.unpack("=I", frame[h + 2 : h + 6])
    (exponent,) = struct.unpack("b", frame[h + 8 : h + 9])
    entries = np.frombuffer(frame[h + 10 : h + 10 + 4 * packet_numel], ">i4").astype(np.int32)
    return Received(short_job_id, pkt_id, exponent, entries)
