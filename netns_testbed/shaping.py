"""Per-link rate limits with the tbf qdisc (netem is not available here).

tbf parameters, and why:

* ``burst`` = max(1 ms worth of bytes at the rate, 16 MTU-sized frames). The
  qdisc watchdog uses high-resolution timers, so a bucket of one millisecond
  is enough to keep the link busy between wake-ups; 16 frames keeps low rates
  from starving TCP (it needs a few full-sized segments per burst), and
  GSO super-packets bigger than the bucket are segmented by tbf itself.
  A larger bucket (rate/HZ at HZ=250, i.e. 4 ms) would let short transfers
  run at veth speed and distort measurements of small collectives.
* ``latency`` 50 ms bounds the queue (tbf's limit = rate*latency + burst):
  deep enough for TCP to fill the pipe, shallow enough to keep RTTs sane.
* rates go to ``tc`` in bit/s so rates above 34 Gbit/s (TCA_TBF_RATE64)
  work too.
"""

from __future__ import annotations

import re

from . import nsexec

TBF_LATENCY = "50ms"
ETH_HLEN = 14

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bits|b)?\s*$", re.IGNORECASE)


def parse_rate(rate: str | int | float | None) -> int | None:
    """Rate in bit/s from ``"1gbit"``, ``"100mbit"``, ``"10G"``, ``2_000_000`` or None.

    Units are SI (k=1000) and always bits; tc's ``bps`` (bytes/s) is refused
    because it is a common source of 8x mistakes.
    """
    if rate is None:
        return None
    if isinstance(rate, bool):
        raise ValueError(f"invalid rate {rate!r}")
    if isinstance(rate, (int, float)):
        bits = int(rate)
    else:
        m = _RATE_RE.match(rate)
        if not m:
            raise ValueError(
                f"invalid rate {rate!r}: use e.g. '100mbit', '1gbit', '10gbit' (bits per second)"
            )
        bits = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if bits < 8000:
        raise ValueError(f"rate {rate!r} is below 8kbit; tbf cannot shape that usefully")
    return bits


def format_rate(bits: int | None) -> str | None:
    """Human-readable rate, e.g. 1000000000 -> '1gbit'."""
    if bits is None:
        return None
    for unit, mult in (("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits >= mult and bits % mult == 0:
            return f"{bits // mult}{unit}"
    return f"{bits}bit"


def tbf_burst(rate_bits: int, mtu: int) -> int:
    """Bucket size in bytes for ``rate_bits`` on a link with ``mtu`` (see module doc)."""
    return max(rate_bits // 8 // 1000, 16 * (mtu + ETH_HLEN))


def tbf_batch(devs: list[str], rate_bits: int, mtu: int) -> str:
    """``tc -batch`` text installing tbf as root qdisc on each of ``devs``."""
    burst = tbf_burst(rate_bits, mtu)
    return "".join(
        f"qdisc replace dev {d} root tbf rate {rate_bits}bit burst {burst} latency {TBF_LATENCY}\n"
        for d in devs
    )


def _delete_qdiscs(netns: str, devs: list[str], parent: str) -> None:
    """Delete the `parent` ("root" or "ingress") qdisc of each of ``devs``: "del" fails where
    there is none, and -force keeps going."""
    text = "".join(f"qdisc del dev {d} {parent}\n" for d in devs)
    nsexec.run(netns, ["tc", "-force", "-batch", "-"], input=text, timeout=30)


def shape(netns: str, devs: list[str], rate_bits: int | None, mtu: int) -> None:
    """Limit egress of ``devs`` in ``netns`` to ``rate_bits`` (None: remove the limit)."""
    if not devs:
        return
    if rate_bits is None:
        # either way the device ends up with the veth default (noqueue)
        _delete_qdiscs(netns, devs, "root")
        return
    nsexec.check(
        netns, ["tc", "-batch", "-"], "tc (rate shaping)", input=tbf_batch(devs, rate_bits, mtu)
    )


def ifb_name(dev: str) -> str:
    """The ifb device that shapes what ``dev`` receives (``w0`` -> ``ifb-w0``)."""
    return f"ifb-{dev}"[:15]


def ingress_batch(devs: list[str], rate_bits: int, mtu: int) -> str:
    """``tc -batch`` text: every frame ``devs`` receive goes through the tbf of its ifb device
    (u32 matching all, mirred redirect: this kernel has no matchall classifier)."""
    text = ""
    for d in devs:
        text += (
            f"qdisc replace dev {d} handle ffff: ingress\n"
            f"filter replace dev {d} parent ffff: pref 1 protocol all u32 match u32 0 0 "
            f"action mirred egress redirect dev {ifb_name(d)}\n"
        )
    return text + tbf_batch([ifb_name(d) for d in devs], rate_bits, mtu)


def shape_ingress(netns: str, devs: list[str], rate_bits: int | None, mtu: int) -> None:
    """Limit what ``devs`` in ``netns`` receive to ``rate_bits`` (None: remove the limit).

    Why: a sender's own egress qdisc limits only what passes through it, and an AF_XDP socket's
    frames (hostlib/_xsk.c) go straight to the driver. The far end's ingress cannot be skipped by
    anything the sender does, so the testbed shapes there too (an ifb device per port, made on
    first use, holding the tbf)."""
    if not devs:
        return
    if rate_bits is None:
        _delete_qdiscs(netns, devs, "ingress")
        return
    script = "".join(
        f"ip link show {ifb_name(d)} >/dev/null 2>&1 || ip link add {ifb_name(d)} type ifb\n"
        f"ip link set {ifb_name(d)} up\n"
        for d in devs
    )
    nsexec.check(netns, ["sh", "-ec", script], "ip link (ifb devices for ingress shaping)")
    nsexec.check(
        netns,
        ["tc", "-batch", "-"],
        "tc (ingress rate shaping)",
        input=ingress_batch(devs, rate_bits, mtu),
    )
