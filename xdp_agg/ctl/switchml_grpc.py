"""p4app-switchML's controller API (gRPC services Session and Sync, xdp_agg/ctl/switchml.proto) in
front of a control endpoint's job registry, so that SwitchML's own hosts join jobs through
`xdp-agg serve --switchml-grpc HOST:PORT` unchanged. What the calls do is
xdp_agg.ctl.switchml_sessions'; this module serves them, bounded:

- who may call: every call's gRPC peer address must be in `SwitchmlSettings.allow` (serve's
  `--switchml-allow`, by default the subnets of the aggregator's interfaces, where p4app's hosts
  are), else PERMISSION_DENIED;
- how many calls at once: `calls` in all and `calls_per_peer` from one address; a call past
  either is refused at once (RESOURCE_EXHAUSTED, counted, saying what to do) instead of waiting
  for a Barrier to end. The server's threads (each call holds one, a Barrier for as long as it
  waits) are at most `calls` plus a few for those refusals (RESERVE); calls that come while
  every thread is taken queue for one (at most `backlog`), each refused by the admission as soon
  as a reserve thread takes it. gRPC's own limit of calls in flight (maximum_concurrent_rpcs,
  past which gRPC answers "Concurrent RPC limit exceeded!" itself) is above all of these,
  `calls` + RESERVE + `backlog`: the admission refuses first, and gRPC's limit is only a
  backstop against a flood faster than the reserve threads refuse it, whose refusals are
  counted too (CountGrpcRefusals); a thread with no call for `thread_idle` seconds ends, so
  the threads of a burst return;
- a caller that goes away (its connection closes, its call is cancelled) stops waiting at once;
- every refusal is counted by reason (SwitchmlApi.refusals, xdp_agg.app.metrics).

RdmaSession answers UNIMPLEMENTED (the XDP aggregator speaks UDP only).
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import threading
import time
import urllib.parse
from concurrent import futures

import grpc

from . import switchml_proto as pb
from .switchml_sessions import (  # noqa: F401  (this module's API too)
    AGG_PORT,
    DEFAULT_PORT,
    DEFAULT_WINDOW,
    ApiError,
    Caller,
    SwitchmlApi,
    SwitchmlSettings,
    mac_text,
    mac_value,
)

log = logging.getLogger(__name__)

RESERVE = 4  # threads beyond `calls`, for answering the calls refused past the bounds


def caller_of(peer: str, active=lambda: True) -> Caller:
    """The Caller of gRPC peer address `peer` ("ipv4:198.18.0.2:40112", "ipv6:%5B::1%5D:40112"
    as grpc 1.85 writes it, or with plain brackets; an IPv4 address mapped into IPv6 is its
    IPv4 address). ValueError for another kind (a Unix socket: the API listens on TCP only)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        raise ValueError(f"peer {peer!r} has no IP address")
    host, _, port = urllib.parse.unquote(rest).rpartition(":")
    ip = ipaddress.ip_address(host.strip("[]"))
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    conn = f"[{ip}]:{int(port)}" if ip.version == 6 else f"{ip}:{int(port)}"
    return Caller(str(ip), conn, active)


def allowed(host: str, networks) -> bool:
    """Whether address `host` is in one of `networks` (ipaddress networks)."""
    ip = ipaddress.ip_address(host)
    return any(ip.version == net.version and ip in net for net in networks)


class Admission:
    """Calls in progress, in all and per address, within `calls` and `per_peer`."""

    def __init__(self, calls: int, per_peer: int) -> None:
        self.calls, self.per_peer = calls, per_peer
        self._lock = threading.Lock()
        self._by_peer: collections.Counter = collections.Counter()
        self.active = 0

    def enter(self, host: str) -> None:
        """Count a call of `host` in; ApiError (peer_calls, calls) past a bound."""
        with self._lock:
            if self._by_peer[host] >= self.per_peer:
                raise ApiError(
                    "peer_calls",
                    f"{host} has {self._by_peer[host]} calls in progress, the most one address "
                    "may: a SwitchML rank makes one call at a time; end the others first",
                )
            if self.active >= self.calls:
                raise ApiError(
                    "calls",
                    f"the controller has {self.active} calls in progress, the most it takes: "
                    "try again when the waiting Barriers have ended",
                )
            self._by_peer[host] += 1
            self.active += 1

    def leave(self, host: str) -> None:
        with self._lock:
            self._by_peer[host] -= 1
            if not self._by_peer[host]:
                del self._by_peer[host]
            self.active -= 1


class IdlePool(futures.Executor):
    """A thread pool for the gRPC server: at most `size` threads, made as calls come, and a
    thread that has had no work for `idle` seconds ends (concurrent.futures' pool keeps every
    thread it made until shut down). Each idle thread keeps its own deadline: work wakes one
    waiting thread (`_cond`), and a thread that ends wakes only those that wait for the count
    of threads (`_ended`: wait_threads, shutdown), never the other idle ones, so each ends
    `idle` seconds after its last work, whatever the others do."""

    def __init__(self, size: int, idle: float, name: str = "sml") -> None:
        self.size, self.idle, self.name = size, idle, name
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # work queued, or shutdown
        self._ended = threading.Condition(lock)  # a thread ended
        self._queue: collections.deque = collections.deque()
        self._waiting = 0  # threads waiting for work
        self._shutdown = False
        self.threads = 0
        self._made = 0
        self.submitted = 0  # work items taken, ever

    def submit(self, fn, /, *args, **kwargs) -> futures.Future:
        future: futures.Future = futures.Future()
        with self._cond:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._queue.append((future, fn, args, kwargs))
            self.submitted += 1
            if self._waiting >= len(self._queue):
                self._cond.notify()
            elif self.threads < self.size:
                self.threads += 1
                self._made += 1
                name = f"{self.name}-{self._made}"
                threading.Thread(target=self._work, name=name, daemon=True).start()
        return future

    @property
    def backlog(self) -> int:
        """Calls queued for a thread now."""
        return len(self._queue)

    def _next(self):
        """The next work item, or None when this thread is to end (idle for `idle` seconds
        since its last work, or shut down)."""
        with self._cond:
            deadline = time.monotonic() + self.idle
            self._waiting += 1
            try:
                while not self._queue and not self._shutdown:
                    left = deadline - time.monotonic()
                    # woken without work (another thread took it): wait out what is left
                    if left <= 0 or not self._cond.wait(left):
                        break
                if self._queue:
                    return self._queue.popleft()
                self.threads -= 1
                self._ended.notify_all()
                return None
            finally:
                self._waiting -= 1

    def _work(self) -> None:
        while (item := self._next()) is not None:
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:
                future.set_exception(e)
            else:
                future.set_result(result)
            del item, future, fn, args, kwargs  # nothing of a call outlives it here

    def wait_threads(self, at_most: int, timeout: float) -> bool:
        """Wait until at most `at_most` threads are left (within `timeout` s); whether so."""
        with self._ended:
            return self._ended.wait_for(lambda: self.threads <= at_most, timeout)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more work; the threads end once the queue is done (cancel_futures: dropped)."""
        with self._cond:
            self._shutdown = True
            if cancel_futures:
                while self._queue:
                    self._queue.popleft()[0].cancel()
            self._cond.notify_all()
            if wait:
                self._ended.wait_for(lambda: self.threads == 0)


def _handler(api: SwitchmlApi, admission: Admission, fn, request_name: str, response_name: str):
    """A unary-unary gRPC handler calling fn(request, caller) -> response fields (dict), for a
    caller in the allowed networks and within the bounds of calls; an ApiError becomes its
    status, counted."""
    response_class = pb.message_class(response_name)

    def call(request, context):
        try:
            try:
                caller = caller_of(context.peer(), context.is_active)
            except ValueError as e:
                raise ApiError("not_allowed", str(e)) from None
            if not allowed(caller.host, api.settings.allow):
                nets = ", ".join(map(str, api.settings.allow)) or "none"
                raise ApiError(
                    "not_allowed",
                    f"{caller.host} may not call this controller (--switchml-allow: {nets}): "
                    "call from a SwitchML host's network, or ask for it to be allowed",
                )
            admission.enter(caller.host)
            try:
                context.add_callback(api.wake)  # a caller gone stops waiting at once
                return response_class(**fn(request, caller))
            finally:
                admission.leave(caller.host)
        except ApiError as e:
            api.refused(e)
            context.abort(e.code, str(e))

    return grpc.unary_unary_rpc_method_handler(
        call,
        request_deserializer=pb.message_class(request_name).FromString,
        response_serializer=response_class.SerializeToString,
    )


def _rdma_session(request, caller):
    raise ApiError(
        "unimplemented",
        "RdmaSession is not supported: xdp-agg aggregates SwitchML's UDP protocol only; "
        "run the hosts with the dpdk backend (UdpSession)",
    )


def handlers(api: SwitchmlApi, admission: Admission) -> list:
    """The generic handlers of services Session and Sync for a server."""

    def udp(req, caller):
        sid, mac, ipv4 = api.udp_session(req, caller)
        return {"session_id": sid, "mac": mac, "ipv4": ipv4}

    def barrier(req, caller):
        api.barrier(req.num_workers, caller)
        return {}

    def broadcast(req, caller):
        return {"value": api.broadcast(req, caller)}

    calls = {
        "Session": {"RdmaSession": _rdma_session, "UdpSession": udp},
        "Sync": {"Barrier": barrier, "Broadcast": broadcast},
    }
    return [
        grpc.method_handlers_generic_handler(
            f"{pb.PACKAGE}.{svc}",
            {m: _handler(api, admission, fn, *pb.SERVICES[svc][m]) for m, fn in methods.items()},
        )
        for svc, methods in calls.items()
    ]


class CountGrpcRefusals(grpc.GenericRpcHandler):
    """The generic handlers `inner`, counting the calls gRPC refuses itself past its own limit
    of calls in flight ("Concurrent RPC limit exceeded!"; reason grpc_limit), which never reach
    a handler. gRPC asks for a call's handler in its one polling thread before it checks that
    limit, and submits every call it takes to the pool in the same step (grpc/_server.py,
    _handle_call; grpcio 1.85): so a call whose handler was given and that the pool had not
    been given when the next call's handler is asked for was refused by gRPC, and is counted
    then (the last of a flood when the next call comes)."""

    def __init__(self, inner: list, api: SwitchmlApi, pool: IdlePool) -> None:
        self.inner, self.api, self.pool = inner, api, pool
        self._asked: int | None = None  # pool.submitted when the last handler was given

    def service(self, handler_call_details):
        """The call's handler from `inner` (None: no such method); counts the call before it
        if gRPC refused that one itself."""
        handler = next(
            (h for g in self.inner if (h := g.service(handler_call_details)) is not None), None
        )
        if handler is None:
            return None
        submitted = self.pool.submitted
        if self._asked == submitted:
            self.api.refused(
                ApiError(
                    "grpc_limit",
                    "gRPC refused a call itself past its limit of calls in flight",
                )
            )
        self._asked = submitted
        return handler


class SwitchmlServer:
    """The API served (start_server's): the gRPC server, its pool and bounds, and the thread
    that expires what outlives the barrier timeout (SwitchmlApi.sweep)."""

    def __init__(self, api: SwitchmlApi, server: grpc.Server, pool: IdlePool, admission) -> None:
        self.api, self.server, self.pool, self.admission = api, server, pool, admission
        self.port = 0
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, name="sml-sweep", daemon=True)

    def start(self) -> None:
        self.server.start()
        self._sweeper.start()

    def _sweep(self) -> None:
        while not self._stop.wait(self.api.sweep_interval()):
            try:
                self.api.sweep()
            except Exception:  # a failed sweep must not end expiry for good
                log.exception("expiring SwitchML sessions failed")

    def stop(self, grace: float | None = None) -> None:
        """Stop serving (calls in progress cancelled), the sweeper and the pool's threads."""
        self._stop.set()
        self.server.stop(grace).wait()
        self.api.wake()
        self.pool.shutdown(wait=False)

    def stats(self) -> dict:
        """SwitchmlApi.stats and the calls and threads in use now (xdp_agg.app.metrics)."""
        return {**self.api.stats(), "calls": self.admission.active, "threads": self.pool.threads}


def grpc_limit(settings: SwitchmlSettings) -> int:
    """gRPC's own limit of calls in flight (maximum_concurrent_rpcs): the calls in progress, the
    reserve threads that refuse the calls past them, and the backlog of calls queued for
    those threads."""
    return settings.calls + RESERVE + settings.backlog


def start_server(api: SwitchmlApi, host: str, port: int) -> SwitchmlServer:
    """The API served on host:port (port 0: any free one), started (its port in .port).
    OSError when the address cannot be bound."""
    s = api.settings
    admission = Admission(s.calls, s.calls_per_peer)
    pool = IdlePool(s.calls + RESERVE, s.thread_idle)
    server = grpc.server(
        pool,
        handlers=[CountGrpcRefusals(handlers(api, admission), api, pool)],
        # no SO_REUSEPORT (grpc's default): a second server on the same port must fail
        options=[("grpc.so_reuseport", 0)],
        # above the admission's bound and its queue, so that the admission (counted, saying
        # what to do) refuses first; gRPC's own refusal past it is counted as grpc_limit
        maximum_concurrent_rpcs=grpc_limit(s),
    )
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as e:  # grpc says "Failed to bind"
        raise OSError(f"cannot listen on {address}: {e}") from None
    if bound == 0:
        raise OSError(f"cannot listen on {address}: the address is taken or not ours")
    served = SwitchmlServer(api, server, pool, admission)
    served.port = bound
    served.start()
    return served
