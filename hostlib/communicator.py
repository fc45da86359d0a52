"""The API a training job uses: init() a Communicator, then allreduce() tensors.

    comm = hostlib.init(rank, world_size, "198.18.0.1:48800", "resnet-run-7")
    grads = comm.allreduce(grads)            # int32, float32, float16, bfloat16
    h = comm.allreduce_async(other); ...; other_sum = h.wait()
    comm.close()

Like torch.distributed's rendezvous, each worker gives its rank, the world size and where the
rendezvous is (here the aggregator's control endpoint). Rank 0 creates the job, every rank
registers, and all return together once every rank is there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import ipaddress
import socket
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from xdp_agg.proto import wire
from xdp_agg.proto.control import RECOVERY_COUNTERS
from xdp_agg.proto.jobs import JobDescription

from .control_link import ControlLink
from .diagnosis import explain_timeout
from .engine import DTYPES, Engine, EngineConfig, StreamEngine, _use_native
from .errors import AllreduceTimeout, HostlibError, RendezvousError
from .netinfo import mac_of, path_mtu_towards, source_ip_towards
from .options import HostOptions, auto_lanes, token_from_env
from .rendezvous import ControlClient, load_secret, parse_endpoint
from .sparsity import SparseChooser, check_sparse_arg
from .striping import LaneGrid, StripedEngine, lane_windows
from .udp_io import DatagramSocket

_FLOAT_16 = ("float16", "bfloat16")  # 16 bits on the wire unless an all-reduce says otherwise
_TOKEN_BYTES = 256  # room for a job token in Communicator._token_broadcast


def init(
    rank: int,
    world_size: int,
    control: str | Sequence[str],
    job: str = "default",
    options: HostOptions | None = None,
    *,
    token: str | None = None,
    on_token: Callable[[str], None] | None = None,
) -> Communicator:
    """Join job `job` as `rank` of `world_size` through the control endpoint `control`.

    control: "HOST:PORT" of the control endpoint (xdp-agg serve); or, to stripe the job over
        k aggregators, k of them: a list, or one string "HOST:PORT,HOST:PORT" (the form the
        environment's XDP_AGG_CONTROL takes). The job is then created and joined on each, and
        every all-reduce is split into k stripes that run at once, one per aggregator
        (hostlib.striping); every rank must list the same endpoints in the same order.
    job: the job's name; all ranks of one run use the same, and no other live run may.
    options: how to join and run (HostOptions: elems, window, timeout, ip, ...); default
        HostOptions.from_env(), the defaults with what the XDP_AGG_* environment sets.
    token: the job's token, for a rank without the secret (rank 0's launcher passes
        Communicator.token on); default $XDP_AGG_JOB_TOKEN.
    on_token: rank 0 only: called with the job's token as soon as the job exists, before the
        barrier, so a launcher can hand it to the other ranks (hostlib.pt puts it in the store).

    Raises RendezvousError with the control endpoint's explanation if the job cannot be made
    or joined (name in use, ranks missing at the barrier, ...), its AuthError when the
    credentials are missing or wrong, ValueError on bad arguments.
    """
    opts = HostOptions.from_env() if options is None else options
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    endpoints = parse_controls(control)
    # the job's token at the first aggregator (striped, the others need the secret: a token is
    # one aggregator's, made when rank 0 creates the job there)
    return _init(
        _Start(rank, world_size, endpoints, job, opts), token or token_from_env(), on_token
    )


@dataclasses.dataclass(frozen=True)
class _Start:
    """What init() was given, resolved: how a Communicator joined its job, and how it joins a
    companion job of another element width (Communicator._companion) the same way."""

    rank: int
    world_size: int
    endpoints: list[tuple[str, int]]
    job: str
    opts: HostOptions
    wire_bits: int = 32  # the job's element width (JobSpec.wire_bits), in rank 0's create


def _init(
    start: _Start,
    token: str | None,
    on_token: Callable[[str], None] | None,
    created: Callable[[str], object] | None = None,
) -> Communicator:
    """init() of `start`, with the job's `token` (or None); `created`: rank 0 only, called
    right after the job was created with its token ("" without one), before the barrier."""
    rank, world_size, endpoints, job, opts = (
        start.rank,
        start.world_size,
        start.endpoints,
        start.job,
        start.opts,
    )
    secret = load_secret(opts.secret_file)
    joined: list[_Joined] = []
    ctls: list[ControlClient] = []
    lanes = _rank_lanes(opts, rank)  # None: the job's, as rank 0 made it
    try:
        with contextlib.ExitStack() as undo:  # on an error: what was opened, closed
            for j, endpoint in enumerate(endpoints):
                # the token is the first aggregator's (above)
                ctls.append(_connect(endpoint, job, opts.ip, secret, None if j else token))
                undo.callback(ctls[-1].close)
            size = _packet_size(opts, ctls) if rank == 0 else None
            for j, ctl in enumerate(ctls):
                host, port_ = ctl.endpoint
                where = f" on aggregator {j} ({host}:{port_})" if len(ctls) > 1 else ""
                place = _Place(
                    rank, world_size, job, size.elems if size else 0, where, start.wire_bits
                )
                # every lane at every aggregator sends from (and gets results on) its own port
                port = LaneGrid(len(ctls), lanes or 1).port(opts.port, j) if opts.port else 0
                hooks = (on_token, created) if j == 0 else (None, None)
                joined.append(_join_one(place, opts, ctl, port, hooks, lanes))
                undo.callback(joined[-1].ctl.close)
                undo.callback(_close_all, joined[-1].socks)
                lanes = len(joined[-1].socks)  # the job's, at every aggregator
            undo.pop_all()
    except RendezvousError as e:
        if len(endpoints) > 1:  # say which aggregator refused
            j = len(joined) if len(ctls) == len(endpoints) else len(ctls)
            host, port_ = endpoints[j]
            raise type(e)(f"aggregator {j} ({host}:{port_}): {e}") from None
        raise
    grid = LaneGrid(len(joined), len(joined[0].socks))
    engines = [
        _engine(joined[j], opts, grid.index(j, lane), lane, grid.lanes) for j, lane in grid.cells()
    ]
    first = joined[0]
    engine = engines[0] if len(engines) == 1 else StripedEngine(engines, endpoints, grid.lanes)
    size = size or PacketSize(first.desc.spec.elems, "the job's, as rank 0 made it")
    return Communicator(rank, job, engine, joined, size, start)


@dataclasses.dataclass(frozen=True)
class PacketSize:
    """The job's int32 per packet and why (comm.stats "elems" and "elems_reason")."""

    elems: int
    reason: str


def _packet_size(opts: HostOptions, ctls: list[ControlClient]) -> PacketSize:
    """Rank 0's packet size: the one given, or for elems="auto" the most that both the path
    MTU towards every endpoint and every aggregator allow (its `ping` answer's sizes)."""
    if isinstance(opts.elems, int):  # else "auto" (HostOptions checks)
        return PacketSize(opts.elems, "given")
    mtu = min(path_mtu_towards(*c.endpoint) for c in ctls)
    fits = [n for n in sorted(wire.SIZE_CODE_ELEMS.values()) if n <= wire.elems_for_mtu(mtu)]
    reason = f"auto: the path MTU {mtu} carries up to {fits[-1]}"
    for j, ctl in enumerate(ctls):
        # the sizes the aggregator takes; an endpoint older than this answer does not say
        allowed = set(ctl.request("ping").get("elems") or fits)
        if fits[-1] not in allowed:
            fits = [n for n in fits if n in allowed] or fits[:1]
            name = f"aggregator {j}" if len(ctls) > 1 else "the aggregator"
            reason += f"; {name} takes up to {max(allowed)}"
    return PacketSize(fits[-1], reason)


def _rank_lanes(opts: HostOptions, rank: int) -> int | None:
    """This rank's lanes: as given; for "auto" rank 0's choice (options.auto_lanes), and None
    on the other ranks, which take the job's (JobDescription.lanes, rank 0's)."""
    if isinstance(opts.lanes, int):  # else "auto" (HostOptions checks)
        return opts.lanes
    if rank != 0:
        return None
    return auto_lanes(opts, _use_native(opts.native))


def _engine(x: _Joined, opts: HostOptions, i: int, lane: int, lanes: int) -> StreamEngine:
    """The stream engine number `i` (LaneGrid.index; 0 unless striped or in lanes), lane `lane`
    of the `lanes` at the aggregator `x` joined."""
    desc = x.desc
    slot_base, window = lane_windows(desc.spec.slot_base, desc.window, lanes)[lane]
    cfg = EngineConfig(
        job_id=desc.spec.job_id,
        # float scaling's n: every worker under the root of a two-level tree (JobSpec
        # total_workers), else the job's own ranks
        scaling_workers=desc.spec.total_workers or desc.world_size,
        elems=desc.spec.elems,
        slot_base=slot_base,
        window=window,
        data_address=desc.send_to,
        rto=opts.retransmit,
        early_loss=opts.early_loss,
        timeout=opts.timeout,
        progress=opts.progress and i == 0,
        native=opts.native,
        cwnd=opts.cwnd,
        data_path=opts.data_path,
        spin=opts.spin,
        lane=lane,
        lanes=lanes,
        pad_empty=desc.spec.pad_empty,
        wire_bits=desc.spec.wire_bits,
    )
    faults = opts.faults
    if faults is not None and i:  # independent losses per engine
        faults = dataclasses.replace(faults, seed=faults.seed + i)
    return StreamEngine(x.socks[lane], cfg, faults)


@dataclasses.dataclass
class _Joined:
    """A rank's place at one aggregator: the job there, its control link, the data socket of
    each lane (lane 0's is the one registered, on the job's worker_port; lane l's is on
    worker_port + l) and each socket's multicast membership (or None)."""

    desc: JobDescription
    ctl: ControlLink
    socks: list[DatagramSocket]
    memberships: list[bytes | None]


@dataclasses.dataclass(frozen=True)
class _Place:
    """Where one rank joins at one aggregator: rank of world_size in job `job`; elems: rank 0's
    packet size (0 on the other ranks, which adopt the job's); where: " on aggregator j (...)"
    when striped, for the messages; wire_bits: the element width rank 0 creates the job with."""

    rank: int
    world_size: int
    job: str
    elems: int
    where: str
    wire_bits: int = 32


def parse_controls(control: str | Sequence[str]) -> list[tuple[str, int]]:
    """init's `control`: "HOST:PORT", "HOST:PORT,HOST:PORT,..." or a sequence of "HOST:PORT"
    -> the control endpoints, in stripe order. Raises ValueError on an empty or repeated one."""
    items = control.split(",") if isinstance(control, str) else list(control)
    endpoints = [parse_endpoint(str(a).strip()) for a in items]
    if not endpoints or any(not h for h, _ in endpoints):
        raise ValueError(f"control must name at least one control endpoint, got {control!r}")
    if len(set(endpoints)) != len(endpoints):
        raise ValueError(f"a control endpoint is named twice in {control!r}")
    return endpoints


def _connect(
    endpoint: tuple[str, int], job: str, ip: str | None, secret: bytes | None, token: str | None
) -> ControlClient:
    """The control connection to `endpoint`, from `ip` when pinned, with the credentials."""
    return ControlClient(
        endpoint,
        timeout=30.0,
        source_ip=ip,
        secret=secret,
        tokens={job: token} if token else None,
    )


def _join_one(
    place: _Place,
    opts: HostOptions,
    ctl: ControlClient,
    port: int,
    hooks: tuple[Callable[[str], None] | None, Callable[[str], object] | None],
    lanes: int | None,
) -> _Joined:
    """Create (rank 0) or find the job at one control endpoint (`ctl`, connected) and register
    there with `lanes` lanes (None: the job's); returns the job's description, the control link
    (kept open: closing it leaves), the lanes' data sockets and their group memberships.
    `hooks`: rank 0's (on_token, created), called after the job was created (init, _init)."""
    on_token, created = hooks
    pinned = opts.ip is not None
    my_ip = opts.ip if opts.ip is not None else source_ip_towards(*ctl.endpoint)
    bind_ip = my_ip if pinned else "0.0.0.0"
    job, wait, offload = place.job, opts.rendezvous_timeout, dict(gso=opts.gso, gro=opts.gro)
    with contextlib.ExitStack() as undo:  # on an error, the sockets closed (init closes ctl)
        if place.rank == 0:
            if lanes is None:  # _rank_lanes decides rank 0's; only the others adopt the job's
                raise ValueError("rank 0 must know its lanes to create the job")
            lane_windows(0, opts.window, lanes)  # ValueError: fewer slots than lanes
            socks = _bind_lanes(bind_ip, port, lanes, offload)
            undo.callback(_close_all, socks)
            desc = ctl.job(
                "create",
                job=job,
                world_size=place.world_size,
                elems=place.elems,
                window=opts.window,
                worker_port=socks[0].address[1],
                lanes=lanes,
                # an endpoint older than 16-bit jobs never sees the field for a 32-bit one
                **({"wire_bits": place.wire_bits} if place.wire_bits != 32 else {}),
            )
            if on_token is not None and job in ctl.tokens:
                on_token(ctl.tokens[job])
            if created is not None:
                created(ctl.tokens.get(job, ""))
        else:
            desc = ctl.job("status", job=job, wait=wait, reply_timeout=wait + 5)
            _check_world(desc, place)
            lanes = lanes or desc.lanes
            lane_windows(0, desc.window, lanes)  # ValueError: fewer slots than lanes
            socks = _worker_sockets(bind_ip, desc, place, lanes, offload)
            undo.callback(_close_all, socks)
        memberships = [_join_group(s, desc.group, my_ip, pinned) for s in socks]
        desc = ctl.job(
            "register",
            job=job,
            rank=place.rank,
            port=socks[0].address[1],
            ip=my_ip,
            mac=opts.mac or mac_of(my_ip),
            timeout=wait,
            reply_timeout=wait + 5,
            # the endpoint refuses a rank whose lanes differ from the job's (absent: 1)
            **({"lanes": len(socks)} if len(socks) > 1 else {}),
        )
        undo.pop_all()
    # from here on the control connection survives a restart of the endpoint (control_link)
    link = ControlLink(
        ctl,
        job=job,
        rank=place.rank,
        ip=my_ip,
        port=socks[0].address[1],
        source_ip=my_ip if pinned else None,
    )
    return _Joined(desc, link, socks, memberships)


def _check_world(desc: JobDescription, place: _Place) -> None:
    if desc.spec.wire_bits != place.wire_bits:
        raise RendezvousError(
            f"job {place.job!r}{place.where} is a {desc.spec.wire_bits}-bit job, this rank "
            f"wants {place.wire_bits} bits (a job of that name made by another run?)"
        )
    if desc.world_size != place.world_size:
        raise ValueError(
            f"job {place.job!r}{place.where} has world_size {desc.world_size}, this rank was "
            f"started with {place.world_size}"
        )


# how many port bases rank 0 tries for its lanes' consecutive ports when none was given
_LANE_PORT_TRIES = 32


class _PortTaken(Exception):
    """A port of a run of lane ports could not be bound: which, and the OSError."""

    def __init__(self, port: int, error: OSError) -> None:
        super().__init__(port, error)
        self.port, self.error = port, error


def _bind_run(
    bind_ip: str, base: int, lanes: int, offload: dict[str, bool]
) -> list[DatagramSocket]:
    """Sockets on the consecutive UDP ports base .. base + lanes - 1 (base 0: lane 0's on a port
    the kernel picks, the others after it). On a port that cannot be bound, closes the sockets
    it bound and raises _PortTaken."""
    socks: list[DatagramSocket] = []
    with contextlib.ExitStack() as undo:  # on an error, the sockets bound so far closed
        for lane in range(lanes):
            port = socks[0].address[1] + lane if socks else base
            try:
                socks.append(DatagramSocket((bind_ip, port), **offload))
            except OSError as e:
                raise _PortTaken(port, e) from None
            undo.callback(socks[-1].close)
        undo.pop_all()
    return socks


def _close_all(socks: list[DatagramSocket]) -> None:
    """Close each of `socks` (an error's rollback)."""
    for s in socks:
        s.close()


def _bind_lanes(
    bind_ip: str, port: int, lanes: int, offload: dict[str, bool]
) -> list[DatagramSocket]:
    """Rank 0's data sockets, one per lane, on the consecutive ports port .. port + lanes - 1
    (port 0: a free base the kernel picks, tried again while the ports after it are taken).
    Every lane of every worker sends from, and gets its results on, the same port: the
    one-arm topology sends a result once, to the group at the completing request's port."""
    for _ in range(_LANE_PORT_TRIES if port == 0 else 1):
        try:
            return _bind_run(bind_ip, port, lanes, offload)
        except _PortTaken as e:
            if e.port == port:  # lane 0's own port: the socket's error as it is
                raise e.error from None
            if port:
                raise HostlibError(
                    f"{e.error.strerror}: lanes={lanes} needs the UDP ports {port}.."
                    f"{port + lanes - 1} free here; give port= a base whose next {lanes} ports "
                    f"are free"
                ) from None
    raise HostlibError(f"found no {lanes} consecutive free UDP ports in {_LANE_PORT_TRIES} tries")


def _worker_sockets(
    bind_ip: str, desc: JobDescription, place: _Place, lanes: int, offload: dict[str, bool]
) -> list[DatagramSocket]:
    """A rank's data sockets on the ports rank 0 chose: the job's worker_port + lane."""
    try:
        return _bind_run(bind_ip, desc.worker_port, lanes, offload)
    except _PortTaken as e:
        chose = (
            f"ports rank 0 chose, {desc.worker_port}..{desc.worker_port + lanes - 1} (one per "
            f"lane), and {e.port} is taken here"
            if lanes > 1
            else f"port rank 0 chose, {e.port}, and it is taken here"
        )
        raise HostlibError(
            f"{e.error.strerror}: every worker of job {place.job!r}{place.where} listens on the "
            f"UDP {chose}; start rank 0 with port= set to a port free on every host (two workers "
            f"on one host also need distinct ip= addresses)"
        ) from None


# IP_MULTICAST_ALL (linux/in.h; not in Python's socket module before 3.12 on every build)
_IP_MULTICAST_ALL = getattr(socket, "IP_MULTICAST_ALL", 49)


def _join_group(
    sock: DatagramSocket, group: tuple[str, int] | None, my_ip: str, pinned: bool
) -> bytes | None:
    """Make the data socket receive results sent to the job's group address, if it has one.
    Returns the ip_mreq of a multicast group joined (Communicator.close leaves it), or None."""
    if not group:
        return None
    addr = ipaddress.IPv4Address(group[0])
    if pinned:
        # Linux delivers broadcast and multicast only to sockets bound to 0.0.0.0 (or the group)
        raise ValueError(
            f"the job sends results to the group {group[0]}:{group[1]}, which a data socket bound "
            f"to {my_ip} does not receive: leave ip= unset so that it binds 0.0.0.0"
        )
    if not addr.is_multicast:
        return None  # a subnet broadcast: a socket bound to 0.0.0.0 receives it as it is
    # Joining makes the kernel report the membership (IGMP) at once, so a snooping switch
    # forwards the group to this port before the first result: every rank joins before it
    # registers, and the barrier opens only after the last one has.
    mreq = socket.inet_aton(group[0]) + socket.inet_aton(my_ip)
    sock.sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
    # Only the groups this socket joined: by default Linux hands a socket bound to 0.0.0.0:port
    # every group any socket of the host joined, so a second job's results to the same port
    # would reach it.
    sock.sock.setsockopt(socket.IPPROTO_IP, _IP_MULTICAST_ALL, 0)
    return mreq


class AllreduceHandle:
    """An all-reduce in progress (from Communicator.allreduce_async)."""

    def __init__(self, future: Future[np.ndarray]) -> None:
        self._future = future

    def done(self) -> bool:
        """True once the all-reduce finished or failed."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> np.ndarray:
        """The result; raises the all-reduce's error, or TimeoutError if it is not done within
        `timeout` seconds (it then goes on; wait again later)."""
        return self._future.result(timeout)


class Communicator:
    """A worker's membership in an aggregation job. Make it with hostlib.init().

    All-reduces run one at a time, in the order they were called (the same order on every
    rank is required, as with any collective). A blocking allreduce() with nothing queued runs
    in the calling thread (no hand-over to another thread and back, which costs tens of
    microseconds per call); allreduce_async() and calls made while others are queued run on
    one background thread, in order.
    """

    def __init__(
        self,
        rank: int,
        job: str,
        engine: Engine,
        joined: list[_Joined],
        size: PacketSize,
        start: _Start | None = None,
    ) -> None:
        """(hostlib.init makes it) `joined`: this rank's place at each aggregator (_Joined), in
        stripe order; `engine` runs the all-reduces over their data sockets; `start`: how it
        joined (None: it cannot join a companion job of another width)."""
        first = joined[0]
        self.rank = rank
        self.job = job
        self.description: JobDescription = first.desc  # the job as the control endpoint said
        self.world_size = first.desc.world_size
        self._engine = engine
        self._size = size
        self.descriptions: tuple[JobDescription, ...] = tuple(x.desc for x in joined)
        # dense or sparse, per all-reduce, the same on every rank (docs/protocol.md 8.5)
        self._chooser = SparseChooser(
            all(d.spec.sparse for d in self.descriptions), first.desc.spec.elems_per_packet
        )
        # A job has one element width: an all-reduce at the other one runs on a companion job,
        # joined on first use (_for_width) and held until close.
        self._start = start
        self._wire_bits = first.desc.spec.wire_bits
        self._companions: dict[int, Communicator] = {}
        # the width of the last all-reduce (the job's before the first: a number, as the
        # other stats, for callers that take differences of every entry that is not a string)
        self._last_bits = self._wire_bits
        self._ctls = [x.ctl for x in joined]
        for j, ctl in enumerate(self._ctls):  # each ping tells its endpoint our loss recovery
            ctl.report = functools.partial(self._recovery, j)
        # every lane's data socket at every aggregator, and the ip_mreq of each socket's
        # multicast group if it joined one (close leaves them)
        self._socks = [s for x in joined for s in x.socks]
        self._memberships: list[bytes | None] = [m for x in joined for m in x.memberships]
        self._ctl = self._ctls[0]
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hostlib-r{rank}")
        self._lock = threading.Lock()  # guards _closed, _queued, _inline
        self._engine_lock = threading.Lock()  # held while the engine runs an all-reduce
        self._queued = 0  # all-reduces handed to the executor and not finished yet
        self._inline = False  # an all-reduce runs in a caller's thread
        self._closed = False
        self._broken: str | None = None

    @property
    def token(self) -> str | None:
        """This job's token (from create, from status with the secret, or as given): what a
        launcher hands to ranks that do not hold the deployment secret."""
        return self._ctl.tokens.get(self.job)

    # --- all-reduce -------------------------------------------------------------------------
    def allreduce(
        self,
        array: npt.ArrayLike,
        out: np.ndarray | None = None,
        *,
        inplace: bool = False,
        timeout: float | None = None,
        sparse: bool | str = "auto",
        wire_bits: int | None = None,
    ) -> np.ndarray:
        """Sum `array` over all ranks; returns the sum (a new array, `out`, or `array` itself).

        int32 sums are exact and wrap modulo 2^32 like the aggregator's; float32, bfloat16 and
        float16 sums are block scaled (error bound in hostlib.scaling), quantised from and into
        the array's own type. Any shape and length; every rank must pass the same length.
        `timeout` overrides the communicator's stall timeout for this call.

        `wire_bits`: the width of an element on the wire, 32 or 16 (two elements a 32-bit word,
        half the packets, an error bound about 2^16 times larger: scaling.error_bound). None
        (the default) means 16 for bfloat16 and float16 arrays and 32 for float32 and int32;
        16 for float32 is the compressed option; int32 is exact only at 32 bits (ValueError at
        16). A job has one width, so the first all-reduce at the other one joins a companion
        job (`job` + "~w16") through the same control endpoints on every rank: every rank must
        pass the same width, as the same length.

        `sparse`: True sends only the blocks (packets' worth of elements) that are non-zero on
        this rank, and the blocks zero on every rank do not travel at all (a sparse job only:
        docs/protocol.md section 8); False sends every block; "auto" (the default) runs sparse
        on a sparse job unless the previous all-reduce of this dtype and length came back
        mostly non-zero (hostlib.sparsity). The sums are the same either way, byte for byte.
        Every rank must pass the same `sparse`.
        """
        arrays = _AllreduceArrays.prepare(array, out, inplace, sparse, wire_bits)
        self._chooser.check(sparse)
        with self._lock:
            if self._closed:
                raise HostlibError("the communicator is closed")
            if self._queued or self._inline:  # behind others: keep the order, on the executor
                handle = self._submit(arrays, timeout)
            else:
                handle = None
                self._inline = True
        if handle is not None:
            return handle.wait()
        try:
            with self._engine_lock:
                return self._run(arrays, timeout)
        finally:
            with self._lock:
                self._inline = False

    def allreduce_async(
        self,
        array: npt.ArrayLike,
        out: np.ndarray | None = None,
        *,
        inplace: bool = False,
        timeout: float | None = None,
        sparse: bool | str = "auto",
        wire_bits: int | None = None,
    ) -> AllreduceHandle:
        """Start an all-reduce (arguments as allreduce()); returns a handle with wait(timeout)
        and done().

        Do not modify `array` (or read `out`) until the handle is done.
        """
        arrays = _AllreduceArrays.prepare(array, out, inplace, sparse, wire_bits)
        self._chooser.check(sparse)
        with self._lock:
            if self._closed:
                raise HostlibError("the communicator is closed")
            return self._submit(arrays, timeout)

    def _submit(self, arrays: _AllreduceArrays, timeout: float | None) -> AllreduceHandle:
        """Queue an all-reduce on the executor (with self._lock held)."""
        self._queued += 1
        return AllreduceHandle(self._executor.submit(self._run_queued, arrays, timeout))

    def _run_queued(self, arrays: _AllreduceArrays, timeout: float | None) -> np.ndarray:
        try:
            with self._engine_lock:  # after an all-reduce running inline, if any
                return self._run(arrays, timeout)
        finally:
            with self._lock:
                self._queued -= 1

    def barrier(self, timeout: float | None = None) -> None:
        """Return once every rank has reached its barrier (a dense all-reduce of one int32)."""
        self.allreduce(np.zeros(1, dtype=np.int32), timeout=timeout, sparse=False)

    def _run(self, arrays: _AllreduceArrays, timeout: float | None) -> np.ndarray:
        if self._broken:
            raise HostlibError(
                f"the communicator is unusable after an earlier failure ({self._broken}); "
                f"close it, and init again on every rank"
            )
        try:
            target = self._for_width(arrays.wire_bits)
        except AllreduceTimeout as e:  # the companion's token round this job stalled
            self._broken = "an all-reduce timed out"
            raise self._explain(e) from None
        self._last_bits = arrays.wire_bits
        engine, chooser = target._engine, target._chooser
        started = engine.counter
        kind, size = arrays.kind, arrays.src.size
        sparse = chooser.choose(arrays.sparse, kind, size)
        try:
            engine.allreduce(arrays.src, arrays.dst_flat, timeout, sparse)
            if arrays.sparse == "auto" and chooser.job_sparse:
                chooser.observe(kind, size, arrays.dst_flat, engine.last_union)
        except AllreduceTimeout as e:
            # The ranks' slot states now differ: another all-reduce would only time out again.
            self._broken = "an all-reduce timed out"
            raise target._explain(e) from None
        except BaseException as e:
            if engine.counter != started:  # failed half-way (not a rejected input)
                self._broken = f"an all-reduce failed: {e!r}"
            raise
        return arrays.finish()

    def _for_width(self, bits: int) -> Communicator:
        """What runs an all-reduce at element width `bits`: this communicator's job, or its
        companion job of that width, joined now if this is the first such all-reduce."""
        if bits == self._wire_bits:
            return self
        companion = self._companions.get(bits)
        if companion is None:
            companion = self._companions[bits] = self._companion(bits)
        return companion

    def _companion(self, bits: int) -> Communicator:
        """Join the companion job of width `bits`, `job` + "~w16", as this job was joined (the
        same endpoints, options, data path, packet size and lanes; ports the kernel picks). Every
        rank gets here at the same all-reduce. Rank 0 creates it and hands its token to the others
        in an all-reduce of this job, so that ranks holding only this job's token join too."""
        st = self._start
        if st is None or self._wire_bits != 32:
            raise HostlibError(
                f"job {self.job!r} runs {self._wire_bits}-bit all-reduces only: this communicator "
                f"was not made by hostlib.init, so it cannot join a {bits}-bit companion job"
            )
        # AF_XDP: the companion's sockets join this job's on the interface queue (one UMEM and
        # redirect program a queue, each socket's port in its maps: hostlib/_xsk.c)
        opts = dataclasses.replace(st.opts, elems=self._size.elems, lanes=self.lanes, port=0)
        start = dataclasses.replace(st, job=f"{self.job}~w{bits}", opts=opts, wire_bits=bits)
        if self.rank == 0:
            return _init(start, None, None, created=self._token_broadcast)
        return _init(start, self._token_broadcast("") or None, None)

    def _token_broadcast(self, token: str) -> str:
        """Rank 0's `token` on every rank: a dense int32 all-reduce of its bytes on this job
        (the other ranks add zeros)."""
        buf = np.zeros(_TOKEN_BYTES, np.int32)
        if self.rank == 0:
            raw = np.frombuffer(token.encode()[:_TOKEN_BYTES], np.uint8)
            buf[: raw.size] = raw
        out = np.empty_like(buf)
        self._engine.allreduce(buf, out, None, False)
        return out.astype(np.uint8).tobytes().rstrip(b"\0").decode(errors="replace")

    def _explain(self, e: AllreduceTimeout) -> AllreduceTimeout:
        """Add the control endpoint's view (absent and lagging ranks) to a timeout."""
        ctl = self._ctls[e.stripe or 0]  # striped: the stalled aggregator's endpoint
        try:
            d = ctl.request("diagnose", job=self.job, reply_timeout=3.0)
        except RendezvousError as err:
            return e.with_diagnosis(f"Could not ask the control endpoint: {err}", None)
        me = self._my_address(e.stripe or 0)
        return e.with_diagnosis(explain_timeout(d, self.rank, me, e.packets), d)

    def _my_address(self, stripe: int = 0) -> str:
        workers = self.descriptions[stripe].workers
        me = next((w for w in workers if w["rank"] == self.rank), None)
        return f"{me['ip']}:{me['port']}" if me else "?"

    # --- info -------------------------------------------------------------------------------
    @property
    def timeout(self) -> float:
        """Seconds an all-reduce may go without progress before AllreduceTimeout."""
        return self._engine.timeout

    @property
    def stats(self) -> dict[str, Any]:
        """Counters of this communicator (see hostlib.engine.STAT_NAMES), as a new dict, and
        "data_path" (StreamEngine.data_path), "data_path_reason", "elems" (the job's int32
        words per packet), "elems_reason" (why: given, the path MTU and the aggregator's sizes
        for elems="auto", or rank 0's choice), "lanes" (at each aggregator) and "wire_bits"
        (the element width of the last all-reduce: 32 or 16; the job's, 32, before the first). The
        counters add up this job's and its companion jobs' (Communicator.allreduce wire_bits);
        rtt, cwnd and the data path are those of the job the last all-reduce ran on (a 16-bit
        companion runs over AF_XDP where this job does, or says why not: _companion)."""
        st = dict(self._engine.stats)
        for c in self._companions.values():
            st = _summed(st, c._engine.stats)
        last = self._companions.get(self._last_bits, self)
        st.update(rtt=last._engine.stats["rtt"], cwnd=last._engine.stats["cwnd"])
        return {
            **st,
            "wire_bits": self._last_bits,
            "data_path": last._engine.data_path,
            "data_path_reason": last._engine.data_path_reason,
            "elems": self._size.elems,
            "elems_reason": self._size.reason,
            "lanes": self.lanes,
        }

    @property
    def lanes(self) -> int:
        """The lanes each all-reduce runs on at each aggregator (HostOptions.lanes, resolved)."""
        return self._engine.lanes

    @property
    def controls(self) -> list[str]:
        """The control endpoints of this job's aggregators, "HOST:PORT", in stripe order (one
        unless the job is striped)."""
        return [f"{c.endpoint[0]}:{c.endpoint[1]}" for c in self._ctls]

    def stats_per_aggregator(self) -> list[dict[str, Any]]:
        """Per aggregator (in stripe order) its stripe's counters, as `stats` has them, plus
        "control": its control endpoint. One entry unless striped. The counters add up this
        job's and its companion jobs' at that aggregator (they stripe alike); rtt and cwnd are
        this job's."""
        per = self._engine.stats_per_aggregator()
        for c in self._companions.values():
            per = [_summed(a, b) for a, b in zip(per, c._engine.stats_per_aggregator())]
        return [{"control": a, **st} for a, st in zip(self.controls, per)]

    def _recovery(self, stripe: int) -> dict[str, int]:
        """This job's loss recovery counters at aggregator `stripe` (RECOVERY_COUNTERS),
        for its control endpoint's view of the job (its companions report their own)."""
        st = self._engine.stats_per_aggregator()[stripe]
        return {k: int(st.get(k, 0)) for k in RECOVERY_COUNTERS}

    def stats_per_lane(self) -> list[dict[str, Any]]:
        """Per lane, in engine order (hostlib.striping.LaneGrid: aggregator by aggregator), its
        own counters (hostlib.engine.STAT_NAMES) and "aggregator", "lane" and "port" (its data
        socket's UDP port; this job's). One entry without lanes and striping. The counters add
        up this job's and its companion jobs' on that lane, as stats_per_aggregator's."""
        per = self._engine.stats_per_lane()
        for c in self._companions.values():
            per = [_summed(a, b) for a, b in zip(per, c._engine.stats_per_lane())]
        return per

    def status(self, stripe: int = 0) -> dict[str, Any]:
        """The control endpoint's `diagnose` answer for this job (ranks, per-worker counters);
        striped, that of aggregator number `stripe`."""
        return self._ctls[stripe].request("diagnose", job=self.job, reply_timeout=5.0)

    # --- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Finish queued all-reduces, leave the job, release the sockets. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._executor.shutdown(wait=True)
        with self._engine_lock:  # an all-reduce running inline in another thread finishes first
            pass
        for companion in self._companions.values():
            companion.close()  # leaves the companion jobs
        self._engine.close()
        for ctl in self._ctls:
            try:
                ctl.request("leave", job=self.job, rank=self.rank, reply_timeout=5.0)
            except RendezvousError:
                pass  # closing the connection below counts as leaving too
            ctl.close()
        for sock, mreq in zip(self._socks, self._memberships):
            if mreq is not None:
                # Leave the group explicitly (closing the socket would too): the switch stops
                # forwarding the job's group to this port once no member is left behind it.
                try:
                    sock.sock.setsockopt(socket.IPPROTO_IP, socket.IP_DROP_MEMBERSHIP, mreq)
                except OSError:
                    pass  # the interface went away: the kernel dropped the membership with it
        self._memberships = [None] * len(self._socks)
        for sock in self._socks:
            sock.close()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _AllreduceArrays:
    """One all-reduce's arrays: validated and flattened, in the caller's own dtype (the loops
    quantise from it and dequantise into it), and the element width it goes at."""

    def __init__(
        self,
        kind: str,
        src: np.ndarray,
        dst_flat: np.ndarray,
        result: np.ndarray,
        convert_back: np.ndarray | None,
        sparse: bool | str = "auto",
        wire_bits: int = 32,
    ) -> None:
        self.kind, self.src, self.dst_flat = kind, src, dst_flat
        self.result, self.convert_back = result, convert_back
        self.sparse = sparse  # as the caller gave it: True, False, "auto"
        self.wire_bits = wire_bits

    @classmethod
    def prepare(
        cls,
        array: npt.ArrayLike,
        out: np.ndarray | None,
        inplace: bool,
        sparse: bool | str = "auto",
        wire_bits: int | None = None,
    ) -> _AllreduceArrays:
        check_sparse_arg(sparse)
        arrays = cls._prepare(array, out, inplace)
        arrays.sparse = sparse
        arrays.wire_bits = _width(arrays.kind, wire_bits)
        return arrays

    @classmethod
    def _prepare(
        cls, array: npt.ArrayLike, out: np.ndarray | None, inplace: bool
    ) -> _AllreduceArrays:
        if inplace:
            if out is not None:
                raise ValueError("give either out= or inplace=True, not both")
            if not isinstance(array, np.ndarray):
                raise TypeError("inplace=True needs a numpy array")
            out = array
        a = np.asarray(array)
        name = a.dtype.name
        if name not in DTYPES:
            raise TypeError(
                f"allreduce supports int32, float32, float16 and bfloat16 arrays, not {a.dtype}; "
                f"convert first (e.g. float64 -> float32)"
            )
        if out is None:
            out = np.empty(a.shape, dtype=a.dtype)
        elif not isinstance(out, np.ndarray) or out.dtype != a.dtype or out.shape != a.shape:
            raise ValueError(f"out must be a numpy array of dtype {a.dtype} and shape {a.shape}")
        if not out.flags.writeable:
            raise ValueError("the output array is read-only")
        src = np.ascontiguousarray(a).reshape(-1)  # a view when already so
        if out.flags.c_contiguous:
            return cls(name, src, out.reshape(-1), out, None)
        # a non-contiguous output: the sums into a flat one, copied back at the end
        return cls(name, src, np.empty(a.size, dtype=a.dtype), out, out)

    def finish(self) -> np.ndarray:
        if self.convert_back is not None:
            self.convert_back[...] = self.dst_flat.reshape(self.result.shape)
        return self.result


_GAUGES = ("rtt", "cwnd", "aggregator", "lane", "port")  # not counters: never added up


def _summed(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """a, its counters (the numbers but _GAUGES) plus b's; everything else a's."""
    return {
        k: v + b[k]
        if k in b and k not in _GAUGES and isinstance(v, int | float) and not isinstance(v, bool)
        else v
        for k, v in a.items()
    }


def _width(kind: str, wire_bits: int | None) -> int:
    """The element width of an all-reduce of dtype `kind` asked for as `wire_bits` (None: 16
    for the 16-bit float types, else 32); ValueError for one the wire has not or int32 at 16."""
    if wire_bits is None:
        return 16 if kind in _FLOAT_16 else 32
    if isinstance(wire_bits, bool) or wire_bits not in wire.WIRE_BITS:
        raise ValueError(f"wire_bits must be 32, 16 or None, not {wire_bits!r}")
    if kind == "int32" and wire_bits == 16:
        raise ValueError(
            "int32 is exact only at 32 bits: all-reduce int32 arrays with wire_bits=32 (or None)"
        )
    return wire_bits
