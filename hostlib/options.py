"""A worker's options as data: HostOptions, and the one reader of the XDP_AGG_* environment.

    opts = HostOptions(window=32, timeout=10.0)            # the defaults but these
    opts = HostOptions.from_env(timeout=10.0)               # the environment's, then these
    comm = hostlib.init(rank, world, "198.18.0.1:48800", "run-7", opts)

hostlib.init without options takes HostOptions.from_env(). No other module of hostlib reads an
XDP_AGG_* variable: the PyTorch backend and hook take theirs from here too (control_from_env,
token_from_env, HostOptions.fallback), and the C extension's kernel choice (simd_from_env) is
applied by hostlib.native_stream when it imports the extension.

The environment (each one a field of HostOptions unless said otherwise):

| variable | field | meaning |
|---|---|---|
| XDP_AGG_CONTROL | (control_from_env) | the control endpoint(s), host:port[,host:port...] |
| XDP_AGG_JOB_TOKEN | (token_from_env) | the job's token, for a rank without the secret |
| XDP_AGG_SECRET_FILE | secret_file | the deployment secret's file |
| XDP_AGG_ELEMS | elems | int32 per packet, or "auto" |
| XDP_AGG_WINDOW | window | slots per worker |
| XDP_AGG_LANES | lanes | threads (sockets, slot ranges) one all-reduce runs on, or "auto" |
| XDP_AGG_TIMEOUT | timeout | seconds an all-reduce may go without progress |
| XDP_AGG_IP | ip | this rank's address towards the aggregator |
| XDP_AGG_NATIVE | native | "0": the numpy loop instead of the C one |
| XDP_AGG_SPIN | spin | "0": never busy-poll for an all-reduce's last results |
| XDP_AGG_EARLY_LOSS | early_loss | "0": resend on timers only, not on evidence of loss |
| XDP_AGG_DATA_PATH | data_path | the C loop's data path: udp, auto, afxdp |
| XDP_AGG_FALLBACK | fallback | hostlib.pt: "gloo" continues over gloo after a failure |
| XDP_AGG_WIRE_BITS | wire_bits | hostlib.pt: the element width of its all-reduces, auto, 16, 32 |
| XDP_AGG_SIMD | (simd_from_env) | "scalar" turns the C loop's AVX2 kernels off |
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from xdp_agg.proto import control, wire

from .afxdp import DATA_PATHS
from .stream_state import Faults

# Slots per worker when nobody says: 64, measured 2026-12-03 on this 2-core machine, shared and
# loaded (docs/design.md, "The host library", has the numbers): bench.allreduce's host row (XDP
# testbed, 768 int32 per packet, 64 MiB) ran best or second best at 64 in two passes of windows
# 32..256, without a retransmission; 256 retransmitted about 1% of its packets. 2 ranks on the
# loopback soft aggregator agree (64: none; 32, 128 and 256: 163 to 797). The old defaults
# were 64 (init), 128 (hostlib.pt) and 256 (the demo).
DEFAULT_WINDOW = 64
# Lanes: 1 when nobody says. Measured 2026-12-03 on this 2-core machine, two fresh-clone runs
# (docs/benchmarks.md "Lanes"): 2 lanes made one worker up to 1.38x faster and n = 2 and 4
# workers up to 1.35x, but n = 8 workers on the two CPUs 0.85x as fast at 64 MiB in the first
# run and 0.95x in the second (every rank's second thread competes for the same two CPUs), so 2
# is no default: it would make cells slower. "auto" (one lane per CPU the process may run on, at
# most AUTO_LANES_MAX; more than 2 could not be measured here) is for a worker that has its cores
# to itself.
DEFAULT_LANES = 1
AUTO_LANES_MAX = 2
MAX_LANES = wire.MAX_LANES  # a job's lanes (a queue's AF_XDP group holds 4 jobs' worth: _xsk.c)
FALLBACKS = ("gloo",)  # hostlib.pt's fallback modes by name (None: raise AggregatorLost)
WIRE_BITS_CHOICES = ("auto", 16, 32)  # hostlib.pt's element widths (HostOptions.wire_bits)


@dataclass(frozen=True)
class HostOptions:
    """How a worker joins and runs its all-reduces (hostlib.init's `options`).

    elems: int32 per packet (a wire size: 32, 64, 128, 256, 512, 768, 1024, 2048), or "auto":
        the most both the path MTU towards the control endpoint(s) and the aggregator allow
        (an XDP aggregator without --frags 768, the P4 target 256); comm.stats["elems"] and
        ["elems_reason"] say what it became and why. Rank 0's value makes the job, the other
        ranks adopt it.
    window: slots per worker (rank 0's makes the job).
    lanes: how many lanes one all-reduce runs on (hostlib.striping): each a thread of the C loop
        with its own data socket and source port, its own contiguous part of the job's window
        (at least one slot each) and its own congestion window and timers, over a contiguous
        part of the tensor; lane l sends from and gets its results on the job's worker_port + l
        (results go to the request's source port, in both topologies). Every rank must give the
        same number (a rank with "auto" takes rank 0's). Default 1 (DEFAULT_LANES says why).
        "auto": rank 0 runs one per CPU it may run on (os.sched_getaffinity), at most
        AUTO_LANES_MAX and the window, and 1 with the numpy loop; comm.stats["lanes"] says what
        it became. With AF_XDP every lane has its own socket on the interface's queue, all
        sharing one UMEM (hostlib/_xsk.c).
    timeout: seconds an all-reduce may go without progress before AllreduceTimeout.
    ip: the address the aggregator knows this worker by. By default the source address the
        kernel picks towards the control endpoint, with the data socket bound to 0.0.0.0 so it
        also receives results sent to a group address. Give it to pin the source address when
        one host runs several workers; the data socket then receives unicast results only.
    port: UDP port of the data socket; rank 0 binds it (0: any free port) and the job fixes it
        for every rank. Striped, aggregator j's socket gets port + j (or any free port).
    mac: this worker's MAC (switch mode); by default that of the interface holding `ip`.
    rendezvous_timeout: how long to wait for rank 0's job and for all ranks to register.
    retransmit: the retransmission timer in seconds until a round trip is measured; after, the
        timer follows the measured round trip (RFC 6298) with a floor of 3 srtt, at least 2 ms
        and at most `retransmit` (docs/protocol.md 4.4), and doubles at each expiry of the same
        packet, capped at 0.25 s.
    early_loss: resend a packet as soon as results of packets sent after it show it lost
        (docs/protocol.md 4.4: about a round trip), not only when its timer expires; False:
        timers only, with their floor at `retransmit` (the behaviour before, for comparison).
    progress: show a progress line on stderr for all-reduces that take over a second.
    faults: test hook, seeded random loss/duplication inside the engine (hostlib.engine.Faults).
    gso, gro: allow UDP GSO/GRO (each falls back to plain datagrams by itself if refused).
    native: run all-reduces in the C loop; None: when it is built; False: the numpy loop.
    cwnd: the C loop's congestion window: "aimd" (adapts to loss) or "fixed" (the window).
    data_path: how the C loop's packets travel (hostlib.afxdp): "udp" (the kernel socket),
        "auto" (AF_XDP where it can run, else the kernel socket; stats says which and why) or
        "afxdp" (AF_XDP or an error).
    spin: busy-poll briefly near an all-reduce's end (both loops; it backs off by itself).
    secret_file: the deployment secret (the file `xdp-agg serve` uses, mode 0600). Rank 0
        needs it to create the job; another rank needs it or the job's token.
    fallback: hostlib.pt only: "gloo" continues over gloo after an aggregator failure; None
        raises hostlib.pt.AggregatorLost.
    wire_bits: hostlib.pt only: the element width on the wire (docs/protocol.md 5.6) of the
        all-reduces that do not name one (the backend's all_reduce, allreduce_hook's buckets).
        "auto" (default): by dtype, as Communicator.allreduce does: bfloat16 and float16 at 16
        bits, float32 and int32 at 32. 32: every all-reduce at 32 bits (for bfloat16 and
        float16 too: the sum then errs by about 2^-16 of what 16 bits give, before the rounding
        to the tensor's dtype). 16: every float all-reduce at 16 bits, float32 too (compressed:
        error bound hostlib.scaling.error_bound(E, n, 16)); int32 stays at 32 (exact).
    """

    elems: int | str = "auto"
    window: int = DEFAULT_WINDOW
    lanes: int | str = DEFAULT_LANES
    timeout: float = 30.0
    ip: str | None = None
    port: int = 0
    mac: str | None = None
    rendezvous_timeout: float = 120.0
    retransmit: float = 0.015
    early_loss: bool = True
    progress: bool = False
    faults: Faults | None = None
    gso: bool = True
    gro: bool = True
    native: bool | None = None
    cwnd: str = "aimd"
    data_path: str = "udp"
    spin: bool = True
    secret_file: str | None = None
    fallback: str | None = None
    wire_bits: int | str = "auto"

    def __post_init__(self) -> None:
        if self.elems != "auto":
            if isinstance(self.elems, bool) or not isinstance(self.elems, int):
                raise ValueError(f"elems must be a wire size or 'auto', not {self.elems!r}")
            wire.size_code_for(self.elems)  # ValueError naming the wire sizes
        if self.window < 1:
            raise ValueError("window must be at least 1")
        _check_lanes(self.lanes)
        if self.cwnd not in ("aimd", "fixed"):
            raise ValueError(f"cwnd must be 'aimd' or 'fixed', not {self.cwnd!r}")
        if self.data_path not in DATA_PATHS:
            raise ValueError(
                f"data_path must be one of {', '.join(DATA_PATHS)}, not {self.data_path!r}"
            )
        if self.fallback is not None and self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be 'gloo' or None, not {self.fallback!r}")
        if isinstance(self.wire_bits, bool) or self.wire_bits not in WIRE_BITS_CHOICES:
            raise ValueError(f"wire_bits must be 'auto', 16 or 32, not {self.wire_bits!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **given: Any) -> HostOptions:
        """The options the environment (`env`, default os.environ) sets, the defaults for the
        rest, then `given` (fields by name; a value of None leaves the environment's)."""
        env = os.environ if env is None else env
        # field name -> value: of each field's own type (the parsers and `given` say which)
        fields: dict[str, Any] = {
            name: parse(env[var]) for var, (name, parse) in _ENV.items() if env.get(var)
        }
        fields.update({k: v for k, v in given.items() if v is not None})
        return cls(**fields)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **given: Any) -> HostOptions:
        """The options of a worker script: its parsed command line `args` (an argparse
        namespace; attributes named like fields and not None count, --elems and --window for
        example), over the environment's (from_env), then `given`."""
        names = {f.name for f in dataclasses.fields(cls)}
        from_args = {k: v for k, v in vars(args).items() if k in names and v is not None}
        return cls.from_env(**{**from_args, **given})

    def replace(self, **changes: Any) -> HostOptions:
        """A copy with `changes` (fields by name)."""
        return dataclasses.replace(self, **changes)


def _check_lanes(lanes: object) -> None:
    if lanes == "auto":
        return
    if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1:
        raise ValueError(f"lanes must be an integer of at least 1 or 'auto', not {lanes!r}")
    if lanes > MAX_LANES:
        raise ValueError(f"lanes must be at most {MAX_LANES}, not {lanes}")


def control_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """XDP_AGG_CONTROL: the control endpoint(s), "HOST:PORT[,HOST:PORT...]", or None."""
    return (os.environ if env is None else env).get("XDP_AGG_CONTROL") or None


def token_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """XDP_AGG_JOB_TOKEN: the job's token a launcher handed this rank, or None."""
    return (os.environ if env is None else env).get(control.TOKEN_ENV) or None


def simd_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """XDP_AGG_SIMD: the C loop's kernels ("scalar" or "avx2"), or None (what the CPU offers)."""
    return (os.environ if env is None else env).get("XDP_AGG_SIMD") or None


def _int_or_auto(var: str, what: str) -> Callable[[str], int | str]:
    """The parser of a variable that takes an integer or "auto" (XDP_AGG_ELEMS, _LANES)."""

    def parse(value: str) -> int | str:
        if value.strip().lower() == "auto":
            return "auto"
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{var}={value!r}: give {what} or 'auto'") from None

    return parse


def auto_lanes(opts: HostOptions, native: bool) -> int:
    """The lanes rank 0 runs with lanes="auto" (`native`: whether the C loop runs)."""
    if not native:
        return 1  # the numpy loop holds the GIL
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(AUTO_LANES_MAX, cpus, opts.window))


def _number(var: str, kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(value: str) -> float:
        try:
            return kind(value)
        except ValueError:
            raise ValueError(f"{var}={value!r}: not a number") from None

    return parse


def _off_if_zero(value: str) -> bool | None:
    """XDP_AGG_NATIVE: "0" -> False (the numpy loop); anything else -> None (when built)."""
    return False if value.strip() == "0" else None


def _fallback(value: str) -> str | None:
    value = value.strip()
    if value in ("none", "error"):
        return None
    if value not in FALLBACKS:
        raise ValueError(f"XDP_AGG_FALLBACK must be 'gloo' or unset, not {value!r}")
    return value


def _wire_bits(value: str) -> int | str:
    """XDP_AGG_WIRE_BITS: "auto", "16" or "32"."""
    value = value.strip().lower()
    if value == "auto":
        return "auto"
    if value not in ("16", "32"):
        raise ValueError(f"XDP_AGG_WIRE_BITS must be auto, 16 or 32, not {value!r}")
    return int(value)


# variable -> (field, parser of its text)
_ENV: dict[str, tuple[str, Callable[[str], object]]] = {
    "XDP_AGG_ELEMS": ("elems", _int_or_auto("XDP_AGG_ELEMS", "int32 per packet")),
    "XDP_AGG_WINDOW": ("window", _number("XDP_AGG_WINDOW", int)),
    "XDP_AGG_LANES": ("lanes", _int_or_auto("XDP_AGG_LANES", "a number of lanes")),
    "XDP_AGG_TIMEOUT": ("timeout", _number("XDP_AGG_TIMEOUT", float)),
    "XDP_AGG_IP": ("ip", str),
    "XDP_AGG_NATIVE": ("native", _off_if_zero),
    "XDP_AGG_SPIN": ("spin", lambda v: v.strip() != "0"),
    "XDP_AGG_EARLY_LOSS": ("early_loss", lambda v: v.strip() != "0"),
    "XDP_AGG_DATA_PATH": ("data_path", str),
    control.SECRET_ENV: ("secret_file", str),
    "XDP_AGG_FALLBACK": ("fallback", _fallback),
    "XDP_AGG_WIRE_BITS": ("wire_bits", _wire_bits),
}


def env_var(field: str) -> str:
    """The environment variable that sets HostOptions' `field` (for a launcher that passes
    options to a worker process through its environment); KeyError for a field without one."""
    for var, (name, _) in _ENV.items():
        if name == field:
            return var
    raise KeyError(f"HostOptions has no environment variable for {field!r}")
