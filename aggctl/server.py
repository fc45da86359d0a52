"""The control endpoint: workers find each other and their aggregator job here.

Protocol: JSON lines over TCP. Each request is one JSON object with an "op"; each answer is one
JSON object, {"ok": true, ...} or {"ok": false, "error": "<what went wrong and what to do>"},
with "kind": "auth" or "limit" for the refusals below.

Credentials (aggproto.control, checked by aggctl.auth.Guard; docs/protocol.md section 6.6):
any request may carry "auth", a proof of the deployment secret (HMAC-SHA256 over the request's
canonical content, a nonce and a timestamp; a stale, replayed or wrong proof is refused before
anything is read), and "token", a job's token. create and status without a job need the proof;
register, leave, status and diagnose of a job need that job's token or the proof. ping needs
nothing. With secret=None (the CLI's --insecure-no-auth) everything is allowed.

Limits (aggctl.auth.Limits): line length, connections in all and per source address, the idle
time of a connection that holds no job (a connection that created or registered is never cut:
it stays open all run and its close means "leave"), requests per second per source address.
A refusal is an error answer and changes nothing.

    create   {job, world_size, elems, window, worker_port}          (rank 0)
             -> {ok, job: <description>, token}
             Allocates a job id (0..63), `window` contiguous slots (first fit over the pool) and an
             aggregator port in 0xBEE0..0xBEEF that no live job uses, then backend.create_job.
             A live job with the same key is an error, never a merge.
    register {job, rank, port, mac?, ip?, timeout?}                  (every rank)
             -> {ok, job: <description>}, answered to every rank once all world_size ranks
             registered (a barrier); after `timeout` (capped by the server's barrier_timeout) an
             error naming the ranks that did not register. The worker's address is the TCP peer
             address unless `ip` is given.
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
             broke, or after the endpoint restarted and recovered its jobs, aggctl.jobtable);
             the new connection then holds the job as the old one did.
    ping     {} -> {ok, version}

A job description is JobSpec.to_dict() plus: key, world_size, window, worker_port (every worker
of the job listens on it: in the one-arm topology the result is sent once, to
group_ip:worker_port),
send_to [ip, port] (where workers send contributions), group [ip, port] or null (the group
address results go to in the one-arm topology: the job's own multicast group when the defaults
have a group_base, else their group_ip), workers [{rank, ip, port}] once registered.

Run by hand: `python -m aggctl.server --listen 127.0.0.1:48800 --soft 127.0.0.1` (the secret:
--secret-file, $XDP_AGG_SECRET_FILE, else ./xdp-agg-soft.secret, created 0600).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import select
import signal
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Callable

from aggproto import control, groups, wire
from aggproto.jobs import (
    DEFAULT_CONTROL_PORT,
    Delivery,
    JobDescription,
    JobSpec,
    WorkerSpec,
)
from aggproto.limits import DEFAULT_POOL_SLOTS, MAX_JOBS, MAX_WORKERS

from . import auth
from .backend import Backend
from .lease import JobLease

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_LINE = auth.Limits.max_line  # the default bound on a request line


@dataclass
class ServerDefaults:
    """What the server puts into every job it creates, and its limits."""

    delivery: Delivery = Delivery.GROUP_TX
    group_ip: str = "0.0.0.0"  # one-arm: results go here (multicast or subnet broadcast)
    group_mac: str = "ff:ff:ff:ff:ff:ff"
    # one-arm: a block such as 239.18.0.0/24 gives each job its own group, the job id's address
    # in it (aggproto.groups); group_ip and group_mac then go unused. None: every job uses them.
    group_base: str | None = None
    agg_ip: str = "0.0.0.0"  # where workers send; 0.0.0.0: the address they reached us at
    agg_mac: str = "00:00:00:00:00:00"
    pool_slots: int = DEFAULT_POOL_SLOTS  # slots this server may hand out: 0..pool_slots-1
    barrier_timeout: float = 120.0  # longest a register may wait for the other ranks
    udp_checksum: bool = False  # jobs verify their contributions' UDP checksums (JobSpec)

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


class RequestError(Exception):
    """A request the server refuses; the text goes back to the client as "error"."""


@dataclass
class _Rank:
    ip: str
    port: int
    mac: str
    conn: int | None  # None: recovered after a restart, not re-identified (rejoin) yet
    state: str = "registered"  # then "left" or "disconnected"
    gone_at: float | None = None  # wall-clock time it left or its connection closed
    contributions: int | None = None  # what the aggregator had counted from it by then


@dataclass
class _Job:
    key: str
    spec: JobSpec
    world_size: int
    window: int
    worker_port: int
    token: str = ""  # the job's token (aggproto.control.new_token), given to its creator
    ranks: dict[int, _Rank] = field(default_factory=dict)
    holders: set[int] = field(default_factory=set)  # connections keeping the job alive
    complete: bool = False  # every rank has registered: the barrier is open
    deleted: bool = False

    @property
    def gone(self) -> list[int]:
        return sorted(r for r, x in self.ranks.items() if x.state != "registered")

    @property
    def state(self) -> str:
        if self.gone:
            return "closing"
        return "ready" if len(self.ranks) == self.world_size else "registering"

    def missing(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.ranks]

    def group(self) -> tuple[str, int] | None:
        if self.spec.delivery == Delivery.GROUP_TX and self.spec.group_ip != "0.0.0.0":
            return (self.spec.group_ip, self.worker_port)
        return None


class RendezvousServer:
    """The control endpoint in front of one aggregator backend.

    `fill_worker(worker_spec, local_address)`, if given, is called before backend.add_worker so
    a target can complete target-specific fields (worker_spec.extra, mac); local_address is this
    server's (ip, port) on the worker's control connection, i.e. the address the worker reached
    us at, which tells on which interface the worker is.

    `secret` is the deployment secret (aggproto.control.load_secret/create_secret); it must be
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
        of the job table, so that a target can persist it (aggctl.jobtable); `keep_jobs`: stop()
        leaves the jobs in the backend (their data plane keeps running, a restarted server
        recovers them) instead of deleting them."""
        self.backend = backend
        self.limits = limits or auth.Limits()
        self._guard = auth.Guard(secret, self.limits)
        self._rate = auth.RateLimiter(self.limits.rate, self.limits.burst)
        self.on_change = on_change
        self.keep_jobs = keep_jobs
        self.defaults = ServerDefaults.from_any(defaults)
        if not 1 <= self.defaults.pool_slots <= wire.MAX_SLOTS:
            raise ValueError(f"pool_slots must be 1..{wire.MAX_SLOTS}")
        if self.defaults.group_base:
            groups.check_group_base(self.defaults.group_base)
        self.fill_worker = fill_worker
        self._cond = threading.Condition()
        self._jobs: dict[str, _Job] = {}
        self._conns: dict[int, socket.socket] = {}
        self._sources: dict[int, str] = {}  # connection -> its peer address (per-source cap)
        self._next_conn = 0
        self._stopping = False
        self._thread: threading.Thread | None = None  # the one running serve_forever
        self._tcp = _TCPServer((host, port), self)
        # --- job leases (aggctl.lease): quiet jobs expire; renewed in handle() ---
        self.lease = JobLease(self, self.limits.job_lease)

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

    def start(self) -> "RendezvousServer":
        """Serve in a background thread."""
        # set before the thread runs so that an early stop() still shuts it down
        self._thread = threading.Thread(
            target=self._tcp.serve_forever, args=(0.2,), name="rendezvous", daemon=True
        )
        self._thread.start()
        self.lease.start()
        return self

    def stop(self) -> None:
        """Stop serving, wake blocked barriers, close every connection; jobs are deleted
        (unless keep_jobs)."""
        with self._cond:
            if self._stopping:
                return
            self._stopping = True
            self._cond.notify_all()
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
        with self._cond:
            if self.keep_jobs:
                return
            for job in list(self._jobs.values()):
                self._delete(job)

    def __enter__(self) -> "RendezvousServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- connections ------------------------------------------------------------------------
    def _connected(self, sock: socket.socket, source: str) -> int:
        """Admit a connection (auth.Denied over the connection caps); its number."""
        with self._cond:
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

    def _holds_job(self, conn: int) -> bool:
        """True when connection `conn` created or registered in a live job: such a connection
        stays open for a whole run, idle, and its close means "leave", so it is never cut."""
        with self._cond:
            return any(conn in j.holders for j in self._jobs.values())

    def _disconnected(self, conn: int) -> None:
        """A connection closed: its ranks are gone, its hold on each job released."""
        with self._cond:
            self._conns.pop(conn, None)
            self._sources.pop(conn, None)
            if self._stopping and self.keep_jobs:
                return  # our own shutdown closed it: the job goes on, its rank rejoins later
            for job in list(self._jobs.values()):
                for r, x in job.ranks.items():
                    if x.conn == conn and x.state == "registered":
                        self._mark_gone(job, r, "disconnected")
                self._release(job, conn)
            self._changed()

    def handle(self, conn: int, request: dict, local: tuple[str, int], peer: tuple[str, int]):
        """Answer one request (a dict) from connection `conn`; never raises."""
        try:
            if not isinstance(request, dict):
                raise RequestError("a request is a JSON object with an 'op'")
            request = self._guard.check(request)  # a bad proof is refused before anything
            op = request.get("op")
            fn = getattr(self, f"_op_{op}", None) if isinstance(op, str) else None
            if fn is None:
                raise RequestError(
                    f"unknown op {op!r}; ops: create, register, leave, status, diagnose, "
                    "rejoin, ping"
                )
            answer = {"ok": True, **fn(conn, request, local, peer)}
            self.lease.renew(conn)  # a request of a job's member renews the job's lease
            return answer
        except RequestError as e:
            return {"ok": False, "error": str(e)}
        except auth.Denied as e:
            return {"ok": False, "error": str(e), "kind": e.kind}
        except Exception as e:  # a backend failure must reach the client, not kill the server
            log.exception("request %r failed", request)
            return {"ok": False, "error": f"internal error: {type(e).__name__}: {e}"}

    # --- ops --------------------------------------------------------------------------------
    def _op_ping(self, conn, req, local, peer):
        return {"version": PROTOCOL_VERSION}

    def _op_create(self, conn, req, local, peer):
        self._guard.need_secret(req, "create")
        key = _key(req)
        world = _int(req, "world_size", 1, MAX_WORKERS)
        elems = _int(req, "elems", 1, wire.MAX_ELEMS)
        try:
            wire.size_code_for(elems)
        except ValueError as e:
            raise RequestError(str(e)) from None
        window = _int(req, "window", 1, self.defaults.pool_slots)
        worker_port = _int(req, "worker_port", 1, 65535)
        with self._cond:
            self._check_running()
            if key in self._jobs:
                old = self._jobs[key]
                raise RequestError(
                    f"job {key!r} already exists (job id {old.spec.job_id}, state {old.state}, "
                    f"ranks registered: {sorted(old.ranks)}); a job name can be used by one "
                    f"run at a time: pick another name or wait until the old run has left"
                )
            ids, ports, ranges = self._in_use()
            job_id = next((i for i in range(MAX_JOBS) if i not in ids), None)
            if job_id is None:
                raise RequestError(f"all {MAX_JOBS} job ids are in use; wait for a job to end")
            free_ports = [
                p
                for p in range(wire.UDP_PORT, wire.UDP_PORT + wire.UDP_PORT_COUNT)
                if p not in ports
            ]
            port = free_ports[0] if free_ports else None
            if port is None:
                raise RequestError("all 16 aggregator ports 0xBEE0..0xBEEF are used by live jobs")
            base = _first_fit(ranges, window, self.defaults.pool_slots)
            if base is None:
                raise RequestError(
                    f"no {window} contiguous free slots in the pool of "
                    f"{self.defaults.pool_slots}; use a smaller window or wait for a job to end"
                )
            d = self.defaults
            group_ip, group_mac = d.group_ip, d.group_mac
            if d.group_base and d.delivery == Delivery.GROUP_TX:
                group_ip = groups.job_group(d.group_base, job_id)
                group_mac = groups.group_mac(group_ip)
            try:
                spec = JobSpec(
                    job_id=job_id,
                    num_workers=world,
                    elems=elems,
                    slot_base=base,
                    slot_count=window,
                    agg_port=port,
                    delivery=d.delivery,
                    agg_ip=d.agg_ip,
                    agg_mac=d.agg_mac,
                    group_ip=group_ip,
                    group_mac=group_mac,
                    udp_checksum=d.udp_checksum,
                )
                join = getattr(self.backend, "join_parent", None)
                if join is not None:  # a rack of a two-level tree: join the parent's job first
                    spec = join(key, spec, window=window, worker_port=worker_port)
                self.backend.create_job(spec)
            except ValueError as e:
                raise RequestError(f"the aggregator refused job {key!r}: {e}") from None
            token = control.new_token()
            job = _Job(key, spec, world, window, worker_port, token=token, holders={conn})
            self._jobs[key] = job
            self._changed()
            log.info("created job %r: %s", key, spec)
            return {"job": self._describe(job, local), "token": token}

    def _op_register(self, conn, req, local, peer):
        key = _key(req)
        rank = _int(req, "rank", 0, MAX_WORKERS - 1)
        port = _int(req, "port", 1, 65535)
        mac = str(req.get("mac") or "00:00:00:00:00:00")
        ip = req.get("ip") or peer[0]
        try:
            ipaddress.IPv4Address(ip)
        except ValueError:
            raise RequestError(f"register: ip {ip!r} is not an IPv4 address") from None
        with self._cond:
            self._check_running()
            job = self._live_job(key, reveal=req.proven)
            self._guard.need_job(req, key, job.token)
            if rank >= job.world_size:
                raise RequestError(
                    f"rank {rank} is out of range: job {key!r} has world_size {job.world_size}"
                )
            if job.state == "closing":
                raise RequestError(
                    f"job {key!r} is shutting down (ranks {job.gone} left); wait for the old run "
                    f"to end and start all ranks again"
                )
            if rank in job.ranks:
                x = job.ranks[rank]
                raise RequestError(
                    f"rank {rank} of job {key!r} is already registered from {x.ip}:{x.port}; "
                    f"two workers were started with the same rank"
                )
            if job.group() and port != job.worker_port:
                raise RequestError(
                    f"port {port} differs from the job's worker port {job.worker_port}: results "
                    f"go once to the group {job.spec.group_ip}:{job.worker_port}"
                )
            ws = WorkerSpec(job.spec.job_id, rank, ip, port, agg_port=job.spec.agg_port, mac=mac)
            if self.fill_worker is not None:
                self.fill_worker(ws, local)
            try:
                self.backend.add_worker(ws)
            except ValueError as e:
                raise RequestError(f"the aggregator refused rank {rank}: {e}") from None
            job.ranks[rank] = _Rank(ip, port, ws.mac, conn)
            job.holders.add(conn)
            if len(job.ranks) == job.world_size:
                # a flag, not a count: a rank may leave right after its answer, before the
                # others' threads wake up, and they must still pass
                job.complete = True
            self._changed()
            # the barrier
            limit = self.defaults.barrier_timeout
            if req.get("timeout") is not None:
                limit = min(limit, _float(req, "timeout"))
            deadline = time.monotonic() + limit
            sock = self._conns.get(conn)
            while not (job.complete or job.deleted or job.gone or self._stopping):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                # wake now and then: this thread is the only reader of the waiting rank's
                # connection, so a worker killed during the barrier is noticed only here
                self._cond.wait(min(left, 0.25))
                if sock is not None and _peer_closed(sock):
                    self._disconnected(conn)
                    raise RequestError("connection closed during the barrier")
            if job.complete:
                return {"job": self._describe(job, local)}
            if self._stopping:
                raise RequestError("the control endpoint is shutting down")
            if job.deleted:
                raise RequestError(f"job {key!r} was deleted while waiting for the other ranks")
            if job.gone:
                raise RequestError(
                    f"rank(s) {', '.join(map(str, job.gone))} of job {key!r} left or lost their "
                    f"connection before every rank had registered; start the run again"
                )
            raise RequestError(
                f"barrier timeout after {limit:g} s for job {key!r}: rank(s) "
                f"{', '.join(map(str, job.missing()))} of {job.world_size} did not register "
                f"(registered: {sorted(job.ranks)}); start the missing workers with the same "
                f"job name and control endpoint, or check their logs"
            )

    def _op_leave(self, conn, req, local, peer):
        key = _key(req)
        rank = _int(req, "rank", 0, MAX_WORKERS - 1)
        with self._cond:
            job = self._jobs.get(key)
            if job is None:
                return {"deleted": True}  # leaving twice, or after the job ended, is fine
            self._guard.need_job(req, key, job.token)
            x = job.ranks.get(rank)
            if x is not None and x.state == "registered":
                self._mark_gone(job, rank, "left")
            job.holders.discard(_recovered_holder(rank))  # left before it rejoined
            self._release(job, conn)
            self._changed()
            return {"deleted": job.deleted}

    def _op_status(self, conn, req, local, peer):
        if req.get("job") is None:
            self._guard.need_secret(req, "status of all jobs")
            with self._cond:
                return {"jobs": [self._summary(j, local) for j in self._jobs.values()]}
        key = _key(req)
        wait = _float(req, "wait") if req.get("wait") is not None else 0.0
        if not self._guard.has_credentials(req):  # refused now, not after a wait
            self._guard.need_secret(req, f"status of job {key!r} (without its token)")
        with self._cond:
            deadline = time.monotonic() + min(wait, self.defaults.barrier_timeout)
            while not self._stopping:
                job = self._jobs.get(key)
                if job is not None and job.state != "closing":
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            # raises the explanation if there is none
            job = self._live_job(key, waited=wait, reveal=req.proven)
            self._guard.need_job(req, key, job.token)
            out = self._summary(job, local)
            if req.proven:  # a holder of the secret may learn the token (ranks > 0 do)
                out["token"] = job.token
        # backend calls outside our lock: they may take the backend's own locks
        if hasattr(self.backend, "worker_counters"):
            counters = self.backend.worker_counters(job.spec.job_id)
            out["counters"] = {str(k): v for k, v in counters.items()}
        if hasattr(self.backend, "parent_status"):  # a rack of a two-level tree
            out["parent"] = self.backend.parent_status(job.spec.job_id)
        return out

    def _op_diagnose(self, conn, req, local, peer):
        # the same credentials as status; `wait` is not diagnose's, and the proof (checked once
        # in handle) comes along as `proven`
        inner = auth.Checked({k: v for k, v in req.items() if k != "wait"})
        inner.proven = req.proven
        out = self._op_status(conn, inner, local, peer)
        out.pop("token", None)
        counters = {int(k): v for k, v in out.get("counters", {}).items()}
        if hasattr(self.backend, "counters"):
            out["reasons"] = self.backend.counters(out["job"]["job_id"])
        if hasattr(self.backend, "job_lost"):  # the aggregator's state for it is gone
            lost = self.backend.job_lost(out["job"]["job_id"])
            if lost:
                out["lost"] = lost
        out["absent"] = sorted(set(out["missing"]) | set(out["left"]))
        contrib = {r: counters.get(r, {}).get("contributions", 0) for r in out["registered"]}
        lagging = {}
        if counters and contrib:
            top = max(contrib.values())
            lagging = {str(r): c for r, c in contrib.items() if c < top}
        out["most_contributions"] = max(contrib.values()) if contrib else 0
        out["gone"] = self._gone_detail(out["job"]["key"])
        for r in out["gone"]:
            lagging.pop(r, None)  # a gone rank's counters are removed with it: "gone" says more
        out["lagging"] = lagging
        return out

    def _gone_detail(self, key: str) -> dict:
        """Rank -> {state, at (epoch s), contributions (when it went)} for ranks that left or
        whose control connection closed."""
        with self._cond:
            job = self._jobs.get(key)
            if job is None:
                return {}
            return {
                str(r): {"state": x.state, "at": x.gone_at, "contributions": x.contributions}
                for r, x in sorted(job.ranks.items())
                if x.state != "registered"
            }

    def _op_rejoin(self, conn, req, local, peer):
        """A registered rank re-identifies itself on a new connection (its old one broke, or
        the endpoint restarted and recovered the job): the new connection holds the job."""
        key = _key(req)
        rank = _int(req, "rank", 0, MAX_WORKERS - 1)
        port = _int(req, "port", 1, 65535)
        with self._cond:
            self._check_running()
            job = self._live_job(key, reveal=req.proven)
            self._guard.need_job(req, key, job.token)
            x = job.ranks.get(rank)
            if x is None or x.state != "registered":
                state = "never registered" if x is None else x.state
                raise RequestError(f"rank {rank} of job {key!r} cannot rejoin: it {state}")
            if (req.get("ip") or peer[0]) != x.ip or port != x.port:
                raise RequestError(
                    f"rank {rank} of job {key!r} is registered from {x.ip}:{x.port}, not "
                    f"{req.get('ip') or peer[0]}:{port}"
                )
            if x.conn is not None and x.conn != conn:
                job.holders.discard(x.conn)
            x.conn = conn
            job.holders.discard(_recovered_holder(rank))
            job.holders.add(conn)
            self._changed()
            return {"job": self._describe(job, local)}

    # --- helpers (called with self._cond held) ----------------------------------------------
    def _changed(self) -> None:
        """The job table changed: wake waiters, and let the target persist it."""
        self._cond.notify_all()
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # persisting failed: serving goes on, a restart recovers less
                log.exception("saving the job table failed")

    def _check_running(self) -> None:
        if self._stopping:
            raise RequestError("the control endpoint is shutting down")

    def _live_job(self, key: str, waited: float = 0.0, *, reveal: bool = True) -> _Job:
        """The live job `key`, or RequestError explaining; the other jobs' names are listed
        only when `reveal` (the request proved the secret: listing jobs needs it)."""
        job = self._jobs.get(key)
        if job is None:
            others = f" (live jobs: {sorted(self._jobs) or 'none'})" if reveal else ""
            raise RequestError(
                f"no job {key!r}"
                + (f" after waiting {waited:g} s" if waited else "")
                + f"{others}; rank 0 creates it: is rank 0 running with the same job name and "
                "control endpoint?"
            )
        return job

    def _in_use(self):
        """Job ids, ports and slot ranges taken by our jobs and any the backend already has."""
        specs = [j.spec.to_dict() for j in self._jobs.values()]
        try:
            specs += self.backend.jobs()
        except Exception:  # a backend that cannot list still works with our own bookkeeping
            log.exception("backend.jobs() failed")
        ids = {s["job_id"] for s in specs}
        ports = {s["agg_port"] for s in specs}
        ranges = sorted((s["slot_base"], s["slot_base"] + s["slot_count"]) for s in specs)
        return ids, ports, ranges

    def _release(self, job: _Job, conn: int) -> None:
        job.holders.discard(conn)
        if not job.holders and not job.deleted:
            self._delete(job)

    def _delete(self, job: _Job) -> None:
        job.deleted = True
        self._jobs.pop(job.key, None)
        try:
            self.backend.delete_job(job.spec.job_id)
        except Exception:
            log.exception("deleting job %r from the backend failed", job.key)
        log.info("deleted job %r (id %d)", job.key, job.spec.job_id)
        self._changed()

    def _mark_gone(self, job: _Job, rank: int, state: str) -> None:
        """Rank `rank` left or lost its connection: remember when, and how many contributions
        the aggregator had from it (the survivors' diagnosis names it with both), then
        unregister it from the backend."""
        x = job.ranks[rank]
        x.state, x.gone_at = state, time.time()
        if hasattr(self.backend, "worker_counters"):
            try:
                c = self.backend.worker_counters(job.spec.job_id).get(rank, {})
                x.contributions = c.get("contributions")
            except Exception:  # the diagnosis is then less precise, nothing else changes
                log.exception("reading rank %d's counters of job %r failed", rank, job.key)
        self._remove_worker(job, rank)

    def _remove_worker(self, job: _Job, rank: int) -> None:
        try:
            self.backend.remove_worker(job.spec.job_id, rank)
        except Exception:
            log.exception("removing rank %d of job %r failed", rank, job.key)

    def _describe(self, job: _Job, local: tuple[str, int]) -> dict:
        """The job as its workers are told about it (aggproto.jobs.JobDescription, as JSON)."""
        agg_ip = job.spec.agg_ip if job.spec.agg_ip != "0.0.0.0" else local[0]
        return JobDescription(
            key=job.key,
            spec=job.spec,
            world_size=job.world_size,
            window=job.window,
            worker_port=job.worker_port,
            send_to=(agg_ip, job.spec.agg_port),
            group=job.group(),
            workers=tuple(
                {"rank": r, "ip": x.ip, "port": x.port} for r, x in sorted(job.ranks.items())
            ),
        ).to_dict()

    def _summary(self, job: _Job, local) -> dict:
        return {
            "job": self._describe(job, local),
            "state": job.state,
            "registered": sorted(job.ranks),
            "missing": job.missing(),
            "left": job.gone,
            # ranks holding the job through a live control connection (not recovered-only)
            "connected": sorted(
                r for r, x in job.ranks.items() if x.state == "registered" and x.conn is not None
            ),
        }


def _recovered_holder(rank: int) -> int:
    """The placeholder that holds a recovered job for `rank` until it rejoins (real connection
    ids are positive)."""
    return -(rank + 1)


def _peer_closed(sock: socket.socket) -> bool:
    """True when the peer has closed the connection (EOF waiting), without consuming data."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (OSError, ValueError):
        return True


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


def _first_fit(ranges: list[tuple[int, int]], count: int, pool: int) -> int | None:
    """First base b with [b, b + count) free of the (sorted) used ranges, inside the pool."""
    base = 0
    for lo, hi in ranges:
        if base + count <= lo:
            break
        base = max(base, hi)
    return base if base + count <= pool else None


def _key(req: dict) -> str:
    key = req.get("job")
    if not isinstance(key, str) or not key or len(key) > 200:
        raise RequestError("'job' must be a non-empty job name (a string of at most 200 chars)")
    return key


def _int(req: dict, name: str, lo: int, hi: int) -> int:
    v = req.get(name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"{req.get('op')}: field {name!r} must be an integer (got {v!r})")
    if not lo <= v <= hi:
        raise RequestError(f"{req.get('op')}: field {name!r} = {v} is not in {lo}..{hi}")
    return v


def _float(req: dict, name: str) -> float:
    v = req.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise RequestError(f"{req.get('op')}: field {name!r} must be a number >= 0 (got {v!r})")
    return float(v)


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
            self._try_answer({"ok": False, "error": str(e), "kind": e.kind})
            return
        _keepalive(sock)
        local = sock.getsockname()[:2]
        self._buf = b""
        try:
            while True:
                deadline = None
                if not owner._holds_job(conn):
                    deadline = time.monotonic() + owner.limits.idle_timeout
                try:
                    line = self._read_line(owner.limits.max_line, deadline)
                except TimeoutError:
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
                    self._answer({"ok": False, "kind": "limit", "error": "request line too long"})
                    return
                if not line.strip():
                    continue
                if not owner._rate.allow(peer[0]):
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

    def __init__(self, address, owner: RendezvousServer) -> None:
        self.owner = owner
        super().__init__(address, _Handler)


def main(argv: list[str] | None = None) -> None:
    """Manual use: a control endpoint in front of a SoftAggregator."""
    import os

    from .soft_aggregator import SoftAggregator

    p = argparse.ArgumentParser(prog="python -m aggctl.server", description=__doc__.split("\n")[0])
    p.add_argument(
        "--listen",
        default=None,
        help="HOST:PORT (TCP); default: the --soft address, port 48800",
    )
    p.add_argument(
        "--soft",
        default="127.0.0.1",
        metavar="IP",
        help="run a SoftAggregator bound to IP (ports 0xBEE0..0xBEEF as jobs need)",
    )
    p.add_argument("--pool-slots", type=int, default=DEFAULT_POOL_SLOTS)
    p.add_argument("--barrier-timeout", type=float, default=120.0)
    p.add_argument(
        "--secret-file",
        default=os.environ.get(control.SECRET_ENV),
        help=f"the deployment secret (created 0600 when absent); default ${control.SECRET_ENV}, "
        "else ./xdp-agg-soft.secret",
    )
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="accept every request without credentials (a trusted lab only)",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    host, _, port = (args.listen or f"{args.soft}:{DEFAULT_CONTROL_PORT}").rpartition(":")
    if host == "0.0.0.0":
        log.warning("listening on every address (0.0.0.0), as --listen asked")
    secret = None
    if not args.insecure_no_auth:
        path = os.path.abspath(args.secret_file or "xdp-agg-soft.secret")
        try:
            secret = control.create_secret(path)
        except control.SecretError as e:
            p.error(str(e))
        log.info("deployment secret: %s (give workers %s=%s)", path, control.SECRET_ENV, path)
    defaults = ServerDefaults(
        agg_ip=args.soft, pool_slots=args.pool_slots, barrier_timeout=args.barrier_timeout
    )
    with SoftAggregator(args.soft) as agg:
        server = RendezvousServer(agg, host, int(port), defaults, secret=secret)
        log.info("control endpoint on %s:%d, soft aggregator on %s", *server.address, args.soft)
        server.run_until_interrupted()


if __name__ == "__main__":
    main()
