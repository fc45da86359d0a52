"""The bmv2 target's Backend: the job/worker vocabulary of xdp_agg.ctl.backend.Backend spoken to a
running simple_switch (Bmv2Backend): a job is an entry of table `jobs` and a multicast group; a
worker an entry of `workers` (how its packets are recognised), of `worker_addr` (how its result
copy is addressed) and a multicast node (which port its copy leaves on). p4/switchml.p4
implements docs/protocol.md sections 1-3 (its differences: 3.6).

    import xdp_agg.targets.bmv2 as bm

    ports = bm.port_specs(["p0", "p1"], netns="agg")            # port i = interface i, our MAC/IP
    switch, backend = bm.launch(ports, "/tmp/p4out", netns="agg") # compile, start, set up
    backend.create_job(JobSpec(...))                              # backend: a backend.Backend
    backend.add_worker(WorkerSpec(..., extra={"port": 0}))
    backend.counters(job_id)                                      # {reason name: packets}
    switch.stop()
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from xdp_agg.codegen.p4 import P4_ELEMS
from xdp_agg.ctl.backend import check_job, check_worker
from xdp_agg.proto import keys, limits, reasons, wire
from xdp_agg.proto.jobs import JobSpec, WorkerSpec

from .switch import DEFAULT_THRIFT_PORT, PortSpec, SimpleSwitch, SwitchCLI
from .toolchain import DEFAULT_POOL_SLOTS, Bmv2Error, compile_p4

FLOOD_MGID = 1  # p4/configuration.p4: plain traffic to unknown MACs
# p4/configuration.p4: where 256-element packets wait between their passes (never an interface),
# and that queue's depth: a pass dropped at a full queue would leave its slot's sum short
# (bmv2's default is 64 packets; its recirculation queue holds 1024).
FOLD_PORT = 510
FOLD_QUEUE_DEPTH = 1024

# Names of the objects in the compiled program (absolute @name annotations in p4/*.p4).
T_WORKERS, T_JOBS, T_WORKER_ADDR, T_L2 = "workers", "jobs", "worker_addr", "l2_forward"
T_PARENT_LINK = "parent_link"  # a rack job's link to its parent (next_step_selector.p4)
R_SEEN, R_COUNT = "slot_seen", "slot_count"
R_OPEN = "slot_round_open"  # a sparse job's round in progress (p4/sparse_round.p4)
# the sizes of its sparse jobs (Bmv2Backend.sparse_elems says why not 256)
SPARSE_ELEMS = tuple(k for k in P4_ELEMS if k <= 64)
C_INGRESS, C_EGRESS = "ingress_reasons", "egress_reasons"


def job_mgid(job_id: int) -> int:
    """The multicast group of a job's results (group 1 is the flood group)."""
    return job_id + 2


def launch(
    ports: list[PortSpec],
    workdir,
    *,
    netns: str | None = None,
    pool_slots: int = DEFAULT_POOL_SLOTS,
    thrift_port: int = DEFAULT_THRIFT_PORT,
    unknown_unicast: str = "flood",
) -> tuple["SimpleSwitch", "Bmv2Backend"]:
    """Compile the program into `workdir`, start simple_switch on `ports` and set it up: the
    running switch (stop() it when done) and its Backend. What `xdp-agg --target bmv2` needs."""
    json_path = compile_p4(workdir, pool_slots=pool_slots)
    switch = SimpleSwitch(json_path, ports, netns=netns, thrift_port=thrift_port).start()
    try:
        backend = Bmv2Backend(switch.cli(), ports, pool_slots=pool_slots)
        backend.setup(unknown_unicast=unknown_unicast)
    except BaseException:
        switch.stop()
        raise
    return switch, backend


@dataclass
class _Worker:
    spec: WorkerSpec
    port: int
    agg_mac: str
    agg_ip: str
    workers_handle: int
    addr_handle: int
    node_handle: int


@dataclass
class _Parent:
    """A rack job's parent link as configured: the port toward the parent, and the entries of
    tables parent_link and workers (the parent's results)."""

    port: int
    link_handle: int
    workers_handle: int


@dataclass
class _SwitchJob:
    spec: JobSpec
    handle: int
    workers: dict[int, _Worker] = field(default_factory=dict)
    parent: _Parent | None = None

    @property
    def mgid(self) -> int:
        return job_mgid(self.spec.job_id)


_HANDLE_RE = re.compile(r"with handle (\d+)")
_COUNTER_RE = re.compile(r"\[(\d+)\]=\s*\((\d+) bytes, (\d+) packets\)")


def _handle(out: str) -> int:
    m = _HANDLE_RE.search(out)
    if not m:
        raise Bmv2Error(f"no handle in simple_switch_CLI output: {out!r}")
    return int(m.group(1))


def _mac_ok(mac: str) -> str:
    if not re.fullmatch(r"([0-9a-fA-F]{2}:){5}[0-9a-fA-F]{2}", mac):
        raise ValueError(f"{mac!r} is not a MAC address")
    return mac.lower()


def _mac_match(mac: str) -> str:
    """The workers table's ternary MAC key: the worker's MAC exactly, or any where it is not
    known (all zeros). The entries' other keys are exact, so one priority serves them all."""
    mac = _mac_ok(mac)
    return f"{mac}&&&ff:ff:ff:ff:ff:ff" if mac != "00:00:00:00:00:00" else "0&&&0"


class Bmv2Backend:
    """backend.Backend for a simple_switch running p4/switchml.p4.

    This object is the switch's only controller: it keeps what it configured (jobs, workers,
    table entry handles, multicast nodes) and jobs() reports from that. Call setup() once on a
    freshly started switch (flood group, MAC table default).

    Worker placement: a worker's result copy leaves on the bmv2 port given by
    worker.extra["port"], or failing that the port whose PortSpec.ip is worker.extra["agg_ip"]
    (what fill_worker() records for workers registering through the control endpoint). The
    copy's source is our address on that port: extra["agg_mac"]/["agg_ip"] if given, else the
    PortSpec's, else the job's agg_mac/agg_ip.
    """

    def __init__(
        self, cli: SwitchCLI, ports: list[PortSpec], *, pool_slots: int = DEFAULT_POOL_SLOTS
    ) -> None:
        self.cli = cli
        self.ports = {p.port: p for p in ports}
        if FOLD_PORT in self.ports:
            raise ValueError(f"port {FOLD_PORT} is the program's FOLD_PORT, not an interface's")
        self.pool_slots = pool_slots
        self._jobs: dict[int, _SwitchJob] = {}
        self._macs: dict[str, int] = {}  # MAC -> l2 table handle
        self._flood_node: int | None = None
        self._parent_ports: dict[str, int] = {}  # a tree's parent address -> the port to it

    # --- switch-wide setup -------------------------------------------------------------------
    def setup(self, *, unknown_unicast: str = "flood") -> None:
        """Create the flood group over all ports and choose what unknown MACs get
        ("flood" or "drop")."""
        if unknown_unicast not in ("flood", "drop"):
            raise ValueError("unknown_unicast is 'flood' or 'drop'")
        port_list = " ".join(str(p) for p in sorted(self.ports))
        out = self.cli.run(
            [
                f"mc_mgrp_create {FLOOD_MGID}",
                f"mc_node_create 0 {port_list}",
                f"table_set_default {T_L2} l2_{unknown_unicast}",
            ]
        )
        self._flood_node = _handle(out[1])
        self.cli.run(
            [
                f"mc_node_associate {FLOOD_MGID} {self._flood_node}",
                f"set_queue_depth {FOLD_QUEUE_DEPTH} {FOLD_PORT}",
            ]
        )

    def add_mac(self, mac: str, port: int) -> None:
        """A static MAC table entry: frames to `mac` that are not ours leave on `port`."""
        mac = _mac_ok(mac)
        if port not in self.ports:
            raise ValueError(f"port {port} is not a port of this switch ({sorted(self.ports)})")
        cmds = []
        if mac in self._macs:
            cmds.append(f"table_delete {T_L2} {self._macs.pop(mac)}")
        cmds.append(f"table_add {T_L2} l2_forward_port {mac} => {port}")
        self._macs[mac] = _handle(self.cli.run(cmds)[-1])

    def set_parent_port(self, ip: str, port: int) -> None:
        """Two levels: the parent aggregator `ip` of rack jobs is behind `port` (by default,
        the port whose subnet holds it: uplink_port_for)."""
        if port not in self.ports:
            raise ValueError(f"port {port} is not a port of this switch ({sorted(self.ports)})")
        self._parent_ports[ip] = port

    def uplink_port_for(self, ip: str) -> PortSpec:
        """The port toward a tree's parent at `ip`: set_parent_port's, else the one port whose
        subnet holds `ip`; ValueError when there is none."""
        if ip in self._parent_ports:
            return self.ports[self._parent_ports[ip]]
        on_link = [p for p in self.ports.values() if p.on_link(ip)]
        if len(on_link) != 1:
            raise ValueError(
                f"the parent {ip} is on the subnet of {len(on_link)} ports of this switch, not "
                "one: say which port it is behind (Bmv2Backend.set_parent_port)"
            )
        return on_link[0]

    def uplink_address(self, ip: str) -> tuple[str, str]:
        """Our (IPv4 address, MAC) on the port toward a parent at `ip`: what a rack registers
        as at the parent (xdp_agg.ctl.tree.TreeBackend asks for it)."""
        p = self.uplink_port_for(ip)
        return p.ip, p.mac

    # --- Backend -----------------------------------------------------------------------------
    def elem_sizes(self) -> tuple[int, ...]:
        """The packet sizes the P4 program aggregates (xdp_agg.codegen.p4.P4_ELEMS)."""
        return tuple(P4_ELEMS)

    def sparse_elems(self) -> tuple[int, ...]:
        """The sizes whose sparse rounds it runs (p4/sparse_round.p4): 32 and 64. Not 256:
        simple_switch grows a packet by at most 512 bytes (behavioral-model 9674187,
        targets/simple_switch/simple_switch.cpp lines 233-237: a buffer of the frame's length
        + 512), and a 64-byte empty contribution answered with a 256-element result grows by
        1,030 (bm::PacketBuffer::push asserts, include/bm/bm_sim/packet_buffer.h line 82, and
        the switch stops); 64 elements grow it by 256. So 256-element jobs stay dense."""
        return SPARSE_ELEMS

    def pads_empty(self) -> bool:
        """No: a result makes its payload headers valid, whatever the request's length
        (it takes padded empty contributions all the same)."""
        return False

    def create_job(self, spec: JobSpec) -> None:
        """Create (or re-create) a job: its jobs entry and multicast group; its slots cleared.
        A rack job (spec.has_parent) also gets its parent link and the parent's workers entry
        (docs/protocol.md section 3.7)."""
        check_job(
            spec,
            {j: (o.spec.slot_base, o.spec.slot_count) for j, o in self._jobs.items()},
            self.pool_slots,
        )
        if spec.elems not in P4_ELEMS:
            sizes = ", ".join(map(str, P4_ELEMS[:-1])) + f" or {P4_ELEMS[-1]}"
            raise ValueError(
                f"the bmv2 program aggregates {sizes} elements per packet, not {spec.elems}"
            )
        if spec.udp_checksum:
            raise ValueError(
                "the bmv2 program does not verify UDP checksums (the XDP program does, per job)"
            )
        if spec.sparse and spec.elems not in self.sparse_elems():
            raise ValueError(
                f"the bmv2 program runs sparse jobs of {' or '.join(map(str, self.sparse_elems()))}"
                f" elements per packet, not {spec.elems} (Bmv2Backend.sparse_elems says why)"
            )
        uplink = self._check_parent(spec) if spec.has_parent else None
        end = spec.slot_base + spec.slot_count
        if spec.job_id in self._jobs:
            self.delete_job(spec.job_id)
        mgid = job_mgid(spec.job_id)
        # Clear the job's slots first, so that no packet finds the job with stale state: the
        # seen bitmaps, counts and open rounds of both versions (the accumulators and the rest
        # of a sparse round need no clearing: the first contribution of a round overwrites them).
        clear = []
        for entry in range(2 * spec.slot_base, 2 * end):
            clear.append(f"register_write {R_SEEN} {entry} 0")
            clear.append(f"register_write {R_COUNT} {entry} 0")
            clear.append(f"register_write {R_OPEN} {entry} 0")
        self.cli.run(clear + [f"mc_mgrp_create {mgid}"])
        # A rack job's parent link goes in before its jobs entry: no packet finds the job
        # without it.
        link = self._parent_commands(spec, uplink) if uplink else []
        tree = f"1 {spec.parent_slot_base}" if uplink else "0 0"
        out = self.cli.run(
            link
            + [
                f"table_add {T_JOBS} set_job {spec.job_id} => {spec.num_workers} "
                f"{wire.size_code_for(spec.elems)} {spec.slot_base} {end} {mgid} {tree} "
                f"{int(spec.sparse)} {int(spec.wire_bits == 16)}"
            ]
        )
        job = _SwitchJob(spec=spec, handle=_handle(out[-1]))
        if uplink:
            job.parent = _Parent(uplink.port, _handle(out[0]), _handle(out[1]))
        self._jobs[spec.job_id] = job

    def _check_parent(self, spec: JobSpec) -> PortSpec:
        """The port toward a rack job's parent; ValueError when the parent's key (its address,
        our uplink port) is another job's or worker's."""
        uplink = self.uplink_port_for(spec.parent_ip)
        key = (spec.parent_ip, spec.uplink_port)
        owner = self._owners().get(key)
        if owner is not None and owner[0] != spec.job_id:
            raise ValueError(
                f"{spec.parent_ip} -> port {spec.uplink_port:#x} is already worker {owner[1]} "
                f"of job {owner[0]}: choose another uplink port"
            )
        return uplink

    @staticmethod
    def _parent_commands(spec: JobSpec, uplink: PortSpec) -> list[str]:
        """The table entries of a rack job's parent link: how partial sums go up (parent_link:
        from our address on the port toward the parent, else the job's) and how the parent's
        results are recognised (workers: set_parent, any source MAC, as the XDP program and
        the model match the parent)."""
        mac = _mac_ok(_nonzero_mac(uplink.mac) or spec.agg_mac)
        ip = _nonzero_ip(uplink.ip) or spec.agg_ip
        return [
            f"table_add {T_PARENT_LINK} set_parent_link {spec.job_id} => "
            f"{_mac_ok(spec.parent_mac)} {spec.parent_ip} {spec.parent_port} "
            f"{spec.uplink_port} {uplink.port} {mac} {ip} {spec.slot_base} "
            f"{spec.parent_slot_base} {spec.agg_port}",
            f"table_add {T_WORKERS} set_parent {spec.parent_ip} {spec.uplink_port} 0&&&0 "
            f"=> {spec.job_id} 1",
        ]

    def delete_job(self, job_id: int) -> None:
        """Delete a job, its workers and its multicast group (a missing job is no error)."""
        job = self._jobs.get(job_id)
        if job is None:
            return
        cmds = []
        for index in list(job.workers):
            cmds += self._worker_removal(job, job.workers.pop(index))
        cmds += [f"table_delete {T_JOBS} {job.handle}", f"mc_mgrp_destroy {job.mgid}"]
        if job.parent is not None:  # after the jobs entry, as create_job adds them before it
            cmds += [
                f"table_delete {T_PARENT_LINK} {job.parent.link_handle}",
                f"table_delete {T_WORKERS} {job.parent.workers_handle}",
            ]
        del self._jobs[job_id]
        self.cli.run(cmds)

    def add_worker(self, worker: WorkerSpec) -> None:
        """Register a worker: recognised by (ip, agg_port), its copy sent to (mac, ip, port)."""
        self.add_workers([worker])

    def add_workers(self, workers: list[WorkerSpec]) -> None:
        """add_worker for several workers, in two CLI calls whatever their number (each call
        costs a few hundred milliseconds: a CLI process that loads the program's JSON)."""
        placed = []
        seen: dict[tuple[str, int], tuple[int, int]] = {}
        for worker in workers:
            job = self._check_worker(worker)
            key = (worker.ip, worker.agg_port)
            if seen.get(key, (worker.job_id, worker.index)) != (worker.job_id, worker.index):
                raise ValueError(f"{worker.ip} -> port {worker.agg_port:#x} is given twice")
            seen[key] = (worker.job_id, worker.index)
            port = self._port_of(worker)
            pspec = self.ports[port]
            agg_mac = _mac_ok(
                worker.extra.get("agg_mac") or _nonzero_mac(pspec.mac) or job.spec.agg_mac
            )
            agg_ip = worker.extra.get("agg_ip") or _nonzero_ip(pspec.ip) or job.spec.agg_ip
            placed.append((job, worker, port, agg_mac, agg_ip))
        removals = []
        for job, worker, *_ in placed:
            if worker.index in job.workers:  # re-registering an index (same address) updates it
                removals += self._worker_removal(job, job.workers.pop(worker.index))
        adds = []
        for job, worker, port, agg_mac, agg_ip in placed:
            adds += [
                f"table_add {T_WORKERS} set_worker {worker.ip} {worker.agg_port} "
                f"{_mac_match(worker.mac)} => {worker.job_id} {worker.index} 1",
                f"table_add {T_WORKER_ADDR} to_worker {worker.job_id} {worker.index} => "
                f"{_mac_ok(worker.mac)} {worker.ip} {worker.port} {agg_mac} {agg_ip}",
                f"mc_node_create {worker.index} {port}",
            ]
        out = self.cli.run(removals + adds)[len(removals) :]
        assoc = []
        for i, (job, worker, port, agg_mac, agg_ip) in enumerate(placed):
            node = _handle(out[3 * i + 2])
            assoc.append(f"mc_node_associate {job.mgid} {node}")
            job.workers[worker.index] = _Worker(
                spec=worker,
                port=port,
                agg_mac=agg_mac,
                agg_ip=agg_ip,
                workers_handle=_handle(out[3 * i]),
                addr_handle=_handle(out[3 * i + 1]),
                node_handle=node,
            )
        self.cli.run(assoc)

    def _check_worker(self, worker: WorkerSpec) -> _SwitchJob:
        """The worker's job; ValueError when the worker cannot be registered."""
        job = self._jobs.get(worker.job_id)
        check_worker(worker, job.spec if job else None, self._owners())
        return job

    def _owners(self) -> dict[tuple[str, int], tuple[int, int]]:
        """(ip, port) -> (job, index) of every entry of table workers: the workers, and each
        rack job's parent (index limits.PARENT_INDEX)."""
        owners = {
            (w.spec.ip, w.spec.agg_port): (j, w.spec.index)
            for j, o in self._jobs.items()
            for w in o.workers.values()
        }
        for j, o in self._jobs.items():
            if o.parent is not None:
                owners[(o.spec.parent_ip, o.spec.uplink_port)] = (j, limits.PARENT_INDEX)
        return owners

    def _port_of(self, worker: WorkerSpec) -> int:
        if "port" in worker.extra:
            port = int(worker.extra["port"])
            if port not in self.ports:
                raise ValueError(f"worker {worker.ip}: port {port} is not a port of this switch")
            return port
        agg_ip = worker.extra.get("agg_ip")
        for p in self.ports.values():
            if agg_ip and p.ip == agg_ip:
                return p.port
        raise ValueError(
            f"worker {worker.ip}: say which switch port it is behind (extra['port']), or "
            "register it through a port address (extra['agg_ip'] equal to a PortSpec.ip)"
        )

    def fill_worker(self, worker: WorkerSpec, local: tuple[str, int]) -> None:
        """ControlEndpoint hook: the address the worker reached the control endpoint at is our
        address on its port (as in the XDP switch topology), which tells the port."""
        worker.extra.setdefault("agg_ip", local[0])

    def remove_worker(self, job_id: int, index: int) -> None:
        """Unregister a worker (a missing one is no error)."""
        job = self._jobs.get(job_id)
        w = job.workers.pop(index, None) if job else None
        if w is not None:
            self.cli.run(self._worker_removal(job, w))

    @staticmethod
    def _worker_removal(job: _SwitchJob, w: _Worker) -> list[str]:
        return [
            f"mc_node_dissociate {job.mgid} {w.node_handle}",
            f"mc_node_destroy {w.node_handle}",
            f"table_delete {T_WORKERS} {w.workers_handle}",
            f"table_delete {T_WORKER_ADDR} {w.addr_handle}",
        ]

    def jobs(self) -> list[dict]:
        """The configured jobs, each a JobSpec.to_dict() with a 'workers' list."""
        out = []
        for job_id in sorted(self._jobs):
            job = self._jobs[job_id]
            d = job.spec.to_dict()
            d["workers"] = [
                {
                    **w.spec.to_dict(),
                    "switch_port": w.port,
                    "agg_mac": w.agg_mac,
                    "agg_ip": w.agg_ip,
                }
                for _, w in sorted(job.workers.items())
            ]
            out.append(d)
        return out

    def parent_status(self, job_id: int) -> dict | None:
        """A rack job's parent link and its counters, as the XDP target reports them (None for
        a job without a parent)."""
        job = self._jobs.get(job_id)
        if job is None or job.parent is None:
            return None
        spec, c = job.spec, self.counters(job_id)
        return {
            "address": f"{spec.parent_ip}:{spec.parent_port}",
            "uplink_port": spec.uplink_port,
            "parent_slot_base": spec.parent_slot_base,
            "switch_port": job.parent.port,
            "counters": {r: c[r] for r in reasons.PARENT_REASONS},
        }

    # --- counters ----------------------------------------------------------------------------
    def counters(self, job_id: int) -> dict[str, int]:
        """Packets by reason (lower-case reasons.Reason names) for a job id or limits.NO_JOB;
        ingress and egress counters added, as the XDP program's one counter row."""
        if not 0 <= job_id <= limits.NO_JOB:
            raise ValueError(f"job_id is a job id or limits.NO_JOB ({limits.NO_JOB})")
        return self.counter_rows([job_id])[job_id]

    def counter_rows(self, rows: list[int]) -> dict[int, dict[str, int]]:
        """counters() for several rows with one CLI call."""
        cmds = []
        for row in rows:
            for r in reasons.Reason:
                idx = keys.counter_key(row, int(r))
                cmds.append(f"counter_read {C_INGRESS} {idx}")
                cmds.append(f"counter_read {C_EGRESS} {idx}")
        outs = iter(self.cli.run(cmds))
        result = {}
        for row in rows:
            result[row] = {}
            for r in reasons.Reason:
                total = 0
                for _ in range(2):
                    m = _COUNTER_RE.search(next(outs))
                    if not m:
                        raise Bmv2Error("unexpected counter_read output")
                    total += int(m.group(3))
                result[row][r.name.lower()] = total
        return result


def _nonzero_mac(mac: str) -> str | None:
    return None if mac in ("", "00:00:00:00:00:00") else mac


def _nonzero_ip(ip: str) -> str | None:
    return None if ip in ("", "0.0.0.0") else ip
