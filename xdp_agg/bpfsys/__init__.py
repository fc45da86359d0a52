"""Thin wrappers over the bpf(2) system call, for the control plane.

libbpf loads the program's object once (`attach`, bpfsys.libbpf); every later command (stats,
job, worker, slots, detach) works on the pinned maps and programs through these calls, so it
starts in milliseconds. Only what the project uses is here.
"""

from __future__ import annotations

import ctypes as ct
import errno
import os
import platform

from . import insn

_libc = ct.CDLL(None, use_errno=True)
_libc.syscall.restype = ct.c_long
_NR_BPF = {"x86_64": 321, "aarch64": 280}.get(platform.machine(), 321)

# commands (include/uapi/linux/bpf.h)
MAP_CREATE, MAP_LOOKUP_ELEM, MAP_UPDATE_ELEM, MAP_DELETE_ELEM, MAP_GET_NEXT_KEY = 0, 1, 2, 3, 4
PROG_LOAD, OBJ_PIN, OBJ_GET = 5, 6, 7
PROG_TEST_RUN = 10
OBJ_GET_INFO_BY_FD = 15

# map types
MAP_TYPE_DEVMAP = 14
# program types
PROG_TYPE_XDP = 6
# program load flags
BPF_F_XDP_HAS_FRAGS = 1 << 5  # an XDP program that handles multi-buffer frames (kernel 5.18+)
# expected attach types (enum bpf_attach_type)
BPF_XDP_DEVMAP = 33  # a devmap egress program
BPF_XDP_CPUMAP = 35  # a cpumap program (runs on the CPU a frame was redirected to)
# XDP actions
XDP_ABORTED, XDP_DROP, XDP_PASS, XDP_TX, XDP_REDIRECT = 0, 1, 2, 3, 4
XDP_ACTIONS = {0: "aborted", 1: "drop", 2: "pass", 3: "tx", 4: "redirect"}


class BpfError(OSError):
    """A bpf(2) call failed; .errno holds the reason."""


def _bpf(cmd: int, attr: ct.Structure) -> int:
    ret = _libc.syscall(_NR_BPF, cmd, ct.byref(attr), ct.sizeof(attr))
    if ret < 0:
        e = ct.get_errno()
        raise BpfError(e, f"bpf(cmd={cmd}): {os.strerror(e)}")
    return ret


_U8, _U32, _U64 = ct.c_uint8, ct.c_uint32, ct.c_uint64


def _fields(*runs: tuple[type, str]) -> list[tuple[str, type]]:
    """A ctypes _fields_ list from runs of members of one type, in the kernel header's order:
    (_U32, "map_fd pad0") is two __u32 members, as the header's `__u32 map_fd; __u32 pad0;`."""
    return [(name, ctype) for ctype, names in runs for name in names.split()]


class _MapCreate(ct.Structure):
    _fields_ = _fields(
        (_U32, "map_type key_size value_size max_entries map_flags inner_map_fd numa_node"),
        (ct.c_char * 16, "map_name"),
        (_U8 * 48, "pad"),
    )


class _ProgLoad(ct.Structure):
    _fields_ = _fields(
        (_U32, "prog_type insn_cnt"),
        (_U64, "insns license"),
        (_U32, "log_level log_size"),
        (_U64, "log_buf"),
        (_U32, "kern_version prog_flags"),
        (ct.c_char * 16, "prog_name"),
        (_U32, "prog_ifindex expected_attach_type prog_btf_fd func_info_rec_size"),
        (_U64, "func_info"),
        (_U32, "func_info_cnt"),
        (_U8 * 64, "pad"),
    )


class _MapElem(ct.Structure):
    _fields_ = _fields((_U32, "map_fd pad0"), (_U64, "key value flags"))


class _ObjPin(ct.Structure):
    _fields_ = _fields((_U64, "pathname"), (_U32, "bpf_fd file_flags"), (_U8 * 8, "pad"))


class _TestRun(ct.Structure):
    _fields_ = _fields(
        (_U32, "prog_fd retval data_size_in data_size_out"),
        (_U64, "data_in data_out"),
        (_U32, "repeat duration ctx_size_in ctx_size_out"),
        (_U64, "ctx_in ctx_out"),
        (_U32, "flags cpu batch_size pad"),
    )


class _InfoByFd(ct.Structure):
    _fields_ = _fields((_U32, "bpf_fd info_len"), (_U64, "info"))


class ProgInfo(ct.Structure):
    """struct bpf_prog_info, the leading fields we read."""

    _fields_ = _fields(
        (_U32, "type id"),
        (_U8 * 8, "tag"),
        (_U32, "jited_prog_len xlated_prog_len"),
        (_U64, "jited_prog_insns xlated_prog_insns load_time"),
        (_U32, "created_by_uid nr_map_ids"),
        (_U64, "map_ids"),
        (ct.c_char * 16, "name"),
        (_U32, "ifindex gpl_compatible"),
        (_U64, "netns_dev netns_ino"),
        (_U32, "nr_jited_ksyms nr_jited_func_lens"),
        (_U64, "jited_ksyms jited_func_lens"),
        (_U32, "btf_id func_info_rec_size"),
        (_U64, "func_info"),
        (_U32, "nr_func_info nr_line_info"),
        (_U64, "line_info jited_line_info"),
        (_U32, "nr_jited_line_info line_info_rec_size jited_line_info_rec_size nr_prog_tags"),
        # run_time_ns and run_cnt: counted with kernel.bpf_stats_enabled = 1 only
        (_U64, "prog_tags run_time_ns run_cnt recursion_misses"),
        (_U32, "verified_insns"),  # instructions the verifier processed (kernel 5.16+)
        (_U8 * 64, "pad"),
    )


class MapInfo(ct.Structure):
    """struct bpf_map_info, the leading fields we read."""

    _fields_ = _fields(
        (_U32, "type id key_size value_size max_entries map_flags"),
        (ct.c_char * 16, "name"),
        (_U32, "ifindex btf_vmlinux_value_type_id"),
        (_U64, "netns_dev netns_ino"),
        (_U32, "btf_id"),
        (_U8 * 64, "pad"),
    )


def possible_cpus() -> int:
    """Number of possible CPUs: the per-CPU value count of per-CPU maps."""
    with open("/sys/devices/system/cpu/possible") as f:
        spec = f.read().strip()
    n = 0
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        n = max(n, int(hi or lo) + 1)
    return n


def kernel_max_cpus() -> int:
    """The most CPUs this kernel was built for (NR_CPUS): a cpumap may have no more entries."""
    with open("/sys/devices/system/cpu/kernel_max") as f:
        return int(f.read()) + 1


def map_create(
    map_type: int,
    key_size: int,
    value_size: int,
    max_entries: int,
    name: str,
    inner_map_fd: int = 0,
) -> int:
    """Create a map; returns its fd. `inner_map_fd`: for a map of maps, a map like its values."""
    a = _MapCreate(
        map_type, key_size, value_size, max_entries, 0, inner_map_fd, 0, name.encode()[:15]
    )
    return _bpf(MAP_CREATE, a)


VERIFIER_LOG_BYTES = 1 << 20  # the tail of the verifier log kept when a load is refused


class ProgLoadError(BpfError):
    """The kernel refused a program; .log holds the tail of the verifier's log."""

    def __init__(self, err: int, msg: str, log: str):
        super().__init__(err, msg)
        self.log = log


def prog_load(
    prog_type: int,
    insns: list[int] | bytes,
    name: str,
    license: bytes = b"GPL",
    prog_flags: int = 0,
    expected_attach_type: int = 0,
) -> int:
    """Load a program given as raw 64-bit instructions (a list of ints, or their bytes, map fds
    patched in); returns its fd. `prog_flags`: e.g. BPF_F_XDP_HAS_FRAGS.
    A refusal raises ProgLoadError with the verifier log's tail: the load is retried once with
    the log on (a log costs the verifier time, so the first try has none)."""
    raw = bytes(insns) if isinstance(insns, (bytes, bytearray)) else None
    if raw is not None:
        code = ct.create_string_buffer(raw, len(raw))
        count = len(raw) // 8
    else:
        code = (ct.c_uint64 * len(insns))(*insns)
        count = len(insns)
    lic = ct.create_string_buffer(license)
    attr = _ProgLoad(prog_type, count, ct.addressof(code), ct.addressof(lic))
    attr.prog_name = name.encode()[:15]
    attr.prog_flags = prog_flags
    attr.expected_attach_type = expected_attach_type
    try:
        return _bpf(PROG_LOAD, attr)
    except BpfError as e:
        # kernels since 6.4 keep the log's tail (rotating) when it overflows the buffer
        log = ct.create_string_buffer(VERIFIER_LOG_BYTES)
        attr.log_level, attr.log_size, attr.log_buf = 1, len(log), ct.addressof(log)
        try:
            return _bpf(PROG_LOAD, attr)
        except BpfError as e2:
            text = log.value.decode(errors="replace")
            raise ProgLoadError(e2.errno, f"{e}: the kernel refused {name}", text) from e2


XDP_PASS_INSNS = [insn.BPF_MOV64_IMM(insn.BPF_REG_0, XDP_PASS), insn.BPF_EXIT_INSN()]


def _addr(buf) -> int:
    return ct.addressof(buf)


def map_lookup(fd: int, key: ct.Structure | ct._SimpleCData, value) -> bool:
    """Fill `value` with the element at `key`; False if there is none."""
    a = _MapElem(fd, 0, _addr(key), _addr(value), 0)
    try:
        _bpf(MAP_LOOKUP_ELEM, a)
    except BpfError as e:
        if e.errno == errno.ENOENT:
            return False
        raise
    return True


def map_update(fd: int, key, value, flags: int = 0) -> None:
    """Write `value` at `key`."""
    _bpf(MAP_UPDATE_ELEM, _MapElem(fd, 0, _addr(key), _addr(value), flags))


def map_delete(fd: int, key) -> bool:
    """Delete `key`; False if it was not there."""
    try:
        _bpf(MAP_DELETE_ELEM, _MapElem(fd, 0, _addr(key), 0, 0))
    except BpfError as e:
        if e.errno == errno.ENOENT:
            return False
        raise
    return True


def map_keys(fd: int, key_type) -> list:
    """All keys of a hash map, as instances of key_type."""
    keys, prev = [], None
    while True:
        nxt = key_type()
        a = _MapElem(fd, 0, _addr(prev) if prev is not None else 0, _addr(nxt), 0)
        try:
            _bpf(MAP_GET_NEXT_KEY, a)
        except BpfError as e:
            if e.errno == errno.ENOENT:
                return keys
            raise
        keys.append(nxt)
        prev = nxt


def obj_pin(fd: int, path: str) -> None:
    """Pin a program or map fd at a bpffs path."""
    p = ct.create_string_buffer(path.encode())
    _bpf(OBJ_PIN, _ObjPin(_addr(p), fd, 0))


def obj_get(path: str) -> int:
    """Open a pinned program or map; returns an fd."""
    p = ct.create_string_buffer(path.encode())
    return _bpf(OBJ_GET, _ObjPin(_addr(p), 0, 0))


def prog_info(fd: int) -> ProgInfo:
    info = ProgInfo()
    _bpf(OBJ_GET_INFO_BY_FD, _InfoByFd(fd, ct.sizeof(info), _addr(info)))
    return info


def map_info(fd: int) -> MapInfo:
    info = MapInfo()
    _bpf(OBJ_GET_INFO_BY_FD, _InfoByFd(fd, ct.sizeof(info), _addr(info)))
    return info


def memlock(fd: int) -> int:
    """Bytes of kernel memory a BPF map or program holds: the "memlock" line of the fd's
    /proc/self/fdinfo entry (bpf_map_info and bpf_prog_info do not carry it)."""
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == "memlock":
                return int(value)
    raise BpfError(errno.EINVAL, f"fd {fd} is not a BPF map or program (no memlock)")


BPF_STATS_SYSCTL = "/proc/sys/kernel/bpf_stats_enabled"


def bpf_stats_enabled() -> bool:
    """Whether the kernel counts programs' run time and runs (kernel.bpf_stats_enabled = 1;
    off by default, as the counting costs a little per run)."""
    try:
        with open(BPF_STATS_SYSCTL) as f:
            return f.read().strip() == "1"
    except OSError:  # no such sysctl (an old kernel): nothing is counted
        return False


class XdpMd(ct.Structure):
    """struct xdp_md, as the test-run context."""

    _fields_ = _fields(
        (_U32, "data data_end data_meta ingress_ifindex rx_queue_index egress_ifindex")
    )


def prog_test_run(
    fd: int, data: bytes, repeat: int = 1, ingress_ifindex: int = 0, out_size: int = 4096
) -> tuple[int, bytes, int]:
    """Run an XDP program on one packet (BPF_PROG_TEST_RUN).

    Returns (XDP action, packet after the program, mean duration in ns per run).
    With repeat > 1 the packet buffer and the maps carry over between repetitions.
    """
    din = ct.create_string_buffer(bytes(data), len(data))
    dout = ct.create_string_buffer(max(out_size, len(data) + 256))
    a = _TestRun()
    a.prog_fd, a.data_size_in, a.data_in = fd, len(data), _addr(din)
    a.data_size_out, a.data_out, a.repeat = len(dout), _addr(dout), repeat
    ctx = None
    if ingress_ifindex:
        ctx = XdpMd(0, len(data), 0, ingress_ifindex, 0, 0)
        a.ctx_in, a.ctx_size_in = _addr(ctx), ct.sizeof(ctx)
    _bpf(PROG_TEST_RUN, a)
    return a.retval, dout.raw[: a.data_size_out], a.duration
