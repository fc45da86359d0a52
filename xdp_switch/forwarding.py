"""Forwarding in the switch topology: the control plane of bpf/forward.h (issue 53).

An aggregator attached to several ports forwards the frames that are not aggregation traffic
between them, at XDP speed, in one of two modes (AttachOptions.forwarding):

- "routed" (each port its own subnet, the testbed's switch topology): bpf_fib_lookup and a
  devmap redirect; what XDP must not touch passes to the kernel, whose forwarding handles it.
  For that, attach sets the per-interface forwarding sysctls of the attached ports (IPv4
  `forwarding`, IPv6 `forwarding` and `force_forwarding`, kernel 6.17+) and records what they
  were in the pinned state; detach writes those values back;
- "switched" (the ports share one segment): a learned MAC table, flooding to the other ports;
  the kernel's sysctls are not touched;
- "off": frames that are not ours pass to the kernel (one-arm).

The default for the switch topology is "routed" when every port has an IPv4 subnet of its own,
else "switched" (default_mode).
"""

from __future__ import annotations

import ctypes as ct
import ipaddress
import time
from pathlib import Path

from xdp_agg import bpfsys

MODES = ("routed", "switched", "off")  # AttachOptions.forwarding; None: default_mode
MODE_CODES = {"off": 0, "routed": 1, "switched": 2}  # bpf/forward.h enum agg_fwd_mode
# bpf/forward.h enum agg_fwd_counter, in order
COUNTERS = (
    "routed",
    "switched",
    "flooded",
    "passed",
    "ttl_expired",
    "own_source",
    "loop",
    "same_port",
    "bad_source",
    "learned",
    "moved",
    "aged",
    "igmp",
    "pruned",
)
MAC_TABLE_SIZE = 4096  # bpf/forward.h AGG_FWD_MACS
AGE_S = 300.0  # a learned MAC not seen for this long is forgotten (the Linux bridge's ageing)
HOLD_S = 1.0  # a MAC seen on a second port sooner than this after the first is a loop
GROUP_TABLE_SIZE = 4096  # bpf/snoop.h AGG_FWD_GROUPS
# IGMP snooping's timers, the Linux bridge's defaults (multicast_membership_interval,
# multicast_querier_interval, last member count x interval: br_multicast.c)
MEMBER_S = 260.0  # a port is a group's member this long after a report
QUERIER_S = 255.0  # a querier is present this long after its query
LEAVE_S = 2.0  # a membership lasts this long after a leave
SYSCTL_ROOT = Path("/proc/sys/net")


class FwdConfig(ct.Structure):
    """bpf/forward.h struct agg_fwd_config."""

    _fields_ = [
        ("mode", ct.c_uint32),
        ("pad", ct.c_uint32),
        ("age_ns", ct.c_uint64),
        ("hold_ns", ct.c_uint64),
        ("member_ns", ct.c_uint64),
        ("querier_ns", ct.c_uint64),
        ("leave_ns", ct.c_uint64),
    ]


class FwdMac(ct.Structure):
    """bpf/forward.h struct agg_fwd_mac."""

    _fields_ = [("addr", ct.c_uint8 * 6), ("pad", ct.c_uint16)]


class FwdGroup(ct.Structure):
    """bpf/snoop.h struct agg_fwd_group."""

    _fields_ = [("group", ct.c_uint8 * 4), ("ifindex", ct.c_uint32)]


class FwdLearned(ct.Structure):
    """bpf/forward.h struct agg_fwd_learned."""

    _fields_ = [("ifindex", ct.c_uint32), ("pad", ct.c_uint32), ("seen_ns", ct.c_uint64)]


def _mac(mac: str) -> FwdMac:
    k = FwdMac()
    k.addr[:] = bytes.fromhex(mac.replace(":", ""))
    return k


def default_mode(topology: str, infos: list[dict]) -> str:
    """The mode attach chooses when not told: off one-arm; in the switch topology routed when
    every port has an IPv4 subnet and no two share one, else switched."""
    if topology != "switch":
        return "off"
    nets = [ipaddress.ip_interface(n).network for i in infos for n in i.get("ipv4_nets", [])]
    per_port = [len(i.get("ipv4_nets", [])) for i in infos]
    if nets and all(per_port) and len(set(nets)) == len(nets):
        return "routed"
    return "switched"


def check_mode(mode: str, topology: str, infos: list[dict]) -> str | None:
    """Why `mode` does not fit the ports, else None."""
    if mode != "off" and topology != "switch":
        return f"--forwarding {mode} needs the switch topology (several ports): --forwarding off"
    if mode == "routed" and default_mode(topology, infos) != "routed":
        return (
            "--forwarding routed needs an IPv4 subnet of its own on every port "
            "(these share one, or a port has none): --forwarding switched"
        )
    return None


def _sysctl_paths(ifname: str) -> list[Path]:
    """The per-interface sysctls routed forwarding sets to 1 (those this kernel has)."""
    paths = [
        SYSCTL_ROOT / "ipv4" / "conf" / ifname / "forwarding",
        SYSCTL_ROOT / "ipv6" / "conf" / ifname / "forwarding",
        # IPv6 forwarding by the kernel on this interface alone (6.17+; else conf/all)
        SYSCTL_ROOT / "ipv6" / "conf" / ifname / "force_forwarding",
    ]
    return [p for p in paths if p.exists()]


def enable_kernel_forwarding(ifnames: list[str]) -> dict[str, str]:
    """Set the routed mode's sysctls on `ifnames`; {path: the value before}, to restore."""
    before: dict[str, str] = {}
    try:
        for ifname in ifnames:
            for p in _sysctl_paths(ifname):
                before[str(p)] = p.read_text().strip()
                p.write_text("1\n")
    except BaseException:
        restore_sysctls(before)
        raise
    return before


def restore_sysctls(before: dict[str, str]) -> list[str]:
    """Write back what enable_kernel_forwarding found; the paths that could not be (an
    interface gone) are returned."""
    left = []
    # IPv6 forwarding written back after force_forwarding, IPv4 last: the reverse order
    for path, value in reversed(list(before.items())):
        try:
            Path(path).write_text(f"{value}\n")
        except OSError:
            left.append(path)
    return left


def install(maps: dict[str, int], mode: str, infos: list[dict], egress_fd: int) -> None:
    """Fill forward.h's maps: the mode and its timers, the ports (with the egress program, as
    tx_ports has it) and the box's own MACs and IPv4 addresses."""
    cfg = FwdConfig(
        MODE_CODES[mode],
        0,
        *(int(t * 1e9) for t in (AGE_S, HOLD_S, MEMBER_S, QUERIER_S, LEAVE_S)),
    )
    for info in infos:
        val = (ct.c_uint32 * 2)(info["ifindex"], egress_fd)  # struct bpf_devmap_val
        bpfsys.map_update(maps["fwd_ports"], ct.c_uint32(info["ifindex"]), val)
        if info.get("mac"):
            bpfsys.map_update(maps["fwd_own_macs"], _mac(info["mac"]), ct.c_uint32(info["ifindex"]))
        for ip in info.get("ipv4", []):
            key = ct.c_uint32(int.from_bytes(ipaddress.IPv4Address(ip).packed, "little"))
            bpfsys.map_update(maps["fwd_own_ips"], key, ct.c_uint32(info["ifindex"]))
    bpfsys.map_update(maps["fwd_config"], ct.c_uint32(0), cfg)


def set_timers(maps: dict[str, int], age_s: float, hold_s: float, leave_s: float = LEAVE_S) -> None:
    """Change the switched mode's ageing, loop hold and IGMP leave time (tests set them to 0 or
    large)."""
    cfg = FwdConfig()
    bpfsys.map_lookup(maps["fwd_config"], ct.c_uint32(0), cfg)
    cfg.age_ns, cfg.hold_ns, cfg.leave_ns = (int(t * 1e9) for t in (age_s, hold_s, leave_s))
    bpfsys.map_update(maps["fwd_config"], ct.c_uint32(0), cfg)


def mode_of(maps: dict[str, int]) -> str:
    """The mode the program runs ("off" for a build without forwarding)."""
    if "fwd_config" not in maps:
        return "off"
    cfg = FwdConfig()
    bpfsys.map_lookup(maps["fwd_config"], ct.c_uint32(0), cfg)
    return {v: k for k, v in MODE_CODES.items()}.get(cfg.mode, "off")


def counters(maps: dict[str, int], ncpu: int) -> dict[str, int]:
    """forward.h's counters, summed over CPUs (all 0 for a build without forwarding)."""
    out = dict.fromkeys(COUNTERS, 0)
    if "fwd_stats" not in maps:
        return out
    vals = (ct.c_uint64 * ncpu)()
    for i, name in enumerate(COUNTERS):
        if bpfsys.map_lookup(maps["fwd_stats"], ct.c_uint32(i), vals):
            out[name] = int(sum(vals))
    return out


def mac_table(maps: dict[str, int]) -> dict[str, int]:
    """The switched mode's learned MACs: {"aa:bb:..": ifindex}."""
    if "fwd_macs" not in maps:
        return {}
    out = {}
    for k in bpfsys.map_keys(maps["fwd_macs"], FwdMac):
        v = FwdLearned()
        if bpfsys.map_lookup(maps["fwd_macs"], k, v):
            out[":".join(f"{b:02x}" for b in k.addr)] = v.ifindex
    return out


def _now_ns() -> int:
    """bpf_ktime_get_ns's clock (CLOCK_MONOTONIC), which the snooping tables' times are on."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def group_table(maps: dict[str, int]) -> dict[str, list[int]]:
    """IGMP snooping's live memberships: {"239.1.2.3": [ifindex, ...]} (bpf/snoop.h)."""
    if "fwd_groups" not in maps:
        return {}
    now, out = _now_ns(), {}
    for k in bpfsys.map_keys(maps["fwd_groups"], FwdGroup):
        until = ct.c_uint64()
        if bpfsys.map_lookup(maps["fwd_groups"], k, until) and until.value > now:
            out.setdefault(str(ipaddress.IPv4Address(bytes(k.group))), []).append(k.ifindex)
    return {g: sorted(p) for g, p in sorted(out.items())}


def snooping(maps: dict[str, int]) -> dict:
    """IGMP snooping's state: whether a querier is present, the router ports, the groups."""
    if "fwd_querier" not in maps:
        return {"querier": False, "router_ports": [], "groups": {}, "size": GROUP_TABLE_SIZE}
    now, until = _now_ns(), ct.c_uint64()
    routers = [
        k.value
        for k in bpfsys.map_keys(maps["fwd_mrouters"], ct.c_uint32)
        if bpfsys.map_lookup(maps["fwd_mrouters"], k, until) and until.value > now
    ]
    querier = ct.c_uint64()
    bpfsys.map_lookup(maps["fwd_querier"], ct.c_uint32(0), querier)
    return {
        "querier": querier.value > now,
        "router_ports": sorted(routers),
        "groups": group_table(maps),
        "size": GROUP_TABLE_SIZE,
    }


def status(maps: dict[str, int], ncpu: int) -> dict:
    """What `xdp-agg status` shows of forwarding: mode, counters, learned MACs, IGMP snooping."""
    learned = mac_table(maps)
    return {
        "mode": mode_of(maps),
        "counters": counters(maps, ncpu),
        "mac_table": {"entries": len(learned), "size": MAC_TABLE_SIZE},
        "igmp_snooping": snooping(maps),
    }
