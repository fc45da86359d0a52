"""The control endpoint: workers find each other and their aggregator job here.

Protocol: JSON lines over TCP. Each request is one JSON object with an "op"; each answer is one
JSON object, {"ok": true, ...} or {"ok": false, "error": "<what went wrong and what to do>"},
with "kind": "auth" or "limit" for the refusals below.

Credentials (xdp_agg.proto.control, checked by xdp_agg.ctl.auth.Guard; docs/protocol.md section
6.6): any request may carry "auth", a proof of the deployment secret (HMAC-SHA256 over the request's
canonical content, a nonce and a timestamp; a stale, replayed or wrong proof is refused before
anything is read), and "token", a job's token. create and status without a job need the proof;
register, leave, status and diagnose of a job need that job's token or the proof. ping needs
nothing. With secret=None (the CLI's --insecure-no-auth) everything is allowed.

Limits (xdp_agg.ctl.auth.Limits): line length, connections in all and per source address, the idle
time of a connection that holds no job (a connection that created or registered is never cut:
it stays open all run and its close means "leave"), requests per second per source address.
A refusal is an error answer and changes nothing.

    create   {job, world_size, elems, window, worker_port, lanes?, wire_bits?}  (rank 0)
             -> {ok, job: <description>, token}
             Allocates a job id (0..63), `window` contiguous slots (first fit over the pool) and an
             aggregator port in 0xBEE0..0xBEEF that no live job uses, then backend.create_job.
             A live job with the same key is an error, never a merge. `lanes` (1..window): every
             rank's lanes, in the description for ranks that let rank 0 choose (lanes="auto").
             `wire_bits` (32, the default, or 16): the job's element width (JobSpec.wire_bits).
    register {job, rank, port, mac?, ip?, timeout?, lanes?}          (every rank)
             -> {ok, job: <description>}, answered to every rank once all world_size ranks
             registered (a barrier); after `timeout` (capped by the server's barrier_timeout) an
             error naming the ranks that did not register. The worker's address is the TCP peer
             address unless `ip` is given. `lanes` (hostlib's HostOptions.lanes, default 1): a
             rank giving another number than the job's (from create, else its first registered
             rank's) is refused (its lanes would cut the tensor over the slots otherwise, a
             wrong sum).
    leave    {job, rank} -> {ok, deleted}
             When every rank left, or the connection of every rank (and of the creator) closed,
             the job is deleted from the backend and its id, slots and port are freed.
    status   {job?, wait?} -> {ok, job, state, registered, missing, left, counters?} for one job
             (waiting up to `wait` seconds for it to be created), or {ok, jobs: [...]} for all;
             `counters` are per worker, if the backend has worker_counters(job_id); `token`
             too when the request proved the secret (how ranks > 0 with the secret learn it).
    diagnose {job} -> status plus `reasons` (verdict counters, if the backend has
             counters(job_id)), `absent` (ranks not registered or gone), `lagging` (rank ->
             contributions, for registered ranks behind the most advanced one),
             `most_contributions` and `gone` (rank -> {state: left|disconnected, at: epoch
             seconds, contributions: the aggregator's count of it then}); `lost` (why the
             aggregator no longer has the job, if the backend has job_lost(job_id)).
    rejoin   {job, rank, port, ip?} -> {ok, job: <description>}
             A registered rank re-identifies itself on a new connection (after its connection
             broke, or after the endpoint restarted and recovered its jobs, xdp_agg.ctl.jobtable);
             the new connection then holds the job as the old one did.
    ping     {} -> {ok, version, elems}: elems, the packet sizes the aggregator takes

A job description is JobSpec.to_dict() plus: key, world_size, window, worker_port (every worker
of the job listens on it: in the one-arm topology the result is sent once, to
group_ip:worker_port),
send_to [ip, port] (where workers send contributions), group [ip, port] or null (the group
address results go to in the one-arm topology: the job's own multicast group when the defaults
have a group_base, else their group_ip), workers [{rank, ip, port}] once registered.

Run by hand in front of a soft aggregator: `python -m xdp_agg.app.soft_endpoint` (xdp_agg.app).
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import socketserver
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, fields
from typing import Callable

from xdp_agg.proto import control, groups, wire
from xdp_agg.proto.jobs import (
    DEFAULT_CONTROL_PORT,
    Delivery,
    WorkerSpec,
)
from xdp_agg.proto.limits import DEFAULT_POOL_SLOTS

from . import auth
from .backend import Backend, elem_sizes
from .fields import RequestError, int_field
from .lease import JobLease
from .registry import JobRegistry
from .status import JobStatus

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
# What a refused request was refused for (ControlEndpoint.refusals): "auth" a missing or wrong
# credential, "limit" a bound of auth.Limits (connections, rate, line length, idle time),
# "request" a request that cannot be done (bad field, no such job, a full pool), "internal" a
# failure of ours (the backend's).
REFUSAL_KINDS = ("auth", "limit", "request", "internal")
MAX_LINE = auth.Limits.max_line  # the default bound on a request line


@dataclass
class ServerDefaults:
    """What the server puts into every job it creates, and its limits."""

    delivery: Delivery = Delivery.GROUP_TX
    group_ip: str = "0.0.0.0"  # one-arm: results go here (multicast or subnet broadcast)
    group_mac: str = "ff:ff:ff:ff:ff:ff"
    # one-arm: a block such as 239.18.0.0/24 gives each job its own group, the job id's address
    # in it (xdp_agg.proto.groups); group_ip and group_mac then go unused. None: every job uses
    # them.
    group_base: str | None = None
    agg_ip: str = "0.0.0.0"  # where workers send; 0.0.0.0: the address they reached us at
    agg_mac: str = "00:00:00:00:00:00"
    pool_slots: int = DEFAULT_POOL_SLOTS  # slots this server may hand out: 0..pool_slots-1
    barrier_timeout: float = 120.0  # longest a register may wait for the other ranks
    udp_checksum: bool = False  # jobs verify their contributions' UDP checksums (JobSpec)
    # jobs take sparse all-reduces too (JobSpec.sparse, docs/protocol.md section 8), where the
    # target runs them at the job's packet size (SparseJobs); dense elsewhere
    sparse: bool = False

    @classmethod
    def from_any(cls, value) -> "ServerDefaults":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        known = {f.name for f in fields(cls)}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"unknown server defaults: {sorted(unknown)}")
        return cls(**value)


@dataclass(frozen=True)
class JobOverview:
    """A live job as the endpoint's metrics show it: its ranks by where they are."""

    key: str  # the job's name
    job_id: int
    state: str  # registering, ready, closing (xdp_agg.ctl.registry)
    world_size: int
    registered: int  # registered and present
    missing: int  # not registered yet
    gone: int  # left, or their connection closed
    # the ranks' loss recovery counters summed, as their last pings said them
    # (control.RECOVERY_COUNTERS; docs/protocol.md 4.4)
    retransmissions: int = 0
    early_losses: int = 0
    timeouts: int = 0
    spurious: int = 0


@dataclass(frozen=True)
class EndpointOverview:
    """ControlEndpoint.overview: every live job, the open connections, the refusals by kind
    (REFUSAL_KINDS) and the jobs removed for a lapsed lease."""

    jobs: list[JobOverview]
    connections: int
    refusals: dict[str, int]
    lease_expiries: int

    def to_dict(self) -> dict:
        """As JSON: {"jobs": [{field: value}], "connections", "refusals", "lease_expiries"}."""
        return asdict(self)


class ControlEndpoint:
    """The control endpoint in front of one aggregator backend: its connections, and the objects
    it owns that answer the ops: `registry` (the job table: create, register, leave, rejoin;
    xdp_agg.ctl.registry), `status` (status, diagnose; xdp_agg.ctl.status) and `lease`
    (xdp_agg.ctl.lease).

    `fill_worker(worker_spec, local_address)`, if given, is called before backend.add_worker so
    a target can complete target-specific fields (worker_spec.extra, mac); local_address is this
    server's (ip, port) on the worker's control connection, i.e. the address the worker reached
    us at, which tells on which interface the worker is.

    `secret` is the deployment secret (xdp_agg.proto.control.load_secret/create_secret); it must be
    given, None meaning explicitly "no authentication". `limits` bounds the connections.
    """

    def __init__(
        self,
        backend: Backend,
        host: str = "127.0.0.1",
        port: int = DEFAULT_CONTROL_PORT,
        defaults: ServerDefaults | dict | None = None,
        *,
        fill_worker: Callable[[WorkerSpec, tuple[str, int]], None] | None = None,
        secret: bytes | None,
        limits: auth.Limits | None = None,
        on_change: Callable[[], None] | None = None,
        keep_jobs: bool = False,
    ) -> None:
        """`on_change()`, if given, is called (with the server's lock held) after every change
        of the job table, so that a target can persist it (xdp_agg.ctl.jobtable); `keep_jobs`:
        stop() leaves the jobs in the backend (their data plane keeps running, a restarted server
        recovers them) instead of deleting them."""
        self.backend = backend
        self.limits = limits or auth.Limits()
        self._guard = auth.Guard(secret, self.limits)
        self._rate = auth.RateLimiter(self.limits.rate, self.limits.burst)
        self.keep_jobs = keep_jobs
        self.defaults = ServerDefaults.from_any(defaults)
        if not 1 <= self.defaults.pool_slots <= wire.MAX_SLOTS:
            raise ValueError(f"pool_slots must be 1..{wire.MAX_SLOTS}")
        if self.defaults.group_base:
            groups.check_group_base(self.defaults.group_base)
        self.registry = JobRegistry(
            backend,
            self.defaults,
            self._guard,
            fill_worker=fill_worker,
            on_change=on_change,
            connection=lambda conn: self._conns.get(conn),
            disconnected=self._disconnected,
        )
        self.status = JobStatus(self.registry)
        self._ops = {
            "create": self.registry.create,
            "register": self.registry.register,
            "leave": self.registry.leave,
            "rejoin": self.registry.rejoin,
            "status": self.status.status,
            "diagnose": self.status.diagnose,
            "ping": self._ping,
        }
        # the connections, under the registry's lock (a closing one changes the job table)
        self._conns: dict[int, socket.socket] = {}
        self._sources: dict[int, str] = {}  # connection -> its peer address (per-source cap)
        self._next_conn = 0
        self._thread: threading.Thread | None = None  # the one running serve_forever
        self._tcp = _TCPServer((host, port), self)
        # refusals answered, by kind (REFUSAL_KINDS), for the operator's metrics (overview())
        self._refusals: Counter[str] = Counter()
        self._refusals_lock = threading.Lock()
        # --- job leases (xdp_agg.ctl.lease): quiet jobs expire; renewed in handle() ---
        self.lease = JobLease(self.registry, self.limits.job_lease)

    # --- lifecycle --------------------------------------------------------------------------
    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the server listens on."""
        return self._tcp.server_address[:2]

    def serve_forever(self) -> None:
        """Serve in the calling thread until stop() (from another thread) or an exception."""
        self._thread = threading.current_thread()
        self.lease.start()
        self._tcp.serve_forever(poll_interval=0.2)

    def run_until_interrupted(self) -> None:
        """serve_forever in this thread until Ctrl-C (or SIGTERM), then stop cleanly."""
        signal.signal(signal.SIGTERM, _interrupt)  # a terminated server leaves its jobs cleanly
        try:
            self.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    def start(self) -> "ControlEndpoint":
        """Serve in a background thread."""
        # set before the thread runs so that an early stop() still shuts it down
        self._thread = threading.Thread(
            target=self._tcp.serve_forever, args=(0.2,), name="control-endpoint", daemon=True
        )
        self._thread.start()
        self.lease.start()
        return self

    def stop(self) -> None:
        """Stop serving, wake blocked barriers, close every connection; jobs are deleted
        (unless keep_jobs)."""
        with self.registry.cond:
            if not self.registry.stop():
                return
            self.lease.stop()
            conns = list(self._conns.values())
        serving = self._thread
        if serving is not None and serving is not threading.current_thread():
            self._tcp.shutdown()  # returns once serve_forever has stopped (or if it had)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._tcp.server_close()
        if not self.keep_jobs:
            self.registry.delete_all()

    def __enter__(self) -> "ControlEndpoint":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- connections ------------------------------------------------------------------------
    def _connected(self, sock: socket.socket, source: str) -> int:
        """Admit a connection (auth.Denied over the connection caps); its number."""
        with self.registry.cond:
            if len(self._conns) >= self.limits.max_connections:
                raise auth.Denied(
                    f"the control endpoint has {len(self._conns)} connections, its limit; "
                    "try again later",
                    "limit",
                )
            mine = sum(1 for s in self._sources.values() if s == source)
            if mine >= self.limits.max_per_source:
                raise auth.Denied(
                    f"{source} has {mine} connections open, the limit per source address; "
                    "close some (a worker needs one)",
                    "limit",
                )
            self._next_conn += 1
            self._conns[self._next_conn] = sock
            self._sources[self._next_conn] = source
            return self._next_conn

    def _disconnected(self, conn: int) -> None:
        """A connection closed: its ranks are gone, its hold on each job released."""
        with self.registry.cond:
            self._conns.pop(conn, None)
            self._sources.pop(conn, None)
            if self.registry.stopping and self.keep_jobs:
                return  # our own shutdown closed it: the job goes on, its rank rejoins later
            self.registry.connection_closed(conn)

    def refused(self, kind: str) -> None:
        """Count one refusal of `kind` (REFUSAL_KINDS)."""
        with self._refusals_lock:
            self._refusals[kind] += 1

    def refusals(self) -> dict[str, int]:
        """Refusals answered so far, by kind (every kind of REFUSAL_KINDS, 0 when none)."""
        with self._refusals_lock:
            return {k: self._refusals[k] for k in REFUSAL_KINDS}

    def overview(self) -> EndpointOverview:
        """What an operator's metrics show of the endpoint (xdp_agg.app.metrics), read at once."""
        with self.registry.cond:
            jobs = [
                JobOverview(
                    key=j.key,
                    job_id=j.spec.job_id,
                    state=j.state,
                    world_size=j.world_size,
                    registered=len(j.ranks) - len(j.gone),
                    missing=len(j.missing()),
                    gone=len(j.gone),
                    **_recovery_sums(j.ranks.values()),
                )
                for j in self.registry.jobs.values()
                if not j.deleted
            ]
            connections = len(self._conns)
        return EndpointOverview(
            jobs=jobs,
            connections=connections,
            refusals=self.refusals(),
            lease_expiries=self.lease.expiries,
        )

    def handle(self, conn: int, request: dict, local: tuple[str, int], peer: tuple[str, int]):
        """Answer one request (a dict) from connection `conn`; never raises."""
        try:
            if not isinstance(request, dict):
                raise RequestError("a request is a JSON object with an 'op'")
            request = self._guard.check(request)  # a bad proof is refused before anything
            op = request.get("op")
            fn = self._ops.get(op) if isinstance(op, str) else None
            if fn is None:
                raise RequestError(
                    f"unknown op {op!r}; ops: create, register, leave, status, diagnose, "
                    "rejoin, ping"
                )
            answer = {"ok": True, **fn(conn, request, local, peer)}
            self.lease.renew(conn)  # a request of a job's member renews the job's lease
            return answer
        except RequestError as e:
            self.refused("request")
            return {"ok": False, "error": str(e)}
        except auth.Denied as e:
            self.refused(e.kind)
            return {"ok": False, "error": str(e), "kind": e.kind}
        except Exception as e:  # a backend failure must reach the client, not kill the server
            log.exception("request %r failed", request)
            self.refused("internal")
            return {"ok": False, "error": f"internal error: {type(e).__name__}: {e}"}

    # --- ops --------------------------------------------------------------------------------
    def _ping(self, conn, req, local, peer):
        # recovery: a rank's loss recovery counters (hostlib's pings), kept for the overview
        if "recovery" in req:
            self.registry.report_recovery(conn, recovery_field(req))
        # elems: the packet sizes the aggregator takes, for a worker's elems="auto"
        return {"version": PROTOCOL_VERSION, "elems": elem_sizes(self.backend)}


def recovery_field(req: dict) -> dict[str, int]:
    """A ping's "recovery": the counts of control.RECOVERY_COUNTERS it has. Counters this
    endpoint does not know (a newer hostlib's) are left out: a ping renews the job's lease and
    must not fail for a report, so only a report that is not an object of counts is refused."""
    got, names = req["recovery"], control.RECOVERY_COUNTERS
    if not isinstance(got, dict):
        raise RequestError(f"ping: recovery must be an object of counts ({', '.join(names)})")
    return {
        k: int_field({"op": "ping: recovery", **got}, k, 0, 2**63 - 1) for k in names if k in got
    }


def _recovery_sums(ranks) -> dict[str, int]:
    """JobOverview's recovery fields: the ranks' last reported counters, summed."""
    keys = ("retransmissions", "early_losses", "timeouts", "spurious")
    return {k: sum(r.recovery.get(k, 0) for r in ranks) for k in keys}


def _keepalive(sock: socket.socket) -> None:
    """TCP keepalive after 60 s idle, 6 probes 10 s apart: a job holder's connection idles for
    the whole run, and a peer that vanished without a FIN (power loss, cable) is noticed in
    about 2 minutes rather than the kernel's default of over 2 hours."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6)):
        if hasattr(socket, opt):  # Linux has all three
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


# The name it had when "rendezvous" and "control endpoint" both named it (docs/protocol.md still
# says RendezvousServer); code outside this repository may use it.
RendezvousServer = ControlEndpoint


class _Handler(socketserver.StreamRequestHandler):
    """One control connection: a request per line, an answer per line, in order.

    Bounds (auth.Limits): a connection over the caps gets an error answer and is closed; a line
    longer than max_line too; a connection that holds no job must complete a request line
    within idle_timeout of its last answer (a slow or silent peer is answered and closed); a
    source over its request rate gets an error answer per request, and nothing is done. A
    connection that holds a job is never cut for being idle (TCP keepalive notices a dead peer).
    """

    server: "_TCPServer"

    def handle(self) -> None:
        owner = self.server.owner
        sock = self.connection
        peer = self.client_address[:2]
        try:
            conn = owner._connected(sock, peer[0])
        except auth.Denied as e:
            owner.refused(e.kind)
            self._try_answer({"ok": False, "error": str(e), "kind": e.kind})
            return
        _keepalive(sock)
        local = sock.getsockname()[:2]
        self._buf = b""
        try:
            while True:
                deadline = None
                if not owner.registry.holds_job(conn):
                    deadline = time.monotonic() + owner.limits.idle_timeout
                try:
                    line = self._read_line(owner.limits.max_line, deadline)
                except TimeoutError:
                    owner.refused("limit")
                    self._answer(
                        {
                            "ok": False,
                            "kind": "limit",
                            "error": f"no complete request within "
                            f"{owner.limits.idle_timeout:g} s on a connection that holds no "
                            "job: closed",
                        }
                    )
                    return
                if line is None:
                    return
                if len(line) > owner.limits.max_line:
                    owner.refused("limit")
                    self._answer({"ok": False, "kind": "limit", "error": "request line too long"})
                    return
                if not line.strip():
                    continue
                if not owner._rate.allow(peer[0]):
                    owner.refused("limit")
                    self._answer(
                        {
                            "ok": False,
                            "kind": "limit",
                            "error": f"more than {owner.limits.rate:g} requests/s from "
                            f"{peer[0]}: request refused, nothing done; slow down",
                        }
                    )
                    continue
                try:
                    req = json.loads(line)
                except ValueError as e:
                    owner.refused("request")
                    self._answer({"ok": False, "error": f"not JSON: {e}"})
                    continue
                self._answer(owner.handle(conn, req, local, peer))
        except OSError:
            pass  # the peer went away: same as a close
        finally:
            owner._disconnected(conn)

    def _read_line(self, limit: int, deadline: float | None) -> bytes | None:
        """The next line (without its newline); None at end of stream; at most limit + 1 bytes
        of a longer one; TimeoutError when the deadline passes first."""
        sock = self.connection
        while b"\n" not in self._buf:
            if len(self._buf) > limit:
                return self._buf
            if deadline is None:
                sock.settimeout(None)
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
            try:
                chunk = sock.recv(1 << 16)
            except socket.timeout:
                raise TimeoutError from None
            if not chunk:
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line if len(line) <= limit else line[: limit + 1]

    def _answer(self, obj: dict) -> None:
        self.connection.settimeout(None)
        self.wfile.write(json.dumps(obj).encode() + b"\n")
        self.wfile.flush()

    def _try_answer(self, obj: dict) -> None:
        try:
            self.connection.settimeout(2.0)  # a peer refused for a limit gets no more of us
            self.connection.sendall(json.dumps(obj).encode() + b"\n")
        except OSError:
            pass


class _TCPServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
    block_on_close = False

    def __init__(self, address, owner: ControlEndpoint) -> None:
        self.owner = owner
        super().__init__(address, _Handler)
