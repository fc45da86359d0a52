"""Host records of a testbed: what a test needs to know about each namespace.

Plain dataclasses so they serialise to the JSON state file and back unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class AggregatorHost:
    """The aggregator's namespace.

    ``ifnames[k]``, ``ips[k]`` and ``macs[k]`` describe the same interface:
    one ``eth0`` in one-arm, ``p0..pN-1`` (one per worker) in switch.
    ``index`` is its number among a testbed's aggregators (0 unless several).
    """

    netns: str
    ifnames: list[str] = field(default_factory=list)
    ips: list[str] = field(default_factory=list)
    macs: list[str] = field(default_factory=list)
    prefixlen: int = 24
    index: int = 0

    @property
    def name(self) -> str:
        """Short host name understood by :meth:`Testbed.run` and the CLI: ``agg``, then
        ``agg1``, ``agg2``... for further aggregators."""
        return "agg" if self.index == 0 else f"agg{self.index}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> AggregatorHost:
        return cls(**d)


@dataclass
class WorkerHost:
    """One worker namespace with its single interface ``eth0``.

    ``agg_ip`` is the aggregator address this worker sends to, ``agg_ifname``
    the aggregator-side interface the worker sits behind (``p<i>`` in switch,
    ``eth0`` in one-arm) and ``agg_mac`` that interface's MAC.
    """

    index: int
    netns: str
    ifname: str
    ip: str
    mac: str
    agg_ip: str
    agg_ifname: str
    agg_mac: str
    prefixlen: int = 24

    @property
    def name(self) -> str:
        """Short host name understood by :meth:`Testbed.run` and the CLI."""
        return f"w{self.index}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> WorkerHost:
        return cls(**d)


@dataclass
class ObserverHost:
    """A host on the one-arm bridge that is in no job: namespace ``<prefix>o<i>``, ``eth0``.

    It runs nothing of its own; tests use it to see what a bystander on the segment receives
    (the results of a job it is not in: nothing, with per-job multicast groups and the bridge's
    IGMP snooping; everything, with the subnet broadcast).
    """

    index: int
    netns: str
    ifname: str
    ip: str
    mac: str
    prefixlen: int = 24

    @property
    def name(self) -> str:
        """Short host name understood by :meth:`Testbed.run` and the CLI."""
        return f"o{self.index}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ObserverHost:
        return cls(**d)
