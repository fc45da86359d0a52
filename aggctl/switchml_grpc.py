"""p4app-switchML's controller API (gRPC services Session and Sync, aggctl/switchml.proto) in
front of a control endpoint's job registry, so that SwitchML's own hosts join jobs through
`xdp-agg serve --switchml-grpc HOST:PORT` unchanged. A thin adapter: jobs and workers are made
with the registry's calls (aggctl.registry), as the JSON control protocol makes them.

What p4app's DPDK host does once at start (dev_root/client_lib/src/backends/dpdk/
dpdk_backend.cc lines 70-140 at b5c74a0): Broadcast of a session id from rank 0; rank 0 calls
UdpSession then Barrier, every other rank Barrier then UdpSession; then all call Barrier. Here:

- Broadcast and Barrier are generation counters in memory, as in p4app's controller
  (dev_root/controller/grpc_server.py lines 109-196), with a timeout: a barrier that does not
  fill within it fails for every rank waiting in it (DEADLINE_EXCEEDED) and ends the session's
  job if not every rank has registered;
- rank 0's UdpSession ends the previous session's job and creates the new one: aggregator port
  0xBEE0 and slots from 0 (p4app's hosts assume both; FAILED_PRECONDITION when another job has
  them), the size code from packet_size, the window from the serve options; every UdpSession
  registers its rank by the MAC and IPv4 it gives and returns at once (rank 0 calls it before
  the others pass the first barrier); the answer is our MAC and IPv4 on the worker's side;
- the barrier after the session's first is its last: there every rank must have registered,
  else it fails for all (FAILED_PRECONDITION, naming the ranks) and the job is ended;
- RdmaSession: UNIMPLEMENTED (the XDP aggregator speaks UDP only).
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc

from aggproto import wire
from aggproto.limits import MAX_WORKERS

from . import switchml_proto as pb
from .fields import RequestError

log = logging.getLogger(__name__)

DEFAULT_PORT = 50099  # p4app-switchML's controller listens here (grpc_server.py line 33)
AGG_PORT = 0xBEE0  # p4app's hosts send to it, hard-coded (dpdk_backend.cc line 136)
# p4app's hosts' default `backend.dpdk.worker_port` (client_lib/src/config.cc line 78): their
# thread t sends from it + t. Results go to each request's source port (docs/protocol.md), so
# this is only what the job table records for them.
P4APP_WORKER_PORT = 4000
# p4app's default max_outstanding_packets is 256 (config.cc line 50); thread t of T uses slots
# 2 * (256 / T) * t .. + 256 / T - 1, all below 512
DEFAULT_WINDOW = 512
HOLDER = -1_000_000  # who holds a session's job in the registry: no connection, the session


class ApiError(Exception):
    """A refusal, answered with a gRPC status code and a message that says what to do."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class SwitchmlSettings:
    """What the serve options give the API (p4app's requests carry none of it)."""

    window: int = DEFAULT_WINDOW  # slots of a session's job, from 0
    barrier_timeout: float = 120.0  # longest a Barrier or Broadcast waits for the others


def mac_text(value: int) -> str:
    """A 48-bit MAC as p4app sends it (most significant octet first) -> aa:bb:cc:dd:ee:ff."""
    return ":".join(f"{(value >> s) & 0xFF:02x}" for s in range(40, -8, -8))


def mac_value(text: str) -> int:
    """aa:bb:cc:dd:ee:ff -> the 48-bit integer p4app reads (dpdk_utils.cc lines 79-82)."""
    return int(text.replace(":", ""), 16)


@dataclass
class _Session:
    session_id: int
    key: str  # the job's name in the registry
    world: int
    size_code: int  # its packet_size
    first_barrier: int  # the Sync generation of the session's first barrier


@dataclass
class _Broadcast:
    world: int
    value: int | None = None
    seen: set[int] | None = None


class Sync:
    """Barrier and Broadcast: generation counters, as p4app's controller keeps them."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.generation = 0  # the barrier now filling
        self._arrived = 0
        self._outcome: dict[int, ApiError | None] = {}
        self._ops: list[_Broadcast] = []

    def barrier(self, world: int, timeout: float, on_complete, on_timeout) -> None:
        """Wait until `world` callers are in the barrier. The last runs on_complete(generation)
        (its ApiError or None is every caller's outcome); after `timeout` s the generation
        fails for every caller with on_timeout(generation, arrived), and open Broadcasts are
        dropped."""
        with self._cond:
            gen = self.generation
            self._arrived += 1
            if self._arrived >= world:
                self._close(gen, on_complete(gen))
            else:
                deadline = time.monotonic() + timeout
                while gen == self.generation and (left := deadline - time.monotonic()) > 0:
                    self._cond.wait(left)
                if gen == self.generation:
                    self._close(gen, on_timeout(gen, self._arrived))
                    # the run failed: a Broadcast a rank left open must not hand its value to
                    # the next run's ranks (p4app's controller resets both the same way)
                    self._ops.clear()
            err = self._outcome.get(gen)
        if err is not None:
            raise err

    def _close(self, gen: int, outcome: ApiError | None) -> None:
        self._outcome[gen] = outcome
        self._outcome.pop(gen - 64, None)  # every waiter of that one has long read it
        self.generation, self._arrived = gen + 1, 0
        self._cond.notify_all()

    def broadcast(self, value: int, rank: int, world: int, root: int, timeout: float) -> int:
        """The root's value, to every rank of the operation (each rank's first one it has not
        taken part in); DEADLINE_EXCEEDED when the root does not come within `timeout` s."""
        with self._cond:
            op = next((o for o in self._ops if rank not in o.seen), None)
            if op is None:
                op = _Broadcast(world, seen=set())
                self._ops.append(op)
            op.seen.add(rank)
            if rank == root:
                op.value = value
                self._cond.notify_all()
            deadline = time.monotonic() + timeout
            while op.value is None and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            if len(op.seen) >= op.world or op.value is None:
                self._ops = [o for o in self._ops if o is not op]
            if op.value is None:
                raise ApiError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"Broadcast: root rank {root} did not broadcast within {timeout:g} s "
                    f"(ranks here: {sorted(op.seen)} of {world}); start every worker",
                )
            return op.value


class SwitchmlApi:
    """The services' logic over a job registry (a ControlEndpoint's, aggctl.registry).
    `port_address(worker_ip)` is our (IPv4, MAC) on the worker's side (ValueError when no port
    of ours leads there)."""

    def __init__(
        self, registry, settings: SwitchmlSettings, port_address: Callable[[str], tuple[str, str]]
    ) -> None:
        self.registry = registry
        self.settings = settings
        self.port_address = port_address
        self.sync = Sync()
        self.events: Counter = Counter()  # what happened, by name (tests count these)
        self._lock = threading.Lock()
        self._session: _Session | None = None

    @property
    def session_key(self) -> str | None:
        """The registry's name of the current session's job (None: no session)."""
        s = self._session
        return s.key if s else None

    def udp_session(self, req) -> tuple[int, int, int]:
        """UdpSession: (session_id, our MAC, our IPv4) for the worker `req` describes."""
        world, rank = req.num_workers, req.rank
        if not 1 <= world <= MAX_WORKERS or rank >= world:
            raise ApiError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rank {rank} of {world} workers: a session has 1..{MAX_WORKERS} workers, "
                "ranks 0..num_workers-1",
            )
        if req.packet_size not in pb.PACKET_SIZES.values():
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"packet_size {req.packet_size}")
        ip = str(ipaddress.IPv4Address(req.ipv4))
        try:
            our_ip, our_mac = self.port_address(ip)
        except ValueError as e:
            raise ApiError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        with self._lock:
            session = self._open(req) if rank == 0 else self._current(req)
            try:
                self.registry.join_job(
                    HOLDER, session.key, rank, ip, P4APP_WORKER_PORT, mac_text(req.mac), (our_ip, 0)
                )
            except RequestError as e:
                if rank == 0:  # the session it just opened has no use without it
                    self._end(session)
                raise ApiError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
            self.events["ranks_registered"] += 1
        log.info("session %#x: rank %d of %d at %s", req.session_id, rank, world, ip)
        return req.session_id, mac_value(our_mac), int(ipaddress.IPv4Address(our_ip))

    def _open(self, req) -> _Session:
        """Rank 0: end the previous session's job, create this one's (lock held)."""
        if self._session is not None:
            if self.registry.end_job(self._session.key):
                self.events["sessions_replaced"] += 1
            self._session = None
        key = f"switchml-{req.session_id:#x}"
        elems = wire.elems_for(req.packet_size)
        try:
            self.registry.open_job(
                HOLDER,
                key,
                req.num_workers,
                elems,
                self.settings.window,
                P4APP_WORKER_PORT,
                port=AGG_PORT,
                base=0,
            )
        except RequestError as e:
            raise ApiError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        self._session = _Session(
            req.session_id, key, req.num_workers, req.packet_size, self.sync.generation
        )
        self.events["sessions_opened"] += 1
        return self._session

    def _current(self, req) -> _Session:
        s = self._session
        if s is None or s.session_id != req.session_id:
            now = f"the current one is {s.session_id:#x}" if s else "there is none"
            raise ApiError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"no session {req.session_id:#x} ({now}): rank 0 opens it with its UdpSession "
                "before the first Barrier; start rank 0 with the same controller",
            )
        if (req.num_workers, req.packet_size) != (s.world, s.size_code):
            raise ApiError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"num_workers {req.num_workers}, packet_size {req.packet_size}, but session "
                f"{s.session_id:#x} has {s.world} workers, packet_size {s.size_code}: start every "
                "worker with the same configuration",
            )
        return s

    def barrier(self, world: int) -> None:
        """Barrier of `world` callers; the session's last one checks that its job is whole."""
        self.sync.barrier(
            world, self.settings.barrier_timeout, self._barrier_done, self._barrier_timed_out
        )

    def _barrier_done(self, gen: int) -> ApiError | None:
        with self._lock:
            return self._check_last(gen)

    def _check_last(self, gen: int) -> ApiError | None:
        s = self._session
        if s is None or gen != s.first_barrier + 1:
            return None
        missing = self.registry.missing_ranks(s.key)
        if not missing:
            self.events["sessions_complete"] += 1
            return None
        self._end(s)
        return ApiError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"session {s.session_id:#x}: rank(s) {missing} passed the barriers without calling "
            "UdpSession; its job is ended: start the run again",
        )

    def _barrier_timed_out(self, gen: int, arrived: int) -> ApiError:
        with self._lock:
            return self._timed_out(arrived)

    def _timed_out(self, arrived: int) -> ApiError:
        self.events["barrier_timeouts"] += 1
        s = self._session
        what = ""
        if s is not None:
            missing = self.registry.missing_ranks(s.key)
            what = f"; session {s.session_id:#x}: rank(s) {missing} have not called UdpSession"
            if missing:
                self._end(s)
                what += ", its job is ended"
        return ApiError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"Barrier: {arrived} worker(s) arrived within {self.settings.barrier_timeout:g} s, "
            f"not all{what}; start every worker with the same controller",
        )

    def _end(self, s: _Session) -> None:
        self.registry.end_job(s.key)
        if self._session is s:
            self._session = None
        self.events["sessions_ended"] += 1

    def broadcast(self, req) -> int:
        """Broadcast: the root's value."""
        return self.sync.broadcast(
            req.value, req.rank, req.num_workers, req.root, self.settings.barrier_timeout
        )


def _handler(fn, request_name: str, response_name: str):
    """A unary-unary gRPC handler calling fn(request) -> response fields (dict); an ApiError
    becomes its status."""
    response_class = pb.message_class(response_name)

    def call(request, context):
        try:
            return response_class(**fn(request))
        except ApiError as e:
            context.abort(e.code, str(e))

    return grpc.unary_unary_rpc_method_handler(
        call,
        request_deserializer=pb.message_class(request_name).FromString,
        response_serializer=response_class.SerializeToString,
    )


def _rdma_session(request):
    raise ApiError(
        grpc.StatusCode.UNIMPLEMENTED,
        "RdmaSession is not supported: xdp-agg aggregates SwitchML's UDP protocol only; "
        "run the hosts with the dpdk backend (UdpSession)",
    )


def handlers(api: SwitchmlApi) -> list:
    """The generic handlers of services Session and Sync for a server."""

    def udp(req):
        sid, mac, ipv4 = api.udp_session(req)
        return {"session_id": sid, "mac": mac, "ipv4": ipv4}

    def barrier(req):
        api.barrier(req.num_workers)
        return {}

    calls = {
        "Session": {"RdmaSession": _rdma_session, "UdpSession": udp},
        "Sync": {"Barrier": barrier, "Broadcast": lambda req: {"value": api.broadcast(req)}},
    }
    return [
        grpc.method_handlers_generic_handler(
            f"{pb.PACKAGE}.{svc}",
            {m: _handler(fn, *pb.SERVICES[svc][m]) for m, fn in methods.items()},
        )
        for svc, methods in calls.items()
    ]


def start_server(api: SwitchmlApi, host: str, port: int) -> tuple[grpc.Server, int]:
    """The API served on host:port (port 0: any free one), started; the server and its port.
    OSError when the address cannot be bound."""
    # every rank of a session may block in a Barrier at once, and rank 0 in another call
    pool = futures.ThreadPoolExecutor(max_workers=2 * MAX_WORKERS + 4, thread_name_prefix="sml")
    # no SO_REUSEPORT (grpc's default): a second server on the same port must fail, not share it
    server = grpc.server(pool, handlers=handlers(api), options=[("grpc.so_reuseport", 0)])
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as e:  # grpc says "Failed to bind"
        raise OSError(f"cannot listen on {address}: {e}") from None
    if bound == 0:
        raise OSError(f"cannot listen on {address}: the address is taken or not ours")
    server.start()
    return server, bound
