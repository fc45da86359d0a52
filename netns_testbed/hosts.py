"""Host records of a testbed: what a test needs to know about each namespace.

Plain dataclasses so they serialise to the JSON state file and back unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


class _Record:
    """What every host record does: to the state file's JSON and back, field for field."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        return cls(**d)


@dataclass
class AggregatorHost(_Record):
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


@dataclass
class _SingleInterfaceHost(_Record):
    """A namespace with one interface (`ifname`, its address and MAC): a worker or an
    observer, named by its letter and index."""

    index: int
    netns: str
    ifname: str
    ip: str
    mac: str

    LETTER = ""  # a class constant, not a field: "w" for workers, "o" for observers

    @property
    def name(self) -> str:
        """Short host name understood by :meth:`Testbed.run` and the CLI."""
        return f"{self.LETTER}{self.index}"


@dataclass
class WorkerHost(_SingleInterfaceHost):
    """One worker namespace with its single interface ``eth0``.

    ``agg_ip`` is the aggregator address this worker sends to, ``agg_ifname``
    the aggregator-side interface the worker sits behind (``p<i>`` in switch,
    ``eth0`` in one-arm) and ``agg_mac`` that interface's MAC.
    """

    agg_ip: str
    agg_ifname: str
    agg_mac: str
    prefixlen: int = 24

    LETTER = "w"


@dataclass
class ObserverHost(_SingleInterfaceHost):
    """A host on the one-arm bridge that is in no job: namespace ``<prefix>o<i>``, ``eth0``.

    It runs nothing of its own; tests use it to see what a bystander on the segment receives
    (the results of a job it is not in: nothing, with per-job multicast groups and the bridge's
    IGMP snooping; everything, with the subnet broadcast).
    """

    prefixlen: int = 24

    LETTER = "o"
