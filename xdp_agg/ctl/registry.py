"""The control endpoint's job registry and barrier: jobs created, ranks registered and waited
for, leaving and rejoining, and the job table a restart carries on from (snapshot, restore).
ControlEndpoint (xdp_agg.ctl.server) owns one JobRegistry, beside its status answers
(xdp_agg.ctl.status) and its connections. The registry's lock (`cond`) guards the job table; a
method whose name does not say otherwise takes it, and the private ones run with it held.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from xdp_agg.proto import control, groups, wire
from xdp_agg.proto.jobs import Delivery, JobDescription, JobSpec, WorkerSpec
from xdp_agg.proto.limits import MAX_JOBS, MAX_WORKERS

from .backend import ParentJoin, SparseJobs, WorkerCounters, sparse_elems
from .fields import RequestError, float_field, int_field, request_key, wire_bits_field

log = logging.getLogger("xdp_agg.ctl.server")


@dataclass(frozen=True)
class Holder:
    """Who keeps a job alive: a control connection (`number`: the endpoint's id of it), a rank
    recovered after a restart that has not rejoined yet (`number`: the rank), or a SwitchML
    session (xdp_agg.ctl.switchml_sessions; no connection holds its job). A job is deleted when its
    last holder lets go. Each kind apart, so no connection id can pass for a rank or a session.
    """

    kind: str  # "connection", "recovered" or "session"
    number: int = 0

    @classmethod
    def connection(cls, conn: int) -> Holder:
        """The control connection `conn`."""
        return cls("connection", conn)

    @classmethod
    def recovered(cls, rank: int) -> Holder:
        """Recovered rank `rank`, until it rejoins or its grace ends."""
        return cls("recovered", rank)


SESSION = Holder("session")  # what holds a SwitchML session's job


@dataclass(frozen=True)
class RecoveredSession:
    """A SwitchML session's job recovered after a restart (JobRegistry.recovered_session)."""

    key: str
    world: int
    hosts: list[str]  # the addresses its ranks called the API from
    until: float | None  # when (wall clock) it is freed, its ranks not having rejoined


@dataclass
class _Rank:
    ip: str
    port: int
    mac: str
    holder: Holder | None  # None: recovered after a restart, not re-identified (rejoin) yet
    # its loss recovery counters as its last ping said them (control.RECOVERY_COUNTERS)
    recovery: dict[str, int] = field(default_factory=dict)
    state: str = "registered"  # then "left" or "disconnected"
    gone_at: float | None = None  # wall-clock time it left or its connection closed
    contributions: int | None = None  # what the aggregator had counted from it by then


@dataclass
class _EndpointJob:
    key: str
    spec: JobSpec
    world_size: int
    window: int
    worker_port: int
    token: str = ""  # the job's token (xdp_agg.proto.control.new_token), given to its creator
    ranks: dict[int, _Rank] = field(default_factory=dict)
    holders: set[Holder] = field(default_factory=set)  # what keeps the job alive
    complete: bool = False  # every rank has registered: the barrier is open
    deleted: bool = False
    # whether xdp_agg.ctl.lease may end it when quiet; a SwitchML session's job
    # (xdp_agg.ctl.switchml_grpc) has no connection to renew it and lives until the next session or
    # its end
    leased: bool = True
    # the lanes (hostlib's HostOptions.lanes) rank 0 created the job with, else those of the first
    # rank that registered: every rank must give the same, or the ranks would put other parts of
    # the tensor into the same slots
    lanes: int | None = None
    # a SwitchML session's job: the addresses its ranks called the API from (its hosts), kept in
    # the table so that a restarted serve knows whose next session may replace it; else None
    session_hosts: list[str] | None = None

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


TABLE_FORMAT = 1  # the saved job table's format version (xdp_agg.ctl.jobtable)


def _job_record(job: _EndpointJob) -> dict:
    """One job of the table as ControlEndpoint.snapshot writes it (a SwitchML session's with
    its hosts)."""
    hosts = {} if job.session_hosts is None else {"session_hosts": job.session_hosts}
    return {
        **hosts,
        "key": job.key,
        "spec": job.spec.to_dict(),
        "world_size": job.world_size,
        "window": job.window,
        "worker_port": job.worker_port,
        "lanes": job.lanes,
        "token": job.token,
        "complete": job.complete,
        "ranks": {
            str(r): {"ip": x.ip, "port": x.port, "mac": x.mac, "state": x.state}
            for r, x in sorted(job.ranks.items())
        },
    }


def _same_job(spec: JobSpec, have: dict) -> bool:
    """Whether the backend's job `have` is the saved `spec` (id, size, slots and port)."""
    return all(
        have.get(k) == getattr(spec, k)
        for k in ("job_id", "num_workers", "elems", "slot_base", "slot_count", "agg_port")
    )


def _check_lanes(job: _EndpointJob, rank: int, lanes: int) -> None:
    """A registering rank's lanes must be the job's (from create, else its first registered
    rank's)."""
    if job.lanes is None:
        job.lanes = lanes
    elif lanes != job.lanes:
        raise RequestError(
            f"rank {rank} of job {job.key!r} runs {lanes} lane(s), the ranks registered before it "
            f"{job.lanes}: every rank must give the same lanes (HostOptions.lanes, XDP_AGG_LANES)"
        )


def _first_fit(ranges: list[tuple[int, int]], count: int, pool: int) -> int | None:
    """First base b with [b, b + count) free of the (sorted) used ranges, inside the pool."""
    base = 0
    for lo, hi in ranges:
        if base + count <= lo:
            break
        base = max(base, hi)
    return base if base + count <= pool else None


def _peer_closed(sock: socket.socket) -> bool:
    """True when the peer has closed the connection (EOF waiting), without consuming data."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (OSError, ValueError):
        return True


class JobRegistry:
    """The jobs of a control endpoint: the job table (`jobs`, key -> job) and its lock (`cond`),
    the ops that change it (create, register, leave, rejoin), and the table a restart carries on
    from (snapshot, restore).

    `guard` checks a request's credentials (xdp_agg.ctl.auth.Guard); `fill_worker` completes a
    worker spec before backend.add_worker (ControlEndpoint says how); `on_change()`, if set, runs
    with the lock held after every change of the table; `connection(conn)` is the socket of the
    endpoint's connection `conn` (None once closed) and `disconnected(conn)` tells the endpoint
    that a connection closed: the barrier watches a waiting rank's socket through them.
    """

    def __init__(
        self,
        backend,
        defaults,
        guard,
        *,
        fill_worker=None,
        on_change: Callable[[], None] | None = None,
        connection: Callable[[int], socket.socket | None] = lambda conn: None,
        disconnected: Callable[[int], None] = lambda conn: None,
    ) -> None:
        self.backend = backend
        self.defaults = defaults
        self.guard = guard
        self.fill_worker = fill_worker
        self.on_change = on_change
        self._connection = connection
        self._disconnected = disconnected
        self.cond = threading.Condition()
        self.jobs: dict[str, _EndpointJob] = {}
        self.stopping = False  # the endpoint is stopping: no new job, barriers end
        # when (wall clock) the recovered ranks that have not rejoined count as gone (restore)
        self.rejoin_until: float | None = None

    def snapshot(self, generation=None) -> dict:
        """The job table as JSON-able data (xdp_agg.ctl.jobtable saves it): per job its key, spec,
        world size, window, worker port, token, whether the barrier opened, per rank its
        address, port, MAC and state, and a SwitchML session's hosts; `generation` names the
        aggregator's attachment."""
        with self.cond:
            jobs = [_job_record(job) for job in self.jobs.values() if not job.deleted]
        return {"format": TABLE_FORMAT, "generation": generation, "jobs": jobs}

    def restore(self, data: dict | None, generation=None, grace: float = 60.0) -> list[str]:
        """Put the saved jobs the backend still has back (before serving); their keys. A table
        of another `generation` (the aggregator was attached again: its jobs are gone) restores
        nothing. A recovered rank holds its job through a placeholder until it rejoins; one that
        does not within `grace` seconds counts as disconnected (which may free its job)."""
        if not data:
            return []
        if data.get("generation") != generation:
            log.warning(
                "not restoring %d job(s): they were made on another attachment of the "
                "aggregator (%s, now %s), whose state is gone",
                len(data.get("jobs", [])),
                data.get("generation"),
                generation,
            )
            return []
        have = {j["job_id"]: j for j in self.backend.jobs()}
        with self.cond:
            restored = [key for rec in data.get("jobs", []) if (key := self._restore(rec, have))]
        if restored:
            self.rejoin_until = time.time() + grace
            t = threading.Timer(grace, self._expire_unrejoined, args=(grace,))
            t.daemon = True
            t.start()
        return restored

    def notify_change(self) -> None:
        """Run on_change now (a target saving the table it just restored)."""
        with self.cond:
            self.changed()

    def _restore(self, rec: dict, have: dict) -> str | None:
        """One saved job back in the table (lock held); its key, or None if it is not."""
        try:
            spec = JobSpec(**rec["spec"])
            ranks = {
                int(r): _Rank(x["ip"], int(x["port"]), x["mac"], None, x["state"])
                for r, x in rec["ranks"].items()
            }
            key = rec["key"]
        except (KeyError, TypeError, ValueError) as e:
            log.error("skipping an unreadable job record %r: %s", rec, e)
            return None
        if spec.job_id not in have or not _same_job(spec, have[spec.job_id]):
            log.warning("not restoring job %r: the aggregator has no such job any more", key)
            return None
        job = _EndpointJob(key, spec, rec["world_size"], rec["window"], rec["worker_port"])
        job.lanes = rec.get("lanes")
        hosts = rec.get("session_hosts")
        job.session_hosts = [str(h) for h in hosts] if isinstance(hosts, list) else None
        # a table without a token restores a job no token matches (xdp_agg.proto.control.same_token)
        job.token = str(rec.get("token") or "")
        job.ranks, job.complete = ranks, bool(rec.get("complete"))
        job.holders = {Holder.recovered(r) for r, x in ranks.items() if x.state == "registered"}
        self.jobs[key] = job
        if not job.holders:  # nobody can come back for it: free it now
            self.delete(job)
            return None
        log.info("recovered job %r (id %d), ranks %s", key, spec.job_id, sorted(ranks))
        return key

    def _expire_unrejoined(self, grace: float) -> None:
        """Recovered ranks that did not rejoin within `grace` are disconnected (frees jobs)."""
        with self.cond:
            if self.stopping:
                return
            for job in list(self.jobs.values()):
                for r, x in job.ranks.items():
                    if x.state == "registered" and x.holder is None:
                        log.warning(
                            "rank %d of job %r did not rejoin within %g s: disconnected",
                            r,
                            job.key,
                            grace,
                        )
                        self._mark_gone(job, r, "disconnected")
                        self._release(job, Holder.recovered(r))
            self.changed()

    # --- for other front ends of the same registry (xdp_agg.ctl.switchml_grpc) -----------------
    def join_job(self, holder: Holder, key, rank, ip, port, mac, local, host=None) -> None:
        """Register rank `rank` of job `key` without waiting for the others (their barrier is
        the caller's); `local`: our (address, port) on the rank's side, as fill_worker takes
        it; `host`: the address the rank called from (a SwitchML session's host, kept in the
        table). RequestError when it cannot be."""
        with self.cond:
            self._check_running()
            job = self.live_job(key)
            before = job.session_hosts
            if host is not None:  # saved with the rank (_add_rank's change)
                job.session_hosts = sorted({*(before or []), host})
            try:
                self._add_rank(job, holder, rank, ip, port, mac, local)
            except RequestError:
                job.session_hosts = before
                raise

    def recovered_session(self, port: int) -> RecoveredSession | None:
        """The SwitchML session's job on aggregator port `port` that was recovered after a
        restart and is held by nothing else since (p4app's ranks never rejoin), if any."""
        with self.cond:
            for job in self.jobs.values():
                if (
                    job.spec.agg_port == port
                    and job.session_hosts is not None
                    and job.holders
                    and all(h.kind == "recovered" for h in job.holders)
                ):
                    return RecoveredSession(
                        job.key,
                        job.world_size,
                        list(job.session_hosts),
                        self.rejoin_until,
                    )
        return None

    def missing_ranks(self, key) -> list[int] | None:
        """The ranks of job `key` not registered yet; None when there is no such job."""
        with self.cond:
            job = self.jobs.get(key)
            return None if job is None else job.missing()

    def end_job(self, key) -> bool:
        """Delete job `key` whoever holds it; whether there was one."""
        with self.cond:
            job = self.jobs.get(key)
            if job is None:
                return False
            self.delete(job)
            return True

    def create(self, conn, req, local, peer):
        """op create: a new job, its id, slots and port (server.py's docstring)."""
        self.guard.need_secret(req, "create")
        key = request_key(req)
        world = int_field(req, "world_size", 1, MAX_WORKERS)
        elems = int_field(req, "elems", 1, wire.MAX_ELEMS)
        try:
            wire.size_code_for(elems)
        except ValueError as e:
            raise RequestError(str(e)) from None
        window = int_field(req, "window", 1, self.defaults.pool_slots)
        worker_port = int_field(req, "worker_port", 1, 65535)
        lanes = int_field(req, "lanes", 1, window) if req.get("lanes") is not None else None
        if lanes is not None and worker_port + lanes - 1 > 65535:
            raise RequestError(
                f"create: worker_port {worker_port} leaves no room for {lanes} lanes"
            )
        bits = wire_bits_field(req)
        with self.cond:
            holder = Holder.connection(conn)
            self.open_job(
                holder, key, world, elems, window, worker_port, leased=True, wire_bits=bits
            )
            job = self.jobs[key]
            job.lanes = lanes
            return {"job": self.describe(job, local), "token": job.token}

    def open_job(
        self,
        holder: Holder,
        key,
        world,
        elems,
        window,
        worker_port,
        *,
        port=None,
        base=None,
        unicast=False,
        leased=False,
        wire_bits=32,
    ) -> JobSpec:
        """Create job `key` held by `holder`: a free job id, the aggregator `port` and first slot
        `base` given, else the first free port and the first fit of `window` slots; its spec.
        `unicast`: its results to each worker by unicast where they would go to a group (hosts
        that join none). `leased`: xdp_agg.ctl.lease ends it when it is quiet (a job of op
        create); else it lives until end_job. `wire_bits`: its element width (JobSpec). A
        RequestError saying why it cannot be (the name, the port or the slots taken)."""
        with self.cond:
            self._check_running()
            if key in self.jobs:
                old = self.jobs[key]
                raise RequestError(
                    f"job {key!r} already exists (job id {old.spec.job_id}, state {old.state}, "
                    f"ranks registered: {sorted(old.ranks)}); a job name can be used by one "
                    f"run at a time: pick another name or wait until the old run has left"
                )
            ids, ports, ranges = self._in_use()
            job_id = next((i for i in range(MAX_JOBS) if i not in ids), None)
            if job_id is None:
                raise RequestError(f"all {MAX_JOBS} job ids are in use; wait for a job to end")
            port, base = self._place(ports, ranges, window, port, base)
            spec = self._job_spec(key, job_id, world, elems, base, window, port, unicast)
            if wire_bits != 32:
                spec = self._with_width(key, spec, wire_bits)
            try:
                if isinstance(self.backend, ParentJoin):  # a rack: join the parent's job first
                    spec = self.backend.join_parent(
                        key, spec, window=window, worker_port=worker_port
                    )
                self.backend.create_job(spec)
            except ValueError as e:
                raise RequestError(f"the aggregator refused job {key!r}: {e}") from None
            token = control.new_token()
            job = _EndpointJob(
                key, spec, world, window, worker_port, token=token, holders={holder}, leased=leased
            )
            self.jobs[key] = job
            self.changed()
            log.info("created job %r: %s", key, spec)
            return job.spec

    def _place(self, ports, ranges, window, port, base) -> tuple[int, int]:
        """The aggregator port and first slot of a new job: `port`/`base` if given and free,
        else the first free ones; RequestError when there are none."""
        if port is not None and port in ports:
            raise RequestError(
                f"aggregator port {port:#x} is used by a live job; this job needs that port "
                "(p4app-switchML's hosts send to 0xBEE0): end that job first"
            )
        if port is None:
            free = [
                p
                for p in range(wire.UDP_PORT, wire.UDP_PORT + wire.UDP_PORT_COUNT)
                if p not in ports
            ]
            if not free:
                raise RequestError("all 16 aggregator ports 0xBEE0..0xBEEF are used by live jobs")
            port = free[0]
        if base is not None:
            end = base + window
            taken = [(lo, hi) for lo, hi in ranges if lo < end and base < hi]
            if taken or end > self.defaults.pool_slots:
                raise RequestError(
                    f"slots {base}..{end - 1} are not free in the pool of "
                    f"{self.defaults.pool_slots} (used: {taken}); end the job that has them, or "
                    "use a smaller window"
                )
            return port, base
        base = _first_fit(ranges, window, self.defaults.pool_slots)
        if base is None:
            raise RequestError(
                f"no {window} contiguous free slots in the pool of "
                f"{self.defaults.pool_slots}; use a smaller window or wait for a job to end"
            )
        return port, base

    def _with_width(self, key, spec: JobSpec, wire_bits: int) -> JobSpec:
        """`spec` at element width `wire_bits` (docs/protocol.md 5.6); RequestError where this
        endpoint cannot run it: a rack of a two-level tree joins its parent's job as 32 bits."""
        if isinstance(self.backend, ParentJoin):
            raise RequestError(
                f"job {key!r}: a two-level tree's jobs are 32-bit; this rack endpoint cannot "
                f"create a {wire_bits}-bit job"
            )
        return dataclasses.replace(spec, wire_bits=wire_bits)

    def _job_spec(self, key, job_id, world, elems, base, window, port, unicast) -> JobSpec:
        """A new job's spec with the endpoint's defaults (its group, addresses, checksum);
        `unicast`: unicast delivery instead of a group (the switch topology has none)."""
        d = self.defaults
        group_ip, group_mac = d.group_ip, d.group_mac
        delivery = d.delivery
        if unicast and delivery == Delivery.GROUP_TX:
            delivery, group_ip = Delivery.UNICAST, "0.0.0.0"
        if d.group_base and delivery == Delivery.GROUP_TX:
            group_ip = groups.job_group(d.group_base, job_id)
            group_mac = groups.group_mac(group_ip)
        # sparse where the target runs sparse rounds at this size (XDP: not the jumbo ones);
        # else dense, which the hosts read in the job description
        sparse = d.sparse and elems in sparse_elems(self.backend)
        pad = sparse and isinstance(self.backend, SparseJobs) and self.backend.pads_empty()
        try:
            return JobSpec(
                job_id=job_id,
                num_workers=world,
                elems=elems,
                slot_base=base,
                slot_count=window,
                agg_port=port,
                delivery=delivery,
                agg_ip=d.agg_ip,
                agg_mac=d.agg_mac,
                group_ip=group_ip,
                group_mac=group_mac,
                udp_checksum=d.udp_checksum,
                sparse=sparse,
                pad_empty=pad,
            )
        except ValueError as e:
            raise RequestError(f"the aggregator refused job {key!r}: {e}") from None

    def register(self, conn, req, local, peer):
        """op register: a rank joins its job, answered when every rank has (the barrier)."""
        key = request_key(req)
        rank = int_field(req, "rank", 0, MAX_WORKERS - 1)
        port = int_field(req, "port", 1, 65535)
        mac = str(req.get("mac") or "00:00:00:00:00:00")
        ip = req.get("ip") or peer[0]
        lanes = int_field(req, "lanes", 1, wire.MAX_SLOTS) if req.get("lanes") is not None else 1
        try:
            ipaddress.IPv4Address(ip)
        except ValueError:
            raise RequestError(f"register: ip {ip!r} is not an IPv4 address") from None
        with self.cond:
            self._check_running()
            job = self.live_job(key, reveal=req.proven)
            self.guard.need_job(req, key, job.token)
            _check_lanes(job, rank, lanes)
            self._add_rank(job, Holder.connection(conn), rank, ip, port, mac, local)
            # the barrier
            limit = self.defaults.barrier_timeout
            if req.get("timeout") is not None:
                limit = min(limit, float_field(req, "timeout"))
            deadline = time.monotonic() + limit
            sock = self._connection(conn)
            while not (job.complete or job.deleted or job.gone or self.stopping):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                # wake now and then: this thread is the only reader of the waiting rank's
                # connection, so a worker killed during the barrier is noticed only here
                self.cond.wait(min(left, 0.25))
                if sock is not None and _peer_closed(sock):
                    self._disconnected(conn)
                    raise RequestError("connection closed during the barrier")
            if job.complete:
                return {"job": self.describe(job, local)}
            if self.stopping:
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

    def _add_rank(self, job, holder: Holder, rank, ip, port, mac, local) -> None:
        """Register rank `rank` of `job` (lock held) from `ip`, results to `port`, held by
        `conn`; `local` is our address as the worker reached us (fill_worker's). RequestError
        when it cannot be."""
        key = job.key
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
        if job.spec.delivery == Delivery.UNICAST and port != job.worker_port:
            raise RequestError(
                f"port {port} differs from the job's worker port {job.worker_port}: each "
                "worker's copy of a result goes to the port the completing request came from"
            )
        ws = WorkerSpec(job.spec.job_id, rank, ip, port, agg_port=job.spec.agg_port, mac=mac)
        if self.fill_worker is not None:
            self.fill_worker(ws, local)
        try:
            self.backend.add_worker(ws)
        except ValueError as e:
            raise RequestError(f"the aggregator refused rank {rank}: {e}") from None
        job.ranks[rank] = _Rank(ip, port, ws.mac, holder)
        job.holders.add(holder)
        if len(job.ranks) == job.world_size:
            # a flag, not a count: a rank may leave right after its answer, before the
            # others' threads wake up, and they must still pass
            job.complete = True
        self.changed()

    def leave(self, conn, req, local, peer):
        """op leave: a rank is done; the last one out deletes the job."""
        key = request_key(req)
        rank = int_field(req, "rank", 0, MAX_WORKERS - 1)
        with self.cond:
            job = self.jobs.get(key)
            if job is None:
                return {"deleted": True}  # leaving twice, or after the job ended, is fine
            self.guard.need_job(req, key, job.token)
            x = job.ranks.get(rank)
            if x is not None and x.state == "registered":
                self._mark_gone(job, rank, "left")
            job.holders.discard(Holder.recovered(rank))  # left before it rejoined
            self._release(job, Holder.connection(conn))
            self.changed()
            return {"deleted": job.deleted}

    def rejoin(self, conn, req, local, peer):
        """A registered rank re-identifies itself on a new connection (its old one broke, or
        the endpoint restarted and recovered the job): the new connection holds the job."""
        key = request_key(req)
        rank = int_field(req, "rank", 0, MAX_WORKERS - 1)
        port = int_field(req, "port", 1, 65535)
        with self.cond:
            self._check_running()
            job = self.live_job(key, reveal=req.proven)
            self.guard.need_job(req, key, job.token)
            x = job.ranks.get(rank)
            if x is None or x.state != "registered":
                state = "never registered" if x is None else x.state
                raise RequestError(f"rank {rank} of job {key!r} cannot rejoin: it {state}")
            if (req.get("ip") or peer[0]) != x.ip or port != x.port:
                raise RequestError(
                    f"rank {rank} of job {key!r} is registered from {x.ip}:{x.port}, not "
                    f"{req.get('ip') or peer[0]}:{port}"
                )
            me = Holder.connection(conn)
            if x.holder is not None and x.holder != me:
                job.holders.discard(x.holder)
            x.holder = me
            job.holders.discard(Holder.recovered(rank))
            job.holders.add(me)
            self.changed()
            return {"job": self.describe(job, local)}

    def holds_job(self, conn: int) -> bool:
        """True when connection `conn` created or registered in a live job: such a connection
        stays open for a whole run, idle, and its close means "leave", so it is never cut."""
        me = Holder.connection(conn)
        with self.cond:
            return any(me in j.holders for j in self.jobs.values())

    def report_recovery(self, conn: int, counters: dict[str, int]) -> None:
        """The ranks connection `conn` holds pinged their loss recovery `counters`."""
        me = Holder.connection(conn)
        with self.cond:
            for job in self.jobs.values():
                for r in job.ranks.values():
                    if r.holder == me:
                        r.recovery = dict(counters)

    def connection_closed(self, conn: int) -> None:
        """Connection `conn` closed: its ranks are gone, its hold on each job released."""
        me = Holder.connection(conn)
        with self.cond:
            for job in list(self.jobs.values()):
                for r, x in job.ranks.items():
                    if x.holder == me and x.state == "registered":
                        self._mark_gone(job, r, "disconnected")
                self._release(job, me)
            self.changed()

    def stop(self) -> bool:
        """No new job from now on, blocked barriers and waits end; False if it had stopped."""
        with self.cond:
            if self.stopping:
                return False
            self.stopping = True
            self.cond.notify_all()
            return True

    def delete_all(self) -> None:
        """Every job out of the table and the backend (a stopping endpoint's last act)."""
        with self.cond:
            for job in list(self.jobs.values()):
                self.delete(job)

    def changed(self) -> None:
        """The job table changed: wake waiters, and let the target persist it."""
        self.cond.notify_all()
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # persisting failed: serving goes on, a restart recovers less
                log.exception("saving the job table failed")

    def _check_running(self) -> None:
        if self.stopping:
            raise RequestError("the control endpoint is shutting down")

    def live_job(self, key: str, waited: float = 0.0, *, reveal: bool = True) -> _EndpointJob:
        """The live job `key`, or RequestError explaining; the other jobs' names are listed
        only when `reveal` (the request proved the secret: listing jobs needs it)."""
        job = self.jobs.get(key)
        if job is None:
            others = f" (live jobs: {sorted(self.jobs) or 'none'})" if reveal else ""
            raise RequestError(
                f"no job {key!r}"
                + (f" after waiting {waited:g} s" if waited else "")
                + f"{others}; rank 0 creates it: is rank 0 running with the same job name and "
                "control endpoint?"
            )
        return job

    def _in_use(self):
        """Job ids, ports and slot ranges taken by our jobs and any the backend already has;
        each range once (our jobs are the backend's too, and a refusal lists the ranges)."""
        specs = [j.spec.to_dict() for j in self.jobs.values()]
        try:
            specs += self.backend.jobs()
        except Exception:  # a backend that cannot list still works with our own bookkeeping
            log.exception("backend.jobs() failed")
        ids = {s["job_id"] for s in specs}
        ports = {s["agg_port"] for s in specs}
        ranges = sorted({(s["slot_base"], s["slot_base"] + s["slot_count"]) for s in specs})
        return ids, ports, ranges

    def _release(self, job: _EndpointJob, holder: Holder) -> None:
        job.holders.discard(holder)
        if not job.holders and not job.deleted:
            self.delete(job)

    def delete(self, job: _EndpointJob) -> None:
        """Job `job` out of the table and the backend (its id, slots and port are free)."""
        job.deleted = True
        self.jobs.pop(job.key, None)
        try:
            self.backend.delete_job(job.spec.job_id)
        except Exception:
            log.exception("deleting job %r from the backend failed", job.key)
        log.info("deleted job %r (id %d)", job.key, job.spec.job_id)
        self.changed()

    def _mark_gone(self, job: _EndpointJob, rank: int, state: str) -> None:
        """Rank `rank` left or lost its connection: remember when, and how many contributions
        the aggregator had from it (the survivors' diagnosis names it with both), then
        unregister it from the backend."""
        x = job.ranks[rank]
        x.state, x.gone_at = state, time.time()
        if isinstance(self.backend, WorkerCounters):
            try:
                c = self.backend.worker_counters(job.spec.job_id).get(rank, {})
                x.contributions = c.get("contributions")
            except Exception:  # the diagnosis is then less precise, nothing else changes
                log.exception("reading rank %d's counters of job %r failed", rank, job.key)
        self._remove_worker(job, rank)

    def _remove_worker(self, job: _EndpointJob, rank: int) -> None:
        try:
            self.backend.remove_worker(job.spec.job_id, rank)
        except Exception:
            log.exception("removing rank %d of job %r failed", rank, job.key)

    def describe(self, job: _EndpointJob, local: tuple[str, int]) -> dict:
        """The job as its workers are told about it (xdp_agg.proto.jobs.JobDescription, as JSON)."""
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
            lanes=job.lanes or 1,
        ).to_dict()
