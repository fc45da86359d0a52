"""How an aggregator is attached, as one frozen value: AttachOptions.

Every place that attaches or records an attachment takes this one object and writes it the same
way (to_dict / from_dict, JSON types): `xdp-agg attach` builds it from its options
(xdp_agg.app.options adds the click options, one per field but `cflags`), the systemd service
from its config file's keys (xdp_agg.app.service: KEY is the field's name in capitals, FRAGS for
--frags, SLOT_CPUS for --slot-cpus, ...), backend.attach takes it, and the pinned state records
it as attached (pins.State.options, which `status` shows). A dict without some of the keys (a
state file or a config of an older version) gets their defaults; keys this version does not
know are left out (an older version's `toolchain`, since bcc left the attach path).

The checks here are those of the values alone and of the options together; what depends on the
interfaces (one-arm takes exactly one) is backend.attach's. A bad value raises ValueError naming
the command-line option and what to write instead (the CLI shows it as a usage error, the
service prefixes its config file).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from xdp_agg.proto import limits, wire

from . import forwarding, loader

TOPOLOGIES = ("one-arm", "switch")  # the words netns_testbed uses for the same two layouts
XDP_MODES = ("native", "skb")  # how XDP is attached: in the driver, or generic (skb)
DEFAULT_SLOT_CPUS = "rss"  # chosen by measurement (docs/benchmarks.md "One CPU per slot")


def _one_of(value: object, allowed, option: str) -> None:
    if value not in allowed:
        raise ValueError(f"{option} must be one of {', '.join(allowed)}, not {value!r}")


@dataclass(frozen=True)
class AttachOptions:
    """How the XDP aggregator is attached (each field is an option of `xdp-agg attach`, except
    cflags, which only tests set)."""

    topology: str | None = None  # one of TOPOLOGIES; None: one-arm for one interface, else switch
    xdp_mode: str = "native"  # one of XDP_MODES
    pool_slots: int = limits.DEFAULT_POOL_SLOTS  # aggregation slots shared by all jobs
    variant: str = "percpu"  # one of loader.VARIANTS
    frags: bool = False  # load as an XDP multi-buffer program (jumbo frames)
    slot_cpus: str = DEFAULT_SLOT_CPUS  # one of loader.SLOT_CPUS
    cpus: tuple[int, ...] | None = None  # cpumap: the CPUs that aggregate (None: every allowed)
    # how ordinary traffic crosses the switch topology's ports: one of forwarding.MODES; None:
    # routed where every port has a subnet of its own, else switched (off one-arm)
    forwarding: str | None = None
    cflags: tuple[str, ...] = ()  # test-only build flags (loader.race_test_cflags)

    def __post_init__(self) -> None:
        # JSON gives lists, click gives lists or tuples: kept as tuples (hashable, frozen)
        if self.cpus is not None and not isinstance(self.cpus, tuple):
            object.__setattr__(self, "cpus", tuple(self.cpus))
        if not isinstance(self.cflags, tuple):
            object.__setattr__(self, "cflags", tuple(self.cflags))
        self.check()

    def check(self) -> None:
        """ValueError, saying what to give instead, for a value out of range or options that do
        not go together."""
        if self.topology is not None:
            _one_of(self.topology, TOPOLOGIES, "--topology")
        _one_of(self.xdp_mode, XDP_MODES, "--xdp-mode")
        _one_of(self.variant, tuple(loader.VARIANTS), "--variant")
        _one_of(self.slot_cpus, tuple(loader.SLOT_CPUS), "--slot-cpus")
        if self.forwarding is not None:
            _one_of(self.forwarding, forwarding.MODES, "--forwarding")
            if self.topology == "one-arm" and self.forwarding != "off":
                raise ValueError(
                    f"--forwarding {self.forwarding} needs the switch topology (one-arm has one "
                    "port): --forwarding off, or --topology switch"
                )
        pool = self.pool_slots
        if isinstance(pool, bool) or not isinstance(pool, int) or not 1 <= pool <= wire.MAX_SLOTS:
            raise ValueError(f"--pool-slots must be 1..{wire.MAX_SLOTS}, not {pool!r}")
        if not isinstance(self.frags, bool):
            raise ValueError(f"--frags is on or off (true or false), not {self.frags!r}")
        if self.cpus is not None:
            bad = [c for c in self.cpus if isinstance(c, bool) or not isinstance(c, int) or c < 0]
            if bad or not self.cpus or len(set(self.cpus)) != len(self.cpus):
                raise ValueError(
                    f"--cpus must name each CPU once, as 0-3,6, not {list(self.cpus)!r}"
                )
        if not all(isinstance(f, str) for f in self.cflags):
            raise ValueError(f"cflags must be strings, not {list(self.cflags)!r}")
        if self.slot_cpus == "cpumap" and self.xdp_mode != "native":
            # net/core/dev.c generic_xdp_install: no program using a cpumap with programs
            raise ValueError(
                "--slot-cpus cpumap needs native XDP (generic XDP refuses a cpumap): "
                "--xdp-mode native, or --slot-cpus rss"
            )
        if self.slot_cpus == "cpumap" and self.frags:
            # not tested: multi-buffer frames through the cpumap and back out by redirect
            raise ValueError(
                "--slot-cpus cpumap is not built for --frags (jumbo frames) yet: choose one"
            )

    def to_dict(self) -> dict[str, Any]:
        """The options as JSON types (lists for the tuples), every field present."""
        d = dataclasses.asdict(self)
        d["cpus"] = list(self.cpus) if self.cpus is not None else None
        d["cflags"] = list(self.cflags)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AttachOptions:
        """The options of a dict to_dict wrote, or an older version's: a missing key gets its
        default, an unknown one is left out. ValueError for a bad value."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def resolved(self, ifaces: list[str], default_cpus: list[int], fwd: str = "off"):
        """The options as attached to `ifaces`: the topology by their count when not given, the
        cpumap's CPUs (`default_cpus` when not given, sorted; none for rss) and the forwarding
        mode (`fwd` when not given)."""
        topology = self.topology or ("one-arm" if len(ifaces) == 1 else "switch")
        cpus = tuple(sorted(self.cpus or default_cpus)) if self.slot_cpus == "cpumap" else None
        return dataclasses.replace(
            self, topology=topology, cpus=cpus, forwarding=self.forwarding or fwd
        )
