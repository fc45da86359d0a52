"""SwitchML sessions: what p4app-switchML's controller API (xdp_agg.ctl.switchml_grpc serves it over
gRPC) does with its hosts' calls, over a control endpoint's job registry (xdp_agg.ctl.registry).

What p4app's DPDK host does once at start (dev_root/client_lib/src/backends/dpdk/
dpdk_backend.cc lines 70-140 at b5c74a0): rank 0 picks a session id and every rank calls
Broadcast(value, rank, num_workers, root=0); rank 0 calls UdpSession then Barrier, every other
rank Barrier then UdpSession; then all call Barrier. Each process makes its calls on one gRPC
channel (one GrpcClient, client_lib/src/grpc_client.cc lines 99-107), so on one connection:
the caller (`Caller`) is that connection, known by the peer address gRPC gives (address and
port), and the address alone is its host. p4app's messages carry no session id in Barrier and
Broadcast and no credentials anywhere; what ties a call to a session here is its connection.

- **UdpSession** registers the rank by the MAC and IPv4 it gives (refused unless the MAC is a
  host's: below 2^48, not a group, not zero) and ties the caller's connection to the rank.
  Rank 0's opens the session: a job on aggregator port 0xBEE0 and slots from 0, as p4app's
  hosts assume. A session that holds them is replaced only by a rank 0 calling from one of its
  hosts (the next run of the same hosts), by anyone once its job has had no traffic for
  `idle_takeover` seconds (on a target that counts it), or once its setup has expired;
  otherwise the new one is refused (FAILED_PRECONDITION, `session_busy`), so a stranger cannot
  end a running session.
- **Barrier**: a session's barriers count only its callers. A connection that registered a
  rank takes part in the session's barriers in order (its first Barrier is the session's
  first, its second the second); a connection that has not is taken for a rank other than 0
  before its UdpSession, whose Barrier is the session's first: it waits until a session of
  that many workers is being set up, and passes when the first barrier fills. A stranger's
  Barrier can at most be counted there, where every rank passes anyway: the session's second
  barrier, its last, counts only connections that registered its ranks, so it fills exactly
  when every rank has registered. A Barrier of one worker before any UdpSession is refused (a
  session of one has no such rank), as is a second one from a connection that passed the
  first without its UdpSession. A barrier that does not fill within `barrier_timeout` fails for
  every rank waiting in it (DEADLINE_EXCEEDED) and ends a session still being set up.
- **Broadcast** is p4app's one use of it, the session id before UdpSession. The root's value is
  answered at once and kept (one per host, at most `open_broadcasts`, each for
  `barrier_timeout`); it reaches the other ranks only once the root's connection has opened a
  session with it (rank 0's UdpSession with that id): then each other rank's Broadcast of that
  many workers and that root is answered with it while the session is set up. A value that no
  session takes expires and never reaches anyone; a Broadcast from a connection that has
  registered is refused.
- **Expiry**: a session whose setup has not completed `barrier_timeout` seconds after its last
  setup call, nobody waiting in its barriers, is ended (`sweep`, run by a thread of the server),
  freeing its port and slots; a complete session lives, as before, until a next one replaces it.
- **After a restart** the registry recovers a session's job (the table keeps its hosts) and
  frees it after the rejoin timeout; until then a rank 0 from one of its hosts replaces it, and
  another's is refused (`session_busy`) saying when it is freed (`_replace_recovered`).

Every refusal is an ApiError with a `reason` (REFUSALS) that the server counts, and says what
to do. docs/protocol.md 7.3 and docs/operations.md (trust model) describe the same.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from xdp_agg.proto import wire
from xdp_agg.proto.limits import MAX_WORKERS

from . import switchml_proto as pb
from .backend import JobCounters, WorkerCounters
from .fields import RequestError
from .registry import SESSION

log = logging.getLogger("xdp_agg.ctl.switchml_grpc")

DEFAULT_PORT = 50099  # p4app-switchML's controller listens here (grpc_server.py line 33)
AGG_PORT = 0xBEE0  # p4app's hosts send to it, hard-coded (dpdk_backend.cc line 136)
# p4app's hosts' default `backend.dpdk.worker_port` (client_lib/src/config.cc line 78): their
# thread t sends from it + t. Results go to each request's source port (docs/protocol.md), so
# this is only what the job table records for them.
P4APP_WORKER_PORT = 4000
# p4app's default max_outstanding_packets is 256 (config.cc line 50); thread t of T uses slots
# 2 * (256 / T) * t .. + 256 / T - 1, all below 512
DEFAULT_WINDOW = 512

# why a call is refused (the `reason` label of xdpagg_switchml_refusals_total) -> its status
REFUSALS = {
    "not_allowed": grpc.StatusCode.PERMISSION_DENIED,  # the peer is not in --switchml-allow
    "peer_calls": grpc.StatusCode.RESOURCE_EXHAUSTED,  # the peer has its calls in progress
    "calls": grpc.StatusCode.RESOURCE_EXHAUSTED,  # the server has all its calls in progress
    # gRPC's own limit of calls in flight (beyond "calls" and the calls queued to be refused):
    # gRPC answers "Concurrent RPC limit exceeded!" itself; counted by the server
    "grpc_limit": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "broadcasts": grpc.StatusCode.RESOURCE_EXHAUSTED,  # all open Broadcast values are taken
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,  # a field no p4app host sends
    "session_busy": grpc.StatusCode.FAILED_PRECONDITION,  # another session holds the port
    "precondition": grpc.StatusCode.FAILED_PRECONDITION,  # not in the order p4app calls
    "timeout": grpc.StatusCode.DEADLINE_EXCEEDED,  # a barrier or Broadcast did not complete
    "unimplemented": grpc.StatusCode.UNIMPLEMENTED,  # RdmaSession
}
# why a session ended (the `reason` label of xdpagg_switchml_sessions_ended_total)
ENDINGS = {
    "replaced": "replaced by a session its rank 0 opened from one of its hosts",
    "idle": "replaced by another host's session after it had no traffic",
    "failed": "its setup failed",
    "expired": "its setup did not complete within the barrier timeout",
}
CANCELLED = "cancelled"  # the caller went away while it waited (not a refusal: not counted)


class ApiError(Exception):
    """A refusal, answered with the status code of its `reason` (REFUSALS) and a message that
    says what to do."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.code = REFUSALS.get(reason, grpc.StatusCode.CANCELLED)


@dataclass
class SwitchmlSettings:
    """What the serve options give the API (p4app's requests carry none of it)."""

    window: int = DEFAULT_WINDOW  # slots of a session's job, from 0
    barrier_timeout: float = 120.0  # longest a Barrier or Broadcast waits; a setup's expiry
    # who may call: the networks of the callers' addresses (serve: --switchml-allow, by default
    # the subnets of the aggregator's interfaces); none allows nobody
    allow: tuple = ()
    idle_takeover: float = 60.0  # s without traffic after which another host may replace it
    calls: int = 2 * MAX_WORKERS + 4  # calls in progress, all callers (each holds a thread)
    calls_per_peer: int = 8  # calls in progress from one address
    # calls that may wait for a server thread beyond those: each is refused by the admission
    # (counted, with advice) once a thread takes it; past calls + RESERVE + backlog in flight
    # gRPC refuses by itself (xdp_agg.ctl.switchml_grpc.start_server; counted as grpc_limit)
    backlog: int = 1024
    open_broadcasts: int = 64  # root Broadcast values kept until a session takes them
    thread_idle: float = 10.0  # s a server thread without a call waits before it ends


@dataclass(frozen=True)
class Caller:
    """Who makes a call: `host`, its address; `conn`, its connection (address and port);
    `active()`, whether the call is still wanted (the connection open, not cancelled)."""

    host: str
    conn: str
    active: Callable[[], bool] = field(default=lambda: True, compare=False)


def mac_text(value: int) -> str:
    """A 48-bit MAC as p4app sends it (most significant octet first) -> aa:bb:cc:dd:ee:ff."""
    return ":".join(f"{(value >> s) & 0xFF:02x}" for s in range(40, -8, -8))


def mac_value(text: str) -> int:
    """aa:bb:cc:dd:ee:ff -> the 48-bit integer p4app reads (dpdk_utils.cc lines 79-82)."""
    return int(text.replace(":", ""), 16)


def check_host_mac(value: int) -> None:
    """ApiError (invalid) unless `value` is a host's MAC as p4app sends it: below 2^48, its
    group bit (the first octet's lowest) clear, not zero (which the aggregator would take for
    "no MAC to check", docs/protocol.md 2.1)."""
    if value >= 1 << 48:
        raise ApiError("invalid", f"MAC {value:#x} is wider than 48 bits: give the port's MAC")
    if value >> 40 & 1 or value == 0:
        kind = "zero" if value == 0 else "a group (multicast or broadcast) address"
        raise ApiError(
            "invalid", f"MAC {mac_text(value)} is {kind}, no host's: give the port's own MAC"
        )


def _check_ipv4(value: int) -> str:
    ip = ipaddress.IPv4Address(value)
    if ip.is_multicast or ip.is_unspecified or ip == ipaddress.IPv4Address("255.255.255.255"):
        raise ApiError(
            "invalid", f"ipv4 {ip} is no host's address: give the worker port's own address"
        )
    return str(ip)


def check_worker_ip(ip: str, ours: str) -> str:
    """Our address `ours` on worker address `ip`'s side (port_address's: an IPv4 address, or
    with its prefix length, "198.18.0.1/24"), without the prefix; ApiError (invalid) when `ip`
    reaches no worker's NIC from there: our own address, the subnet's broadcast or network
    address (of a subnet of more than two addresses), or a loopback address where we are not
    on loopback (127.0.0.1 in one-arm, whose one interface answers every address)."""
    our = ipaddress.IPv4Interface(ours)
    worker = ipaddress.IPv4Address(ip)
    net = our.network
    what = None
    if worker == our.ip:
        what = "the aggregator's own address"
    elif net.prefixlen <= 30 and worker == net.broadcast_address:
        what = f"the broadcast address of the subnet {net}"
    elif net.prefixlen <= 30 and worker == net.network_address:
        what = f"the network address of the subnet {net}"
    elif worker.is_loopback and not our.ip.is_loopback:
        what = "a loopback address, which reaches only the host itself"
    if what is not None:
        raise ApiError(
            "invalid",
            f"ipv4 {ip} is {what}, no worker's: give the worker port's own address "
            "(p4app's backend.dpdk ip, the address of the NIC that sends to the aggregator)",
        )
    return str(our.ip)


@dataclass
class _Gen:
    """One barrier of a session: how many arrived, whether it is over and how."""

    arrived: int = 0
    done: bool = False
    error: ApiError | None = None


@dataclass
class _Session:
    session_id: int
    key: str  # the job's name in the registry
    world: int
    size_code: int  # its packet_size
    deadline: float  # while set up: the clock after which it expires if nobody waits
    conns: dict[str, int] = field(default_factory=dict)  # connection -> the rank it registered
    hosts: set[str] = field(default_factory=set)  # the addresses of those connections
    entered: dict[str, int] = field(default_factory=dict)  # connection -> barriers entered
    passed_first: set[str] = field(default_factory=set)  # unregistered, through the first
    gens: dict[int, _Gen] = field(default_factory=dict)  # its barriers, by number
    waiting: int = 0  # callers waiting in its barriers
    running: bool = False  # every rank registered and passed the last barrier of the setup
    broadcast: tuple[int, int, int] | None = None  # (world, root, value) its root broadcast
    traffic: int | None = None  # the job's contributions when last read
    traffic_at: float = 0.0  # when they last changed (or the session was set up)


@dataclass
class _Root:
    """A root's Broadcast value, kept until its session opens or it expires."""

    caller: Caller
    world: int
    root: int
    value: int
    deadline: float


class SwitchmlApi:
    """The services' logic over a job registry (a ControlEndpoint's, xdp_agg.ctl.registry), for
    calls from a `Caller`. `port_address(worker_ip)` is our (IPv4, MAC) on the worker's side,
    the address with its prefix length where known ("198.18.0.1/24": then the subnet's broadcast
    and network addresses are refused as a worker's; check_worker_ip), ValueError when no port
    of ours leads there; `clock` dates the setups, Broadcast values
    and traffic that `sweep` expires (waits are real time)."""

    def __init__(
        self,
        registry,
        settings: SwitchmlSettings,
        port_address: Callable[[str], tuple[str, str]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.settings = settings
        self.port_address = port_address
        self.clock = clock
        self.events: Counter = Counter()  # what happened, by name (tests count these)
        self.ended: Counter = Counter()  # sessions ended, by ENDINGS' reason
        self.refusals: Counter = Counter()  # calls refused, by REFUSALS' reason
        self._cond = threading.Condition()
        self._session: _Session | None = None
        self._roots: list[_Root] = []
        self.waiting = 0  # callers blocked in a Barrier or Broadcast now

    @property
    def session_key(self) -> str | None:
        """The registry's name of the current session's job (None: no session)."""
        s = self._session
        return s.key if s else None

    @property
    def open_broadcasts(self) -> int:
        """Root Broadcast values kept now (no session has taken them yet)."""
        return len(self._roots)

    def refused(self, err: ApiError) -> None:
        """Count a refusal (the server calls this for every ApiError it answers)."""
        if err.reason in REFUSALS:
            self.refusals[err.reason] += 1

    def wake(self) -> None:
        """Let every waiting call look again (a caller went away)."""
        with self._cond:
            self._cond.notify_all()

    # --- UdpSession ---------------------------------------------------------------------------
    def udp_session(self, req, caller: Caller) -> tuple[int, int, int]:
        """UdpSession: (session_id, our MAC, our IPv4) for the worker `req` describes."""
        world, rank = req.num_workers, req.rank
        if not 1 <= world <= MAX_WORKERS or rank >= world:
            raise ApiError(
                "invalid",
                f"rank {rank} of {world} workers: a session has 1..{MAX_WORKERS} workers, "
                "ranks 0..num_workers-1",
            )
        if req.packet_size not in pb.PACKET_SIZES.values():
            raise ApiError("invalid", f"packet_size {req.packet_size}")
        check_host_mac(req.mac)
        ip = _check_ipv4(req.ipv4)
        try:
            ours, our_mac = self.port_address(ip)
        except ValueError as e:
            raise ApiError("precondition", str(e)) from None
        our_ip = check_worker_ip(ip, ours)
        with self._cond:
            s = self._session
            if s is not None and caller.conn in s.conns:
                raise ApiError(
                    "precondition",
                    f"this connection registered rank {s.conns[caller.conn]} of session "
                    f"{s.session_id:#x} already: each rank calls from its own process",
                )
            s = self._open(req, caller) if rank == 0 else self._current(req)
            self._register(s, req, caller, ip, (our_ip, 0))
        log.info(
            "session %#x: rank %d of %d at %s (from %s)", s.session_id, rank, world, ip, caller.host
        )
        return req.session_id, mac_value(our_mac), int(ipaddress.IPv4Address(our_ip))

    def _register(self, s: _Session, req, caller: Caller, ip: str, local) -> None:
        """Rank req.rank of session `s` at `ip`, tied to the caller's connection (lock held)."""
        try:
            self.registry.join_job(
                SESSION,
                s.key,
                req.rank,
                ip,
                P4APP_WORKER_PORT,
                mac_text(req.mac),
                local,
                host=caller.host,
            )
        except RequestError as e:
            if req.rank == 0:  # the session it just opened has no use without it
                self._end(s, "failed")
            raise ApiError("precondition", str(e)) from None
        s.conns[caller.conn] = req.rank
        s.hosts.add(caller.host)
        # a rank other than 0 passed the first barrier before its UdpSession: its next is the
        # second
        s.entered[caller.conn] = int(caller.conn in s.passed_first)
        s.deadline = max(s.deadline, self.clock() + self.settings.barrier_timeout)
        self.events["ranks_registered"] += 1
        self._cond.notify_all()

    def _open(self, req, caller: Caller) -> _Session:
        """Rank 0: end the session before it if it may, create this one's job (lock held)."""
        now = self.clock()
        if self._session is not None:
            self._end(self._session, self._may_replace(self._session, caller, now))
        else:
            self._replace_recovered(caller)
        key = f"switchml-{req.session_id:#x}"
        elems = wire.elems_for(req.packet_size)
        try:
            self.registry.open_job(
                SESSION,
                key,
                req.num_workers,
                elems,
                self.settings.window,
                P4APP_WORKER_PORT,
                port=AGG_PORT,
                base=0,
                # p4app's hosts join no group (docs/protocol.md 7.3): a copy to each
                unicast=True,
            )
        except RequestError as e:
            raise ApiError("precondition", str(e)) from None
        deadline = now + self.settings.barrier_timeout
        s = _Session(
            req.session_id, key, req.num_workers, req.packet_size, deadline, traffic_at=now
        )
        # the session id its rank 0 broadcast on this connection reaches the other ranks now
        for r in self._roots:
            if (r.caller.conn, r.root, r.world, r.value) == (
                caller.conn,
                0,
                req.num_workers,
                req.session_id,
            ):
                s.broadcast = (r.world, r.root, r.value)
                self._roots.remove(r)
                break
        self._session = s
        self.events["sessions_opened"] += 1
        self._cond.notify_all()
        return s

    def _replace_recovered(self, caller: Caller) -> None:
        """Rank 0 with no session of ours: the session a restarted serve recovered holds the
        port until the rejoin timeout frees it (its ranks never rejoin); a rank 0 from one of
        its hosts (the same hosts' next run) replaces it now, another's is refused saying when
        it frees (session_busy; lock held)."""
        rec = self.registry.recovered_session(AGG_PORT)
        if rec is None:
            return
        if caller.host in rec.hosts:
            self.registry.end_job(rec.key)
            self.events["sessions_ended"] += 1
            self.ended["replaced"] += 1
            log.info("recovered session %s ended: %s", rec.key, ENDINGS["replaced"])
            return
        if rec.until is None:  # never: a recovered job always has its rejoin timeout
            when = "when the rejoin timeout (serve --rejoin-timeout) ends"
        else:
            left = max(0.0, rec.until - time.time())
            at = time.strftime("%H:%M:%S", time.gmtime(rec.until))
            when = f"at {at} UTC (in {left:.0f} s), when the rejoin timeout (--rejoin-timeout) ends"
        raise ApiError(
            "session_busy",
            f"session {rec.key} of {rec.world} workers (ranks from {', '.join(rec.hosts)}), "
            f"recovered when serve restarted, holds aggregator port {AGG_PORT:#x}: its ranks "
            f"never rejoin, so serve frees it by itself {when}; start this session again "
            "then, or now from one of its hosts (their next session replaces it at once)",
        )

    def _may_replace(self, s: _Session, caller: Caller, now: float) -> str:
        """Why rank 0's new session may end `s` (an ENDINGS reason); ApiError (session_busy)
        when it may not."""
        if not s.running and s.waiting == 0 and now > s.deadline:
            return "expired"
        if caller.host in s.hosts:
            return "replaced"
        if s.running and self._idle(s, now):
            return "idle"
        state = "running" if s.running else "being set up"
        idle = self.settings.idle_takeover
        raise ApiError(
            "session_busy",
            f"session {s.session_id:#x} of {s.world} workers ({state}, ranks from "
            f"{', '.join(sorted(s.hosts))}) holds aggregator port {AGG_PORT:#x} and slots "
            f"0..{self.settings.window - 1}: a new session is opened from one of its hosts, "
            + (
                f"or from any host once it has had no traffic for {idle:g} s"
                if s.running
                else f"or once its setup has expired ({self.settings.barrier_timeout:g} s)"
            ),
        )

    def _idle(self, s: _Session, now: float) -> bool:
        """Whether running session `s` has had no traffic for idle_takeover (lock held); never
        on a target that counts none (then only its hosts replace it)."""
        self._read_traffic(s, now)
        return s.traffic is not None and now - s.traffic_at >= self.settings.idle_takeover

    def _read_traffic(self, s: _Session, now: float) -> None:
        """Note when the job's traffic last changed: its contributions (WorkerCounters), else
        its packets of every reason (JobCounters)."""
        backend = self.registry.backend
        with self.registry.cond:
            job = self.registry.jobs.get(s.key)
        try:
            if job is None:
                return
            if isinstance(backend, WorkerCounters):
                per = backend.worker_counters(job.spec.job_id)
                seen = sum(int(c.get("contributions", 0)) for c in per.values())
            elif isinstance(backend, JobCounters):
                seen = sum(backend.counters(job.spec.job_id).values())
            else:
                return
        except Exception:  # the job just went, or the target cannot tell: nothing learnt
            return
        if seen != s.traffic:
            s.traffic, s.traffic_at = seen, now

    def _current(self, req) -> _Session:
        s = self._session
        if s is None or s.session_id != req.session_id:
            now = f"the current one is {s.session_id:#x}" if s else "there is none"
            raise ApiError(
                "precondition",
                f"no session {req.session_id:#x} ({now}): rank 0 opens it with its UdpSession "
                "before the first Barrier; start rank 0 with the same controller",
            )
        if (req.num_workers, req.packet_size) != (s.world, s.size_code):
            raise ApiError(
                "invalid",
                f"num_workers {req.num_workers}, packet_size {req.packet_size}, but session "
                f"{s.session_id:#x} has {s.world} workers, packet_size {s.size_code}: start every "
                "worker with the same configuration",
            )
        return s

    def _end(self, s: _Session, why: str) -> None:
        """Session `s` over (ENDINGS' `why`): its job ended, its waiting barriers failed."""
        self.registry.end_job(s.key)
        if self._session is s:
            self._session = None
        self.events["sessions_ended"] += 1
        self.ended[why] += 1
        for gen in s.gens.values():
            if not gen.done:
                gen.done = True
                gen.error = ApiError(
                    "precondition",
                    f"session {s.session_id:#x} ended while this Barrier waited: "
                    f"{ENDINGS[why]}; start the run again",
                )
        log.info("session %#x ended: %s", s.session_id, ENDINGS[why])
        self._cond.notify_all()

    # --- Barrier ------------------------------------------------------------------------------
    def barrier(self, world: int, caller: Caller) -> None:
        """Barrier of `world` callers of the caller's session (module docstring)."""
        if not 1 <= world <= MAX_WORKERS:
            raise ApiError("invalid", f"Barrier of {world} workers: a session has 1..{MAX_WORKERS}")
        with self._cond:
            s = self._session
            if s is not None and caller.conn in s.conns:
                if world != s.world:
                    raise ApiError(
                        "invalid",
                        f"Barrier of {world} workers, but session {s.session_id:#x} has "
                        f"{s.world}: start every worker with the same configuration",
                    )
                number = s.entered[caller.conn]
                s.entered[caller.conn] = number + 1
                self._arrive(s, number, caller)
                return
            s = self._before_udp_session(world, caller)
            s.passed_first.add(caller.conn)
            self._arrive(s, 0, caller)  # a first barrier that has filled: it passes

    def _before_udp_session(self, world: int, caller: Caller) -> _Session:
        """The session whose first barrier the Barrier of a connection that has not registered
        belongs to (a rank other than 0, before its UdpSession): the one being set up with
        `world` workers, waited for (lock held)."""
        if world == 1:
            raise ApiError(
                "precondition",
                "Barrier of 1 worker from a connection that has not called UdpSession: the one "
                "rank of such a session calls UdpSession first (dpdk_backend.cc lines 122-125)",
            )
        s = self._wait_for_session(
            lambda s: s if s.world == world else None,
            caller,
            lambda timeout: (
                f"Barrier of {world} workers before UdpSession: no session of "
                f"{world} workers was being set up within {timeout:g} s (rank 0 opens it with "
                "UdpSession before its first Barrier); start rank 0 with the same controller"
            ),
        )
        if caller.conn in s.passed_first:
            raise ApiError(
                "precondition",
                f"this connection passed session {s.session_id:#x}'s first barrier and has not "
                "called UdpSession: a rank other than 0 calls Barrier, UdpSession, Barrier "
                "(dpdk_backend.cc lines 127-139)",
            )
        return s

    @staticmethod
    def _gone(caller: Caller) -> ApiError | None:
        if caller.active():
            return None
        return ApiError(CANCELLED, "the caller went away")

    def _arrive(self, s: _Session, number: int, caller: Caller) -> None:
        """The caller is in barrier `number` of session `s`: wait until it fills (lock held);
        its error, if it failed, raised."""
        gen = s.gens.setdefault(number, _Gen())
        if gen.done:
            if gen.error is not None:
                raise gen.error
            return
        gen.arrived += 1
        timeout = self.settings.barrier_timeout
        s.deadline = max(s.deadline, self.clock() + timeout)
        if gen.arrived >= s.world:
            self._fill(s, number, gen)
        else:
            deadline = time.monotonic() + timeout
            s.waiting += 1
            self.waiting += 1
            try:
                while not gen.done and (left := deadline - time.monotonic()) > 0:
                    if not caller.active():
                        break
                    self._cond.wait(left)
            finally:
                s.waiting -= 1
                self.waiting -= 1
            if not gen.done:
                self._unfilled(s, number, gen, caller)
        if gen.error is not None:
            raise gen.error

    def _unfilled(self, s: _Session, number: int, gen: _Gen, caller: Caller) -> None:
        """Barrier `number` of `s` did not fill for this caller: it went away (its arrival is
        taken back), or the barrier timed out (it fails for all; lock held)."""
        if (gone := self._gone(caller)) is not None:
            gen.arrived -= 1
            if caller.conn in s.entered:
                s.entered[caller.conn] -= 1
            s.passed_first.discard(caller.conn)
            raise gone
        self.events["barrier_timeouts"] += 1
        missing = self.registry.missing_ranks(s.key) or []
        what = ""
        if missing:
            what = f"; session {s.session_id:#x}: rank(s) {missing} have not called UdpSession"
        gen.done = True
        gen.error = ApiError(
            "timeout",
            f"Barrier: {gen.arrived} of {s.world} worker(s) arrived within "
            f"{self.settings.barrier_timeout:g} s{what}"
            + (", its job is ended" if missing and not s.running else "")
            + "; start every worker with the same controller",
        )
        if missing and not s.running and self._session is s:
            self._end(s, "failed")
        self._cond.notify_all()

    def _fill(self, s: _Session, number: int, gen: _Gen) -> None:
        """Barrier `number` of `s` is full: its waiters pass; the second completes the setup
        (lock held)."""
        gen.done = True
        s.gens.pop(number - 2, None)  # every waiter of that one has long read it
        if number == 1 and not s.running:
            missing = self.registry.missing_ranks(s.key)
            if missing:  # not when only registered connections count; kept as a guard
                gen.error = ApiError(
                    "precondition",
                    f"session {s.session_id:#x}: rank(s) {missing} have not called UdpSession",
                )
                self._end(s, "failed")
            else:
                s.running, s.traffic_at = True, self.clock()
                self.events["sessions_complete"] += 1
        self._cond.notify_all()

    # --- Broadcast ----------------------------------------------------------------------------
    def broadcast(self, req, caller: Caller) -> int:
        """Broadcast: the root's value (module docstring)."""
        world, rank, root = req.num_workers, req.rank, req.root
        if not (1 <= world <= MAX_WORKERS and rank < world and root < world):
            raise ApiError(
                "invalid",
                f"Broadcast of rank {rank}, root {root} among {world} workers: a session has "
                f"1..{MAX_WORKERS} workers, ranks and root 0..num_workers-1",
            )
        with self._cond:
            s = self._session
            if s is not None and caller.conn in s.conns:
                raise ApiError(
                    "precondition",
                    "Broadcast after UdpSession: this controller serves p4app's one Broadcast, "
                    "the session id, which comes before UdpSession",
                )
            self._expire_roots(self.clock())
            if rank == root:
                return self._keep_root(req, caller)
            return self._wait_for_root(world, root, caller)

    def _keep_root(self, req, caller: Caller) -> int:
        """A root's value: kept for its session (one per host: a newer one replaces it), and
        answered at once, as p4app's controller does (lock held)."""
        self._roots = [r for r in self._roots if r.caller.host != caller.host]
        if len(self._roots) >= self.settings.open_broadcasts:
            oldest = self._roots[0]
            raise ApiError(
                "broadcasts",
                f"{len(self._roots)} Broadcast values of other hosts wait for their sessions "
                f"(the oldest from {oldest.caller.host}); each expires "
                f"{self.settings.barrier_timeout:g} s after it came unless its rank 0 opens a "
                "session with it: start again then",
            )
        now = self.clock()
        self._roots.append(
            _Root(caller, req.num_workers, req.root, req.value, now + self.settings.barrier_timeout)
        )
        return req.value

    def _wait_for_root(self, world: int, root: int, caller: Caller) -> int:
        """A rank other than the root: the value of the session being set up with `world`
        workers whose root broadcast it, waited for (lock held)."""
        return self._wait_for_session(
            lambda s: s.broadcast[2] if s.broadcast and s.broadcast[:2] == (world, root) else None,
            caller,
            lambda timeout: (
                f"Broadcast: no session of {world} workers was opened within "
                f"{timeout:g} s by a root rank {root} that broadcast its id (rank 0's Broadcast, "
                "then UdpSession); start rank 0 with the same controller"
            ),
        )

    def _wait_for_session(self, found: Callable, caller: Caller, why: Callable[[float], str]):
        """What found(s) gives for the session being set up (not running yet) once it gives
        anything but None, waited for up to the barrier timeout (lock held; counted in
        `waiting`). When the caller goes away: CANCELLED; when the time is up: "timeout",
        saying why(timeout)."""
        timeout = self.settings.barrier_timeout
        deadline = time.monotonic() + timeout
        self.waiting += 1
        try:
            while True:
                s = self._session
                got = found(s) if s is not None and not s.running else None
                if got is not None:
                    return got
                left = deadline - time.monotonic()
                if left <= 0 or not caller.active():
                    raise self._gone(caller) or ApiError("timeout", why(timeout))
                self._cond.wait(left)
        finally:
            self.waiting -= 1

    def _expire_roots(self, now: float) -> None:
        kept = [r for r in self._roots if r.deadline >= now]
        if len(kept) < len(self._roots):
            self.events["broadcasts_expired"] += len(self._roots) - len(kept)
            self._roots = kept

    # --- expiry -------------------------------------------------------------------------------
    def sweep(self) -> None:
        """Expire what has outlived the barrier timeout: Broadcast values no session took, a
        session whose setup stalled with nobody waiting (its job ended: port and slots free);
        and note a running session's traffic (for idle_takeover). The server runs it every
        sweep_interval() seconds."""
        with self._cond:
            now = self.clock()
            self._expire_roots(now)
            s = self._session
            if s is None:
                return
            if s.running:
                self._read_traffic(s, now)
            elif s.waiting == 0 and now > s.deadline:
                log.warning(
                    "session %#x: its setup did not complete within %g s (ranks registered: "
                    "%s of %d): its job is ended",
                    s.session_id,
                    self.settings.barrier_timeout,
                    sorted(s.conns.values()),
                    s.world,
                )
                self._end(s, "expired")

    def sweep_interval(self) -> float:
        """How often to sweep: a quarter of the shorter of the barrier timeout and the idle
        takeover, between 10 ms and 5 s."""
        shortest = min(self.settings.barrier_timeout, self.settings.idle_takeover)
        return min(max(shortest / 4, 0.01), 5.0)

    def stats(self) -> dict:
        """The counts the metrics export (xdp_agg.app.metrics)."""
        return {
            "opened": self.events["sessions_opened"],
            "complete": self.events["sessions_complete"],
            "ended": {why: self.ended[why] for why in ENDINGS},
            "refusals": {why: self.refusals[why] for why in REFUSALS},
            "broadcasts_expired": self.events["broadcasts_expired"],
            "open_broadcasts": len(self._roots),
            "waiting": self.waiting,
        }
