"""One CPU per slot: which CPU owns each slot, the cpumap that takes a slot's packets there
(attach --slot-cpus cpumap, bpf/slot_cpus.h), and what a NIC's receive hash is set to.

When the contributions of a slot land on several CPUs, each adds into its own partial and the
completing CPU gathers the others' (bpf/aggregate.h): a cache line moved per contribution
(docs/benchmarks.md). Two ways to keep a slot on one CPU (docs/design.md "One CPU per slot"):
- a NIC whose receive hash (RSS) can be set: hash UDP/IPv4 on the ports alone, so that lane l of
  every worker (the same source port) lands on the same queue; rss_report() says what
  the NIC does now and the command that changes it;
- anywhere else (veth, NICs whose hash cannot be set): the cpumap, steered by the slot table.

The slot table (`slot_cpu`, wire slot -> CPU) follows one rule, lane_cpu(): a job's slots
[base, base + count) are cut into len(cpus) contiguous ranges of equal size (the last ones one
shorter when count does not divide), range i owned by cpus[i]. A host lane is a contiguous range
of its job's slots, so with as many lanes as CPUs every lane is on a CPU of its own, and with a
multiple of them whole lanes share one. Slots of no job follow the same rule over the pool.
"""

from __future__ import annotations

import ctypes as ct
import os
import subprocess

from xdp_agg import bpfsys
from xdp_agg.proto import wire

CPUMAP_QSIZE = 2048  # frames queued per CPU: a window of slots from every worker, with room


def default_cpus() -> list[int]:
    """The CPUs this process may run on (the aggregator's CPUs unless --cpus says otherwise)."""
    return sorted(os.sched_getaffinity(0))


def parse_cpus(text: str) -> list[int]:
    """A CPU list as taskset and /sys write it ("0-3,6"); ValueError for a bad one."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"bad CPU list {text!r}: write it as 0-3,6")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    possible = bpfsys.possible_cpus()
    if not cpus or max(cpus) >= possible:
        raise ValueError(f"CPU list {text!r}: CPUs are 0..{possible - 1} here")
    return sorted(cpus)


def lane_cpu(i: int, count: int, cpus: list[int]) -> int:
    """The CPU that owns slot i (0-based) of a range of `count` slots: range i * len(cpus) //
    count of the len(cpus) contiguous ranges (the module docstring's rule)."""
    return cpus[i * len(cpus) // count]


def _write_table(fd: int, first: int, count: int, cpus: list[int]) -> None:
    for i in range(count):
        bpfsys.map_update(fd, ct.c_uint32(first + i), ct.c_uint32(lane_cpu(i, count, cpus)))


def install(fds: dict[str, int], cpumap_prog_fd: int, cpus: list[int], pool_slots: int) -> None:
    """Put the aggregator (`cpumap_prog_fd`, loader.PROG_CPUMAP) on the cpumap entry of every
    CPU in `cpus` (the kernel starts a thread on each) and fill the slot table over the pool;
    wire slots beyond the pool (dropped as out of range) go to the first CPU."""
    for cpu in cpus:
        val = (ct.c_uint32 * 2)(CPUMAP_QSIZE, cpumap_prog_fd)  # struct bpf_cpumap_val
        bpfsys.map_update(fds["cpu_map"], ct.c_uint32(cpu), val)
    _write_table(fds["slot_cpu"], 0, pool_slots, cpus)
    _write_table(fds["slot_cpu"], pool_slots, wire.MAX_SLOTS - pool_slots, cpus[:1])


def send_back(fds: dict[str, int], ifindex: int, egress_prog_fd: int) -> None:
    """The way back out of interface `ifindex` (bpf/slot_cpus.h tx_self): a frame the cpumap's
    aggregator sends out of the interface it came in on, with the egress program of the
    broadcasts out of it (loader.PROG_COPY one-arm, loader.PROG_EGRESS in the switch
    topology), so that both kinds can share the kernel's bulk queue."""
    val = (ct.c_uint32 * 2)(ifindex, egress_prog_fd)  # struct bpf_devmap_val
    bpfsys.map_update(fds["tx_self"], ct.c_uint32(ifindex), val)


def assign_job(fds: dict[str, int], slot_base: int, slot_count: int, cpus: list[int]) -> None:
    """Give a job's slots their CPUs (lane_cpu over the job's own range)."""
    _write_table(fds["slot_cpu"], slot_base, slot_count, cpus)


def slot_owner(fds: dict[str, int], g: int) -> int:
    """The CPU the table sends slot g's packets to."""
    v = ct.c_uint32()
    bpfsys.map_lookup(fds["slot_cpu"], ct.c_uint32(g), v)
    return v.value


# ethtool's names of the hash fields (ethtool -n IFACE rx-flow-hash udp4), and its letters.
_FIELDS = {
    "L2DA": "m",
    "VLAN tag": "v",
    "L3 proto": "t",
    "IP SA": "s",
    "IP DA": "d",
    "L4 bytes 0 & 1 [TCP/UDP src port]": "f",
    "L4 bytes 2 & 3 [TCP/UDP dst port]": "n",
}
WANTED_HASH = "fn"  # both UDP ports: lane l of every worker of a job hashes alike


def _ethtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ethtool", *args], capture_output=True, text=True, timeout=10)


def _hash_advice(ifname: str, letters: str) -> tuple[bool, str]:
    """Whether hash fields `letters` keep a lane on one queue, and the sentence saying so."""
    if "s" not in letters and "f" in letters:
        return True, f"{ifname} hashes UDP/IPv4 on {letters}: lane l of every worker, one queue"
    why = "the source address" if "s" in letters else "not the source port"
    return False, (
        f"{ifname} hashes UDP/IPv4 on {letters or 'nothing'} ({why}): "
        f"`ethtool -N {ifname} rx-flow-hash udp4 {WANTED_HASH}` hashes on the ports alone, so "
        "that lane l of every worker lands on one queue (docs/operations.md)"
    )


def rss_report(ifname: str) -> dict:
    """What interface `ifname`'s receive hash for UDP/IPv4 uses and what to change:
    {"ifname", "driver", "hash": ethtool's field letters (m v t s d f n), or None where there is
    no RSS hash to read (veth, most virtual devices), "fits": whether every contribution of a
    lane lands on one queue, "advice": a sentence, with the command where one helps}."""
    out = {"ifname": ifname, "driver": None, "hash": None, "fits": False}
    try:
        info = _ethtool("-i", ifname)
        hashed = _ethtool("-n", ifname, "rx-flow-hash", "udp4")
    except (OSError, subprocess.TimeoutExpired) as e:
        return {**out, "advice": f"ethtool could not run ({e}): install it to read the RSS hash"}
    for line in info.stdout.splitlines():
        if line.startswith("driver:"):
            out["driver"] = line.split(":", 1)[1].strip()
    if hashed.returncode != 0:
        return {
            **out,
            "advice": f"{ifname} ({out['driver']}) has no RSS hash to set: --slot-cpus cpumap "
            "keeps each slot on one CPU",
        }
    lines = {line.strip() for line in hashed.stdout.splitlines()}
    out["hash"] = "".join(letter for name, letter in _FIELDS.items() if name in lines)
    out["fits"], out["advice"] = _hash_advice(ifname, out["hash"])
    return out
