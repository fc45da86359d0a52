"""Hostile frames for live tests: what an unregistered host or a registered worker's address may
send to a running aggregator, and a sender that puts frames on a namespace's eth0.

Frames are built here, in the test process, so that the test can ask the serial reference model
(xdp_agg.proto.model) what the aggregator must do with each one; the sender (SENDER, run with
`python -c SENDER FILE ...` in a worker's namespace) only reads them from a file (one hex frame
a line) and sends them through an AF_PACKET socket, bypassing the kernel's own checks (lengths,
options, fragments), paced so that the path's queues do not overflow.
"""

from __future__ import annotations

import numpy as np
from scapy.layers.inet import IP, UDP, IPOption_NOP
from scapy.layers.l2 import Ether

from xdp_agg.proto import wire
from xdp_agg.proto.scapy_layer import sml_frame

TYPE_SIZE = wire.SML_DTYPE.fields["msg_type_size"][1]  # offset of the type/size byte
POISON = 7777777  # the value every hostile contribution carries: a sum it enters is visibly wrong

# Sends the frames of the file argv[1] (hex, one a line) through eth0; argv[2] "loop" repeats
# them until killed, a number sends them that many times over. Prints the number of frames
# read as soon as the socket is ready, then (when not looping) the number sent. argv[3]: frames
# per burst, with a 2 ms pause after each (0: no pause).
SENDER = r"""
import socket, sys, time
frames = [bytes.fromhex(x) for x in open(sys.argv[1]).read().split()]
rounds = sys.argv[2] if len(sys.argv) > 2 else "1"
burst = int(sys.argv[3]) if len(sys.argv) > 3 else 0
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(("eth0", 0))
print(len(frames), flush=True)
sent, i = 0, 0
while rounds == "loop" or i < int(rounds):
    for f in frames:
        try:
            s.send(f)
            sent += 1
        except OSError:
            pass
        if burst and sent % burst == 0:
            time.sleep(0.002)
    i += 1
print(sent, flush=True)
"""


def write_frames(path, frames: list[bytes]) -> None:
    """The file SENDER reads."""
    with open(path, "w") as f:
        f.write("\n".join(fr.hex() for fr in frames) + "\n")


def _contribution(src_ip, src_mac, agg_ip, agg_mac, *, elems, port, slot, **kw) -> Ether:
    return Ether(
        bytes(
            sml_frame(
                src_ip=src_ip,
                src_mac=src_mac,
                dst_ip=agg_ip,
                dst_mac=agg_mac,
                dport=port,
                values=[POISON] * elems,
                slot=slot,
                version=slot % 2,
                tsi=slot,
                e0=30,
                **kw,
            )
        )
    )


def lying_frames(src_ip: str, src_mac: str, agg_ip: str, agg_mac: str) -> list[bytes]:
    """Full payloads of every size code, for every third slot, both versions and every fifth
    aggregator port, whose IPv4 total length or UDP length lies (too short, too long, both)."""
    frames = []
    for code in (0, 1, 2, 3):
        k = wire.SIZE_CODE_ELEMS[code]
        udp_len = wire.UDP_HLEN + wire.udp_payload_len(k)
        ip_len = wire.IPV4_HLEN + wire.UDP_HLEN + wire.udp_payload_len(k)
        for slot in range(0, 256, 3):
            for port in range(wire.UDP_PORT, wire.UDP_PORT + wire.UDP_PORT_COUNT, 5):
                f = _contribution(src_ip, src_mac, agg_ip, agg_mac, elems=k, port=port, slot=slot)
                lie = [
                    (None, 18),
                    (None, udp_len + 4),
                    (ip_len - 4, None),
                    (ip_len + 4, None),
                    (38, 18),
                ][slot % 5]
                if lie[0] is not None:
                    f[IP].len = lie[0]
                if lie[1] is not None:
                    f[UDP].len = lie[1]
                del f[IP].chksum
                frames.append(bytes(f))
    return frames


def with_payload(f: Ether, payload: bytes) -> bytes:
    """Frame f with its UDP payload replaced and every length consistent with it."""
    f[UDP].remove_payload()
    f[UDP].add_payload(payload)
    f[UDP].len = wire.UDP_HLEN + len(payload)
    f[IP].len = wire.IPV4_HLEN + wire.UDP_HLEN + len(payload)
    del f[IP].chksum
    return bytes(f)


def malformed_frames(
    src_ip: str,
    src_mac: str,
    agg_ip: str,
    agg_mac: str,
    job: dict,
    other_port: int,
    n: int = 40,
    mtu: int = 1500,
) -> dict[str, list[bytes]]:
    """Per kind, n frames from a registered worker's address that must change no sum: `job` is
    the live job (xdp-agg job list's dict: agg_port, elems, slot_base, slot_count); other_port
    an aggregator port where this address is not registered; mtu the link's (larger frames
    could not be sent)."""
    port, elems = job["agg_port"], job["elems"]
    base, count = job["slot_base"], job["slot_count"]
    code = wire.size_code_for(elems)
    need = wire.udp_payload_len(elems)
    rng = np.random.default_rng(12)

    def good(slot, *, elems=elems, port=port, **kw):
        """A contribution from this address to `slot` (the job's size and port unless said)."""
        return _contribution(
            src_ip, src_mac, agg_ip, agg_mac, elems=elems, port=port, slot=slot, **kw
        )

    def in_range(i):
        return base + i % count

    kinds: dict[str, list[bytes]] = {}
    # another size code than the job's (with that code's full payload), and codes 6 and 7,
    # which no size has
    other = [
        c
        for c, k in wire.SIZE_CODE_ELEMS.items()
        if c != code and wire.IPV4_HLEN + wire.UDP_HLEN + wire.udp_payload_len(k) <= mtu
    ]
    kinds["bad_size_code"] = []
    for i in range(n):
        if i % 4:
            c = other[i % len(other)]
            kinds["bad_size_code"].append(bytes(good(in_range(i), elems=wire.SIZE_CODE_ELEMS[c])))
        else:
            b = bytearray(bytes(good(in_range(i))))
            b[wire.SWITCHML_OFFSET + TYPE_SIZE] = (wire.MSG_TYPE_DATA << 4) | (6 + i // 4 % 2)
            kinds["bad_size_code"].append(bytes(b))
    # the message type nibble is not "data"
    kinds["bad_msg_type"] = [
        bytes(good(in_range(i), msg_type=2 + i % 14))  # 2..15: never data (1)
        for i in range(n)
    ]
    # shorter than the SwitchML header; a header with fewer values than the size code needs
    kinds["truncated_header"] = [
        with_payload(good(in_range(i)), bytes(good(in_range(i))[UDP].payload)[: i % 8])
        for i in range(n)
    ]
    kinds["truncated_values"] = [
        with_payload(
            good(in_range(i)), bytes(good(in_range(i))[UDP].payload)[: need - 4 * (1 + i % 64)]
        )
        for i in range(n)
    ]
    # IPv4 / UDP lengths that disagree with the frame
    lies = [(None, 18), (None, 1), (-4, None), (+4, None), (38, 18), (None, -4)]
    kinds["lying_lengths"] = []
    for i in range(n):
        f = good(in_range(i))
        ip_d, udp_d = lies[i % len(lies)]
        if ip_d is not None:
            f[IP].len = ip_d if ip_d > 20 else wire.IPV4_HLEN + wire.UDP_HLEN + need + ip_d
        if udp_d is not None:
            f[UDP].len = udp_d if udp_d > 8 else wire.UDP_HLEN + need + udp_d
        del f[IP].chksum
        kinds["lying_lengths"].append(bytes(f))
    # slots outside the job's range, and the reserved pool-index bit set on one inside it
    outside = [s for s in (base - 1, base + count, base + count + 7, wire.POOL_SLOT_MASK) if s >= 0]
    kinds["slot_out_of_range"] = [
        bytes(good(outside[i % len(outside)])) for i in range(n - n // 4)
    ] + [
        bytes(good(0, pool_index=int(wire.pool_index(in_range(i), i % 2)) | wire.POOL_RESERVED_BIT))
        for i in range(n // 4)
    ]
    # a well-formed contribution to a port this address is not registered at
    kinds["other_port"] = [bytes(good(in_range(i), port=other_port)) for i in range(n)]
    # IPv4 options; a first fragment (more-fragments set); a later fragment (offset > 0: not
    # ours, the kernel's to reassemble); an IP version other than 4 behind the IPv4 ethertype
    kinds["ip_options"] = []
    kinds["first_fragment"] = []
    kinds["later_fragment"] = []
    kinds["ip_version_6"] = []
    for i in range(n):
        f = good(in_range(i))
        f[IP].options = [IPOption_NOP()] * (4 * (1 + i % 3))
        f[IP].ihl = None
        f[IP].len = None
        del f[IP].chksum
        kinds["ip_options"].append(bytes(Ether(bytes(f))))
        f = good(in_range(i))
        f[IP].flags = "MF"
        f[IP].id = 1000 + i
        del f[IP].chksum
        kinds["first_fragment"].append(bytes(f))
        f = good(in_range(i))
        f[IP].frag = 1 + i
        f[IP].id = 2000 + i
        del f[IP].chksum
        kinds["later_fragment"].append(bytes(f))
        b = bytearray(bytes(good(in_range(i))))
        b[wire.ETH_HLEN] = (6 << 4) | (b[wire.ETH_HLEN] & 0xF)
        kinds["ip_version_6"].append(bytes(b))
    # random bytes after a valid UDP header to the job's port
    kinds["random_payload"] = [
        with_payload(good(in_range(i)), rng.integers(0, 256, int(rng.integers(0, 80))).tobytes())
        for i in range(n)
    ]
    return kinds


def intruder_frames(
    src_ip: str, src_mac: str, agg_ip: str, agg_mac: str, job: dict, n: int = 40
) -> dict[str, list[bytes]]:
    """Per kind, n frames from a host that is no worker of the job: well-formed contributions
    for the job's slots to its port and to the other aggregator ports, and junk to those."""
    port, elems = job["agg_port"], job["elems"]
    base, count = job["slot_base"], job["slot_count"]
    others = [p for p in range(wire.UDP_PORT, wire.UDP_PORT + wire.UDP_PORT_COUNT) if p != port]
    rng = np.random.default_rng(13)

    def contrib(i, p):
        return _contribution(
            src_ip, src_mac, agg_ip, agg_mac, elems=elems, port=p, slot=base + i % count
        )

    def junk(i, p):
        payload = rng.integers(0, 256, int(rng.integers(0, 2 * wire.SWITCHML_HLEN))).tobytes()
        return with_payload(contrib(i, p), payload)

    return {
        "contribution_job_port": [bytes(contrib(i, port)) for i in range(n)],
        "contribution_other_ports": [bytes(contrib(i, others[i % len(others)])) for i in range(n)],
        "junk_job_port": [junk(i, port) for i in range(n)],
        "junk_other_ports": [junk(i, others[i % len(others)]) for i in range(n)],
    }
