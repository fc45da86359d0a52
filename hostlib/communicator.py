"""The API a training job uses: init() a Communicator, then allreduce() tensors.

    comm = hostlib.init(rank, world_size, aggregator="198.18.0.1:48800", job="resnet-run-7")
    grads = comm.allreduce(grads)            # int32, float32, float16, bfloat16
    h = comm.allreduce_async(other); ...; other_sum = h.wait()
    comm.close()

Like torch.distributed's rendezvous, each worker gives its rank, the world size and where the
rendezvous is (here the aggregator's control endpoint). Rank 0 creates the job, every rank
registers, and all return together once every rank is there.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from aggproto import control, wire
from aggproto.jobs import JobDescription

from .control_link import ControlLink
from .diagnosis import gone_notes
from .engine import EngineConfig, Faults, StreamEngine
from .errors import AllreduceTimeout, HostlibError, RendezvousError
from .netinfo import mac_of, path_mtu_towards, source_ip_towards
from .rendezvous import ControlClient, load_secret, parse_endpoint
from .striping import StripedEngine
from .udp_io import DatagramSocket

_FLOAT_16 = ("float16", "bfloat16")  # up-converted to float32 on the way in


def init(
    rank: int,
    world_size: int,
    aggregator,
    job: str = "default",
    elems: int | str = 256,
    window: int = 64,
    timeout: float = 30.0,
    *,
    ip: str | None = None,
    port: int = 0,
    mac: str | None = None,
    rendezvous_timeout: float = 120.0,
    retransmit: float = 0.015,
    progress: bool = False,
    faults: Faults | None = None,
    gso: bool = True,
    gro: bool = True,
    native: bool | None = None,
    cwnd: str = "aimd",
    data_path: str | None = None,
    secret_file: str | None = None,
    token: str | None = None,
    on_token: Callable[[str], None] | None = None,
) -> "Communicator":
    """Join job `job` as `rank` of `world_size` through the control endpoint `aggregator`.

    aggregator: "HOST:PORT" of the control endpoint (xdp-agg serve); or, to stripe the job over
        k aggregators, k of them: a list, or one string "HOST:PORT,HOST:PORT" (the form the
        environment's XDP_AGG_CONTROL takes). The job is then created and joined on each, and
        every all-reduce is split into k stripes that run at once, one per aggregator
        (hostlib.striping); every rank must list the same aggregators in the same order.
    job: the job's name; all ranks of one run use the same, and no other live run may.
    elems, window: int32 per packet (32, 64, 128, 256, 512, 768, 1024 or 2048) and slots per
        worker; rank 0's values make the job, the other ranks adopt them. elems="auto": the most
        that fits the path MTU towards the control endpoint(s) (wire.elems_for_mtu: 256 at MTU
        1500, 2048 at 9000; 1024 and 2048 need an aggregator attached with --frags).
    timeout: seconds an all-reduce may go without progress before AllreduceTimeout.
    ip: the address the aggregator knows this worker by. By default the source address the
        kernel picks towards the control endpoint, with the data socket bound to 0.0.0.0 so it
        also receives results sent to a group (broadcast or multicast) address. Give it to pin
        the source address when one host runs several workers (as the loopback tests do); the
        data socket is then bound to it and can receive unicast results only.
    port: UDP port of the data socket. Rank 0 binds it (0: any free port) and the job fixes it
        for every rank, because in one-arm mode the result goes once to group:port. Striped,
        aggregator j's socket gets port + j (or any free port when port is 0).
    mac: this worker's MAC (switch mode); by default that of the interface holding `ip`.
    rendezvous_timeout: how long to wait for rank 0's job and for all ranks to register.
    retransmit: least retransmission timer in seconds; the timer follows the measured round
        trip above it, and doubles at each expiry of the same packet (capped at 0.25 s).
    progress: show a progress line on stderr for all-reduces that take over a second.
    faults: test hook, seeded random loss/duplication inside the engine (engine.Faults).
    gso, gro: allow UDP GSO/GRO (each falls back to plain datagrams by itself if refused).
    native: run all-reduces in the C loop (hostlib._fastpath); None: when it is built and the
        environment does not say XDP_AGG_NATIVE=0; False: the numpy reference loop.
    cwnd: the C loop's congestion window: "aimd" (adapts to loss) or "fixed" (the window).
    data_path: how the C loop's packets travel (hostlib.afxdp): "udp" (the kernel socket),
        "auto" (an AF_XDP socket where one can run, else the kernel socket: stats says which
        and why) or "afxdp" (an AF_XDP socket or an error); None: $XDP_AGG_DATA_PATH, or "udp".
    secret_file: the deployment secret (the file `xdp-agg serve` uses, mode 0600); default
        $XDP_AGG_SECRET_FILE. Rank 0 needs it to create the job; another rank needs it or
        `token`.
    token: the job's token, for a rank without the secret (rank 0's launcher passes
        Communicator.token on); default $XDP_AGG_JOB_TOKEN.
    on_token: rank 0 only: called with the job's token as soon as the job exists, before the
        barrier, so a launcher can hand it to the other ranks (hostlib.pt puts it in the store).

    Raises RendezvousError with the control endpoint's explanation if the job cannot be made
    or joined (name in use, ranks missing at the barrier, ...), its AuthError when the
    credentials are missing or wrong, ValueError on bad arguments.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    endpoints = parse_aggregators(aggregator)
    if elems == "auto":
        elems = min(wire.elems_for_mtu(path_mtu_towards(*e)) for e in endpoints)
    wire.size_code_for(elems)
    if window < 1:
        raise ValueError("window must be at least 1")
    secret = load_secret(secret_file)
    # the job's token at the first aggregator (striped, the others need the secret: a token is
    # one aggregator's, made when rank 0 creates the job there)
    token = token or os.environ.get(control.TOKEN_ENV) or None
    joined: list[_Joined] = []
    try:
        link = dict(ip=ip, mac=mac, wait=rendezvous_timeout, gso=gso, gro=gro, secret=secret)
        for j, endpoint in enumerate(endpoints):
            first = j == 0  # the token is the first aggregator's (above)
            where = (
                f" on aggregator {j} ({endpoint[0]}:{endpoint[1]})" if len(endpoints) > 1 else ""
            )
            one = (rank, world_size, endpoint, job, elems, window)
            joined.append(
                _join_one(
                    *one,
                    port=port + j if port else 0,
                    token=token if first else None,
                    on_token=on_token if first else None,
                    where=where,
                    **link,
                )
            )
    except BaseException as e:
        for x in joined:
            x.sock.close()
            x.ctl.close()
        if isinstance(e, RendezvousError) and len(endpoints) > 1:  # say which aggregator refused
            host, port_ = endpoints[len(joined)]
            raise type(e)(f"aggregator {len(joined)} ({host}:{port_}): {e}") from None
        raise
    engines = []
    for j, x in enumerate(joined):
        desc = x.desc
        cfg = EngineConfig(
            job_id=desc.spec.job_id,
            # float scaling's n: every worker under the root of a two-level tree (JobSpec
            # total_workers), else the job's own ranks
            world_size=desc.spec.total_workers or desc.world_size,
            elems=desc.spec.elems,
            slot_base=desc.spec.slot_base,
            window=desc.window,
            aggregator=desc.send_to,
            rto=retransmit,
            timeout=timeout,
            progress=progress and j == 0,
            native=native,
            cwnd=cwnd,
            data_path=data_path,
        )
        stripe_faults = faults
        if faults is not None and j:  # independent losses per stripe
            stripe_faults = dataclasses.replace(faults, seed=faults.seed + j)
        engines.append(StreamEngine(x.sock, cfg, stripe_faults))
    first = joined[0]
    engine = engines[0] if len(joined) == 1 else StripedEngine(engines, endpoints)
    return Communicator(
        rank,
        job,
        first.desc,
        first.ctl,
        first.sock,
        engine,
        membership=first.membership,
        stripes=joined[1:],
    )


@dataclasses.dataclass
class _Joined:
    """A rank's place at one aggregator: the job there, its control link, data socket and the
    multicast membership of that socket (or None)."""

    desc: JobDescription
    ctl: "ControlLink"
    sock: DatagramSocket
    membership: bytes | None


def parse_aggregators(aggregator) -> list[tuple[str, int]]:
    """init's `aggregator`: "HOST:PORT", "HOST:PORT,HOST:PORT,..." or a sequence of "HOST:PORT"
    -> the control endpoints, in stripe order. Raises ValueError on an empty or repeated one."""
    items = aggregator.split(",") if isinstance(aggregator, str) else list(aggregator)
    endpoints = [parse_endpoint(str(a).strip()) for a in items]
    if not endpoints or any(not h for h, _ in endpoints):
        raise ValueError(f"aggregator must name at least one control endpoint, got {aggregator!r}")
    if len(set(endpoints)) != len(endpoints):
        raise ValueError(f"an aggregator is named twice in {aggregator!r}")
    return endpoints


def _join_one(
    rank,
    world_size,
    endpoint,
    job,
    elems,
    window,
    *,
    ip,
    port,
    mac,
    wait,
    gso,
    gro,
    secret,
    token,
    on_token,
    where,
) -> _Joined:
    """Create (rank 0) or find the job at one control endpoint and register there; returns the
    job's description, the control link (kept open: closing it leaves), the data socket and
    its group membership."""
    pinned = ip is not None
    my_ip = ip if pinned else source_ip_towards(*endpoint)
    bind_ip = my_ip if pinned else "0.0.0.0"
    ctl = ControlClient(
        endpoint,
        timeout=30.0,
        source_ip=my_ip if pinned else None,
        secret=secret,
        tokens={job: token} if token else None,
    )
    sock = None
    try:
        if rank == 0:
            sock = DatagramSocket((bind_ip, port), gso=gso, gro=gro)
            desc = ctl.job(
                "create",
                job=job,
                world_size=world_size,
                elems=elems,
                window=window,
                worker_port=sock.address[1],
            )
            if on_token is not None and job in ctl.tokens:
                on_token(ctl.tokens[job])
        else:
            desc = ctl.job("status", job=job, wait=wait, reply_timeout=wait + 5)
            if desc.world_size != world_size:
                raise ValueError(
                    f"job {job!r}{where} has world_size {desc.world_size}, this rank was started "
                    f"with {world_size}"
                )
            try:
                sock = DatagramSocket((bind_ip, desc.worker_port), gso=gso, gro=gro)
            except OSError as e:
                raise HostlibError(
                    f"{e.strerror}: every worker of job {job!r}{where} listens on the UDP port "
                    f"rank 0 chose, {desc.worker_port}, and it is taken here; start rank 0 with "
                    f"port= set to a port free on every host (two workers on one host also need "
                    f"distinct ip= addresses)"
                ) from None
        membership = _join_group(sock, desc.group, my_ip, pinned)
        desc = ctl.job(
            "register",
            job=job,
            rank=rank,
            port=sock.address[1],
            ip=my_ip,
            mac=mac or mac_of(my_ip),
            timeout=wait,
            reply_timeout=wait + 5,
        )
    except BaseException:
        if sock is not None:
            sock.close()
        ctl.close()
        raise
    # from here on the control connection survives a restart of the endpoint (control_link)
    link = ControlLink(
        ctl,
        job=job,
        rank=rank,
        ip=my_ip,
        port=sock.address[1],
        source_ip=my_ip if pinned else None,
    )
    return _Joined(desc, link, sock, membership)


# IP_MULTICAST_ALL (linux/in.h; not in Python's socket module before 3.12 on every build)
_IP_MULTICAST_ALL = getattr(socket, "IP_MULTICAST_ALL", 49)


def _join_group(sock: DatagramSocket, group, my_ip: str, pinned: bool) -> bytes | None:
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

    def __init__(self, future: Future) -> None:
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
        rank,
        job,
        desc,
        ctl: ControlLink,
        sock: DatagramSocket,
        engine,
        *,
        membership: bytes | None = None,
        stripes=(),
    ):
        self.rank = rank
        self.job = job
        self.description: JobDescription = desc  # the job as the control endpoint described it
        self.world_size = desc.world_size
        self._ctl = ctl
        self._sock = sock
        self._engine: StreamEngine | StripedEngine = engine
        # striped over several aggregators: (description, connection, data socket) of each after
        # the first; the first is the one above
        # striped: the other aggregators' places (_Joined), in stripe order after the first
        self.descriptions: tuple[JobDescription, ...] = (desc, *(x.desc for x in stripes))
        self._ctls = [ctl, *(x.ctl for x in stripes)]
        self._socks = [sock, *(x.sock for x in stripes)]
        # the ip_mreq of each socket's multicast group, if it joined one (close leaves them)
        self._memberships = [membership, *(x.membership for x in stripes)]
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
    def allreduce(self, array, out=None, *, inplace: bool = False, timeout: float | None = None):
        """Sum `array` over all ranks; returns the sum (a new array, `out`, or `array` itself).

        int32 sums are exact and wrap modulo 2^32 like the aggregator's; float32 sums are block
        scaled (error bound in hostlib.scaling); float16 and bfloat16 go through float32. Any
        shape and length; every rank must pass the same length. `timeout` overrides the
        communicator's stall timeout for this call.
        """
        job = _AllreduceArrays.prepare(array, out, inplace)
        with self._lock:
            if self._closed:
                raise HostlibError("the communicator is closed")
            if self._queued or self._inline:  # behind others: keep the order, on the executor
                handle = self._submit(job, timeout)
            else:
                handle = None
                self._inline = True
        if handle is not None:
            return handle.wait()
        try:
            with self._engine_lock:
                return self._run(job, timeout)
        finally:
            with self._lock:
                self._inline = False

    def allreduce_async(
        self, array, out=None, *, inplace: bool = False, timeout: float | None = None
    ) -> AllreduceHandle:
        """Start an all-reduce; returns a handle with wait(timeout) and done().

        Do not modify `array` (or read `out`) until the handle is done.
        """
        job = _AllreduceArrays.prepare(array, out, inplace)
        with self._lock:
            if self._closed:
                raise HostlibError("the communicator is closed")
            return self._submit(job, timeout)

    def _submit(self, job: "_AllreduceArrays", timeout: float | None) -> AllreduceHandle:
        """Queue an all-reduce on the executor (with self._lock held)."""
        self._queued += 1
        return AllreduceHandle(self._executor.submit(self._run_queued, job, timeout))

    def _run_queued(self, job: "_AllreduceArrays", timeout: float | None):
        try:
            with self._engine_lock:  # after an all-reduce running inline, if any
                return self._run(job, timeout)
        finally:
            with self._lock:
                self._queued -= 1

    def barrier(self, timeout: float | None = None) -> None:
        """Return once every rank has reached its barrier (an all-reduce of one int32)."""
        self.allreduce(np.zeros(1, dtype=np.int32), timeout=timeout)

    def _run(self, job: "_AllreduceArrays", timeout: float | None):
        if self._broken:
            raise HostlibError(
                f"the communicator is unusable after an earlier failure ({self._broken}); "
                f"close it, and init again on every rank"
            )
        started = self._engine.counter
        try:
            if job.kind == "int32":
                self._engine.allreduce_int32(job.src, job.dst_flat, timeout)
            else:
                self._engine.allreduce_float32(job.src, job.dst_flat, timeout)
        except AllreduceTimeout as e:
            # The ranks' slot states now differ: another all-reduce would only time out again.
            self._broken = "an all-reduce timed out"
            raise self._explain(e) from None
        except BaseException as e:
            if self._engine.counter != started:  # failed half-way (not a rejected input)
                self._broken = f"an all-reduce failed: {e!r}"
            raise
        return job.finish()

    def _explain(self, e: AllreduceTimeout) -> AllreduceTimeout:
        """Add the control endpoint's view (absent and lagging ranks) to a timeout."""
        ctl = self._ctls[e.stripe or 0]  # striped: the stalled aggregator's endpoint
        try:
            d = ctl.request("diagnose", job=self.job, reply_timeout=3.0)
        except RendezvousError as err:
            return e.with_diagnosis(f"Could not ask the control endpoint: {err}", None)
        notes = []
        if d.get("lost"):  # the cause: what the ranks did afterwards says nothing more
            note = f"the aggregator lost this job: {d['lost']}; no sum can come; start the run "
            return e.with_diagnosis(f"Control endpoint: {note}again (every rank).", d)
        if d.get("missing"):
            notes.append(f"rank(s) {_join(d['missing'])} never registered")
        gone = gone_notes(d)
        notes += gone
        if d.get("left") and not gone:
            notes.append(f"rank(s) {_join(d['left'])} left the job or lost their connection")
        counters = d.get("counters") or {}
        mine = counters.get(str(self.rank), {}).get("contributions")
        lagging = {int(r): c for r, c in (d.get("lagging") or {}).items() if int(r) != self.rank}
        if lagging:
            top = d.get("most_contributions", 0)
            notes.append(
                "lagging: "
                + ", ".join(f"rank {r} ({c} contributions)" for r, c in sorted(lagging.items()))
                + f" reached the aggregator, the most advanced rank {top}"
            )
        if mine == 0 and e.packets:
            notes.append(
                "the aggregator counted no contribution from this rank "
                f"({self._my_address(e.stripe or 0)}): "
                "it does not receive this worker's packets or does not know its address"
            )
        if not notes and "counters" not in d:
            notes.append(
                "every rank is registered; the aggregator offers no per-worker counters, so an "
                "idle rank cannot be told apart from an aggregator that does not answer"
            )
        elif not notes:
            notes.append("every rank is registered and none is behind in contributions")
        return e.with_diagnosis("Control endpoint: " + "; ".join(notes) + ".", d)

    def _my_address(self, stripe: int = 0) -> str:
        workers = self.descriptions[stripe].workers
        me = next((w for w in workers if w["rank"] == self.rank), None)
        return f"{me['ip']}:{me['port']}" if me else "?"

    # --- info -------------------------------------------------------------------------------
    @property
    def timeout(self) -> float:
        """Seconds an all-reduce may go without progress before AllreduceTimeout (init's)."""
        return self._engine.cfg.timeout

    @property
    def stats(self) -> dict:
        """Counters of this communicator (see hostlib.engine.STAT_NAMES), as a new dict, and
        two strings: "data_path" (StreamEngine.data_path) and "data_path_reason"."""
        return {
            **self._engine.stats,
            "data_path": self._engine.data_path,
            "data_path_reason": self._engine.data_path_reason,
        }

    @property
    def aggregators(self) -> list[str]:
        """The control endpoints of this job's aggregators, "HOST:PORT", in stripe order (one
        unless the job is striped)."""
        return [f"{c.endpoint[0]}:{c.endpoint[1]}" for c in self._ctls]

    def stats_per_aggregator(self) -> list[dict]:
        """Per aggregator (in stripe order) its stripe's counters, as `stats` has them, plus
        "aggregator": its control endpoint. One entry, equal to `stats`, unless striped."""
        per = (
            self._engine.stats_per_aggregator()
            if isinstance(self._engine, StripedEngine)
            else [dict(self._engine.stats)]
        )
        return [{"aggregator": a, **st} for a, st in zip(self.aggregators, per)]

    def status(self, aggregator: int = 0) -> dict:
        """The control endpoint's `diagnose` answer for this job (ranks, per-worker counters);
        striped, that of aggregator number `aggregator`."""
        return self._ctls[aggregator].request("diagnose", job=self.job, reply_timeout=5.0)

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
        if isinstance(self._engine, StripedEngine):
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

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _AllreduceArrays:
    """One all-reduce's arrays: validated, flattened, float types up-converted."""

    def __init__(self, kind, src, dst_flat, result, convert_back):
        self.kind, self.src, self.dst_flat = kind, src, dst_flat
        self.result, self.convert_back = result, convert_back

    @classmethod
    def prepare(cls, array, out, inplace: bool) -> "_AllreduceArrays":
        if inplace:
            if out is not None:
                raise ValueError("give either out= or inplace=True, not both")
            if not isinstance(array, np.ndarray):
                raise TypeError("inplace=True needs a numpy array")
            out = array
        a = np.asarray(array)
        name = a.dtype.name
        if name == "int32":
            kind, work = "int32", np.int32
        elif name == "float32" or name in _FLOAT_16:
            kind, work = "float32", np.float32
        else:
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
        src = np.ascontiguousarray(a, dtype=work).reshape(-1)  # a view when already so
        if out.dtype == work and out.flags.c_contiguous:
            return cls(kind, src, out.reshape(-1), out, None)
        # a float16/bfloat16 or non-contiguous output: work in float32/int32, copy back at end
        return cls(kind, src, np.empty(a.size, dtype=work), out, out)

    def finish(self) -> np.ndarray:
        if self.convert_back is not None:
            self.convert_back[...] = self.dst_flat.reshape(self.result.shape).astype(
                self.result.dtype
            )
        return self.result


def _join(ranks) -> str:
    return ", ".join(str(r) for r in ranks)
