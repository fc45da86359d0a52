"""A thin ctypes binding over Debian's libbpf.so.1 (package libbpf1, libbpf 1.1): open a BPF
object file, size its maps and set its read-only data, reuse map fds, load it, read fds.

Only the calls xdp_switch/objload.py makes are bound; libbpf does the rest (BTF-defined maps,
maps of maps, relocations, bpf_loop callbacks, program types from section names). What libbpf
prints is collected (`Object.messages`), not written to stderr, and a program's verifier log
goes into a buffer of ours, which a refusal returns (ObjectLoadError.log).
"""

from __future__ import annotations

import ctypes as ct
import os
from pathlib import Path

from xdp_agg.errors import EnvironmentProblem

_P = ct.c_void_p
_LOG_SIZE = 1 << 20  # the verifier log's tail (the kernel keeps the last part when it overflows)
BTF_KIND_VAR, BTF_KIND_DATASEC = 14, 15
LIBBPF_WARN, LIBBPF_INFO = 0, 1


class LibbpfError(OSError):
    """A libbpf call failed; .errno holds the reason, the message what libbpf said."""


class ObjectLoadError(LibbpfError):
    """bpf_object__load failed: `prog` the program the kernel refused (None: not a program),
    `log` its verifier log."""

    def __init__(self, err: int, msg: str, prog: str | None, log: str) -> None:
        super().__init__(err, msg)
        self.prog, self.log = prog, log


def _lib() -> ct.CDLL:
    try:
        lib = ct.CDLL("libbpf.so.1", use_errno=True)
    except OSError as e:
        raise EnvironmentProblem("libbpf.so.1 is missing: install Debian's libbpf1") from e
    sigs = {
        "bpf_object__open_file": (_P, [ct.c_char_p, _P]),
        "bpf_object__load": (ct.c_int, [_P]),
        "bpf_object__close": (None, [_P]),
        "bpf_object__btf": (_P, [_P]),
        "bpf_object__find_map_by_name": (_P, [_P, ct.c_char_p]),
        "bpf_object__find_program_by_name": (_P, [_P, ct.c_char_p]),
        "bpf_object__next_map": (_P, [_P, _P]),
        "bpf_object__next_program": (_P, [_P, _P]),
        "bpf_map__name": (ct.c_char_p, [_P]),
        "bpf_map__fd": (ct.c_int, [_P]),
        "bpf_map__set_max_entries": (ct.c_int, [_P, ct.c_uint32]),
        "bpf_map__reuse_fd": (ct.c_int, [_P, ct.c_int]),
        "bpf_map__initial_value": (_P, [_P, ct.POINTER(ct.c_size_t)]),
        "bpf_program__name": (ct.c_char_p, [_P]),
        "bpf_program__fd": (ct.c_int, [_P]),
        "bpf_program__set_autoload": (ct.c_int, [_P, ct.c_bool]),
        "bpf_program__set_expected_attach_type": (ct.c_int, [_P, ct.c_int]),
        "bpf_program__set_log_buf": (ct.c_int, [_P, ct.c_char_p, ct.c_size_t]),
        "btf__find_by_name_kind": (ct.c_int, [_P, ct.c_char_p, ct.c_uint32]),
        "btf__type_by_id": (_P, [_P, ct.c_uint32]),
        "btf__name_by_offset": (ct.c_char_p, [_P, ct.c_uint32]),
        "libbpf_set_print": (_P, [_P]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


_PRINT_FN = ct.CFUNCTYPE(ct.c_int, ct.c_int, ct.c_char_p, _P)
_libc = ct.CDLL(None)
_libc.vsnprintf.argtypes = [ct.c_char_p, ct.c_size_t, ct.c_char_p, _P]
_messages: list[str] = []  # what libbpf printed at warning and info level, oldest first


@_PRINT_FN
def _print(level: int, fmt: bytes, args: int) -> int:
    if level <= LIBBPF_INFO:
        buf = ct.create_string_buffer(4096)
        _libc.vsnprintf(buf, len(buf), fmt, args)  # x86-64: a va_list is passed as a pointer
        _messages.append(buf.value.decode(errors="replace"))
    return 0


_LIB: ct.CDLL | None = None


def lib() -> ct.CDLL:
    """libbpf, bound once, its printing routed into _messages."""
    global _LIB
    if _LIB is None:
        _LIB = _lib()
        _LIB.libbpf_set_print(ct.cast(_print, _P))
    return _LIB


def _check(ret: int, what: str) -> int:
    if ret < 0:
        raise LibbpfError(-ret, f"{what}: {os.strerror(-ret)}{_said()}")
    return ret


def _said() -> str:
    """libbpf's last messages, for an error's text."""
    tail = [m.strip() for m in _messages[-6:] if m.strip()]
    return ("\nlibbpf: " + "\nlibbpf: ".join(tail)) if tail else ""


class _BtfType(ct.Structure):
    _fields_ = [("name_off", ct.c_uint32), ("info", ct.c_uint32), ("size", ct.c_uint32)]


class _VarSecinfo(ct.Structure):
    _fields_ = [("type", ct.c_uint32), ("offset", ct.c_uint32), ("size", ct.c_uint32)]


class Object:
    """An opened BPF object file (bpf_object__open_file), then loaded (`load`); `close` frees
    it and closes every fd libbpf opened for it."""

    def __init__(self, path: Path) -> None:
        self._lib = lib()
        _messages.clear()
        ptr = self._lib.bpf_object__open_file(str(path).encode(), None)
        if not ptr:
            e = ct.get_errno()
            raise LibbpfError(e, f"could not open {path}: {os.strerror(e)}{_said()}")
        self._obj = ptr
        self._log = ct.create_string_buffer(_LOG_SIZE)
        for p in self._iter("program"):
            self._lib.bpf_program__set_log_buf(p, self._log, _LOG_SIZE)

    def _iter(self, kind: str):
        nxt = getattr(self._lib, f"bpf_object__next_{kind}")
        p = nxt(self._obj, None)
        while p:
            yield p
            p = nxt(self._obj, p)

    def map_names(self) -> list[str]:
        return [self._lib.bpf_map__name(m).decode() for m in self._iter("map")]

    def program_names(self) -> list[str]:
        return [self._lib.bpf_program__name(p).decode() for p in self._iter("program")]

    def _map(self, name: str) -> int:
        m = self._lib.bpf_object__find_map_by_name(self._obj, name.encode())
        if not m:
            raise KeyError(f"no map {name!r} in the object")
        return m

    def _prog(self, name: str) -> int:
        p = self._lib.bpf_object__find_program_by_name(self._obj, name.encode())
        if not p:
            raise KeyError(f"no program {name!r} in the object")
        return p

    def set_max_entries(self, name: str, n: int) -> None:
        _check(self._lib.bpf_map__set_max_entries(self._map(name), n), f"max_entries of {name}")

    def reuse_map_fd(self, name: str, fd: int) -> None:
        _check(self._lib.bpf_map__reuse_fd(self._map(name), fd), f"reuse the fd of {name}")

    def set_rodata(self, var: str, value: int, size: int = 4) -> None:
        """Set `const volatile` global `var` (in .rodata) before load, found by its BTF."""
        btf = self._lib.bpf_object__btf(self._obj)
        sec = self._lib.btf__find_by_name_kind(btf, b".rodata", BTF_KIND_DATASEC)
        if sec < 0:
            raise KeyError("the object has no .rodata")
        t = _BtfType.from_address(self._lib.btf__type_by_id(btf, sec))
        infos = (_VarSecinfo * (t.info & 0xFFFF)).from_address(
            self._lib.btf__type_by_id(btf, sec) + ct.sizeof(_BtfType)
        )
        for vi in infos:
            v = _BtfType.from_address(self._lib.btf__type_by_id(btf, vi.type))
            if self._lib.btf__name_by_offset(btf, v.name_off).decode() != var:
                continue
            if vi.size != size:
                raise ValueError(f"{var} is {vi.size} bytes, not {size}")
            rodata = next(m for m in self.map_names() if m.endswith(".rodata"))
            n = ct.c_size_t()
            data = self._lib.bpf_map__initial_value(self._map(rodata), ct.byref(n))
            ct.memmove(data + vi.offset, value.to_bytes(size, "little"), size)
            return
        raise KeyError(f"no variable {var!r} in .rodata")

    def skip_program(self, name: str) -> None:
        """Leave program `name` out of the load (not verified, no fd)."""
        self._lib.bpf_program__set_autoload(self._prog(name), False)

    def only_program(self, name: str, expected_attach_type: int) -> None:
        """Load program `name` alone, with `expected_attach_type`."""
        for p in self._iter("program"):
            self._lib.bpf_program__set_autoload(p, self._lib.bpf_program__name(p) == name.encode())
        _check(
            self._lib.bpf_program__set_expected_attach_type(self._prog(name), expected_attach_type),
            f"expected attach type of {name}",
        )

    def load(self) -> None:
        """bpf_object__load: maps created (or reused), programs relocated and verified.
        ObjectLoadError, with the refused program's verifier log, when it fails."""
        self._log[0] = b"\0"
        _messages.clear()
        ret = self._lib.bpf_object__load(self._obj)
        if ret < 0:
            refused = None
            for m in _messages:
                if "BPF program load failed" in m and "prog '" in m:
                    refused = m.split("prog '", 1)[1].split("'", 1)[0]
            log = self._log.value.decode(errors="replace")
            raise ObjectLoadError(-ret, f"{os.strerror(-ret)}{_said()}", refused, log)

    def map_fd(self, name: str) -> int:
        return _check(self._lib.bpf_map__fd(self._map(name)), f"fd of map {name}")

    def prog_fd(self, name: str) -> int:
        return _check(self._lib.bpf_program__fd(self._prog(name)), f"fd of program {name}")

    def close(self) -> None:
        if self._obj:
            self._lib.bpf_object__close(self._obj)
            self._obj = None
