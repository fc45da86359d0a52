"""An attached XDP aggregator: attach, detach, status, counters, and its job/worker Backend.

Two topologies (docs/protocol.md section 3.5; the same words as netns_testbed's `topology`):
- one-arm: a single interface; a finished sum is sent once, with XDP_TX, to the job's group
  address (multicast, or the subnet broadcast), which every worker receives (a job's delivery
  is then Delivery.GROUP_TX);
- switch: several interfaces, one per worker port; the sum is broadcast through a devmap to every
  port, where the egress program addresses the copy to the job's worker behind that port
  (Delivery.BROADCAST).
Retransmissions of a completed slot are answered to their sender alone, in both. Apart from the
topology, `xdp_mode` says how XDP is attached to each interface: "native" (in the driver) or
"skb" (generic XDP, any interface).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from xdp_agg import bpfsys
from xdp_agg.codegen import abi
from xdp_agg.ctl.backend import KernelProgram, KernelStats
from xdp_agg.errors import EnvironmentProblem, LiveJobs, NeedsRoot, Refused, XdpAggError
from xdp_agg.proto import limits, wire
from xdp_agg.proto.jobs import Delivery, JobSpec, WorkerSpec, mac_bytes
from xdp_agg.proto.reasons import PARENT_REASONS

from . import forwarding, links, loader, pins
from . import slot_cpus as cpu_table
from .attach_options import AttachOptions
from .ctl_maps import SPARSE_MAX_ELEMS, AggMaps, ip_str, mac_str, port_ntoh

# The pinned programs of an attachment (pins.Instance.prog_path): the aggregator on the
# interfaces ("ingress"), or with --slot-cpus cpumap the steering program there ("steer") and the
# aggregator on the cpumap's CPUs ("cpumap"); and the egress program that addresses a
# switch-topology result to the worker behind each port ("egress"), and the one that addresses
# each copy of a unicast result to its worker ("copy").
PROGRAMS = ("ingress", "steer", "cpumap", "egress", "copy")

# How a job's results leave in each topology (JobSpec.delivery).
DELIVERY = {"one-arm": Delivery.GROUP_TX, "switch": Delivery.BROADCAST}


class AggregatorError(XdpAggError):
    """A control-plane operation failed; the message says what to do."""


def _check_root(what: str) -> None:
    if os.geteuid() != 0:
        raise NeedsRoot(what)


def default_topology(ifaces: list[str]) -> str:
    """One interface: one-arm; several: switch."""
    return "one-arm" if len(ifaces) == 1 else "switch"


def attach(
    ifaces: list[str],
    opts: AttachOptions | None = None,
    *,
    name: str = "default",
    netns: str | None = None,
) -> pins.State:
    """Load the program, pin it, and attach it to `ifaces` (in the current namespace) as `opts`
    say (default: AttachOptions()); the state records them as attached (AttachOptions.resolved).

    `opts.topology` None is one-arm for one interface, switch for several. `opts.frags`: load it
    as an XDP multi-buffer program, which takes frames larger than a page (jumbo jobs, 1024 and
    2048 int32 per packet) and attaches where the link's MTU is above what one page holds (a
    veth whose peer has MTU 9000). `opts.slot_cpus` "cpumap" aggregates each slot on the one CPU
    of `opts.cpus` (default: the CPUs this process may run on) that xdp_switch.slot_cpus assigns
    it. Everything made is rolled back if a step fails. Raises XdpAggError subclasses
    (NeedsRoot, EnvironmentProblem, AggregatorError, LinkError, LoadError) with what to do.
    """
    opts = opts or AttachOptions()
    _check_root("attaching the aggregator (BPF maps and XDP)")
    if not ifaces:
        raise AggregatorError("name at least one interface to attach to")
    topology = opts.topology or default_topology(ifaces)
    if topology == "one-arm" and len(ifaces) != 1:
        raise AggregatorError("the one-arm topology uses exactly one interface (several: switch)")
    if len(ifaces) > limits.MAX_PORTS:
        raise AggregatorError(f"at most {limits.MAX_PORTS} interfaces")
    inst = pins.Instance(name)
    if inst.exists():
        raise AggregatorError(
            f"an aggregator named {name!r} is already attached ({_describe_attachment(inst)}): "
            f"`xdp-agg --name {name} detach` first, or attach another under a different --name"
        )
    if not pins.bpffs_mounted():
        raise EnvironmentProblem(
            f"no bpffs at {pins.pin_root().parent}: mount it with `mount -t bpf bpf /sys/fs/bpf`"
        )
    infos = []
    for ifname in ifaces:
        cur = links.xdp_prog_id(ifname)
        if cur:
            raise AggregatorError(
                f"another XDP program (id {cur}) is already attached to {ifname}; remove it first "
                f"(`ip link set dev {ifname} xdp off`) if it is not needed"
            )
        infos.append(links.addresses(ifname))
    prog = loader.load(
        pool_slots=opts.pool_slots,
        cflags=opts.cflags,
        variant=opts.variant,
        frags=opts.frags,
        slot_cpus=opts.slot_cpus,
        # the cpumap build attaches xdp_agg_cpumap, the same code: the plain one is the tests'
        skip=(loader.PROG_INGRESS,) if opts.slot_cpus == "cpumap" else (),
    )
    done: list[dict] = []
    sysctls: dict[str, str] = {}
    try:
        fwd = _forwarding_mode(opts, topology, infos)
        attached = opts.resolved(ifaces, cpu_table.default_cpus(), fwd)
        cpumap = attached.slot_cpus == "cpumap"
        pinned = _pinned_programs(prog)
        inst.pin(prog.maps, pinned)
        maps = AggMaps(prog.maps, opts.pool_slots)
        if cpumap:
            cpu_table.install(
                prog.maps, pinned["cpumap"], list(attached.cpus or ()), opts.pool_slots
            )
        on_links = pinned["steer" if cpumap else "ingress"]
        ingress_id = bpfsys.prog_info(on_links).id
        egress_id = bpfsys.prog_info(prog.progs[loader.PROG_EGRESS]).id
        egress = prog.progs[loader.PROG_EGRESS if topology == "switch" else loader.PROG_COPY]
        for i, info in enumerate(infos):
            if topology == "switch":
                maps.set_port(i, info["ifindex"], egress)
            if cpumap:
                cpu_table.send_back(prog.maps, info["ifindex"], egress)
            links.attach_xdp(info["ifname"], on_links, opts.xdp_mode)
            done.append(
                {"ifname": info["ifname"], "ifindex": info["ifindex"], "prog_id": ingress_id}
            )
        if fwd == "routed":
            sysctls = forwarding.enable_kernel_forwarding([i["ifname"] for i in infos])
        if fwd != "off":
            forwarding.install(prog.maps, fwd, infos, egress)
        state = pins.State(
            name=name,
            topology=topology,
            xdp_mode=opts.xdp_mode,
            netns=netns,
            interfaces=done,
            pool_slots=opts.pool_slots,
            prog_id=ingress_id,
            egress_prog_id=egress_id,
            attached_at=time.time(),
            options={**attached.to_dict(), "nr_cpus": prog.nr_cpus},
            sysctls=sysctls,
        )
        inst.save_state(state)
        return state
    except BaseException:
        for d in done:
            links.detach_xdp(d["ifname"], d["prog_id"])
        forwarding.restore_sysctls(sysctls)
        inst.remove()
        raise
    finally:
        # The pins hold the program and maps now; drop this process's references.
        prog.close()


def _forwarding_mode(opts: AttachOptions, topology: str, infos: list[dict]) -> str:
    """The forwarding mode of this attachment (xdp_switch.forwarding): as asked, or the
    ports' default."""
    mode = opts.forwarding or forwarding.default_mode(topology, infos)
    why = forwarding.check_mode(mode, topology, infos)
    if why:
        raise AggregatorError(why)
    return mode


def _pinned_programs(prog: loader.Loaded) -> dict[str, int]:
    """The programs to pin, by their PROGRAMS name."""
    if prog.options["slot_cpus"] == "cpumap":
        on_links = {
            "steer": prog.progs[loader.PROG_STEER],
            "cpumap": prog.progs[loader.PROG_CPUMAP],
        }
    else:
        on_links = {"ingress": prog.progs[loader.PROG_INGRESS]}
    return {
        **on_links,
        "egress": prog.progs[loader.PROG_EGRESS],
        "copy": prog.progs[loader.PROG_COPY],
    }


def _describe_attachment(inst: pins.Instance) -> str:
    """'to eth0 (one-arm, program id 42, netns agg)', or what is left of one without state."""
    try:
        st = inst.load_state()
    except XdpAggError:
        return f"pins in {inst.dir} without a readable state file"
    where = f", netns {st.netns}" if st.netns else ""
    ifaces = ", ".join(i["ifname"] for i in st.interfaces)
    return f"to {ifaces} ({st.topology}, program id {st.prog_id}{where})"


def live_jobs(name: str) -> list[dict]:
    """The jobs in aggregator `name`'s maps: {job_id, workers, key (serve's name for it, if
    its job table says)}."""
    try:
        _, maps = open_instance(name)
        jobs = maps.jobs()
    except XdpAggError:  # nothing readable: nothing that detach would end
        return []
    keys = {}
    table = pins.state_dir() / f"{name}.jobs"
    try:
        for rec in json.loads(table.read_text()).get("jobs", []):
            keys[rec["spec"]["job_id"]] = rec["key"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    out = []
    for j, job in sorted(jobs.items()):
        n = sum(1 for _, w in maps.workers() if w.job == j)
        out.append({"job_id": j, "workers": f"{n}/{job.num_workers}", "key": keys.get(j)})
    return out


def _enter_recorded_netns(state: pins.State | None) -> None:
    """Commands given without --netns act in the namespace `attach` ran in, if it still exists."""
    if (
        state
        and state.netns
        and not links.in_netns(state.netns)
        and os.path.exists(f"/var/run/netns/{state.netns}")
    ):
        links.enter_netns(state.netns)


def detach(name: str = "default", *, force: bool = False) -> dict:
    """Remove what `attach` made: our program from each interface (only if it is still ours),
    the pins and the state file. Returns what was done.

    With jobs in the maps it raises LiveJobs listing them, unless `force`: their workers would
    lose their aggregator mid-run (they then fail with an error saying its state is gone)."""
    _check_root("detaching the aggregator")
    inst = pins.Instance(name)
    if not inst.exists():
        raise pins.NotAttached(name, inst.state_path)
    live = [] if force else live_jobs(name)
    if live:
        listed = "; ".join(
            f"job {j['job_id']}" + (f" {j['key']!r}" if j["key"] else "") + f" ({j['workers']} "
            "workers)"
            for j in live
        )
        raise LiveJobs(
            f"aggregator {name!r} has {len(live)} live job(s): {listed}. Detaching ends them "
            f"mid-run: wait for them to finish, or `xdp-agg --name {name} detach --force`"
        )
    report = {"name": name, "detached": [], "left_alone": []}
    try:
        state = inst.load_state()
    except XdpAggError:  # pins without a (readable) state file: remove the pins all the same
        state = None
    _enter_recorded_netns(state)
    if state and state.sysctls:
        report["sysctls_left"] = forwarding.restore_sysctls(state.sysctls)
    for d in state.interfaces if state else []:
        try:
            ok = links.detach_xdp(d["ifname"], d["prog_id"])
        except links.LinkError:
            ok = False
        (report["detached"] if ok else report["left_alone"]).append(d["ifname"])
    inst.remove()
    return report


def open_instance(name: str = "default") -> tuple[pins.State, AggMaps]:
    """The state and maps of an attached aggregator (pins.NotAttached if there is none)."""
    inst = pins.Instance(name)
    state = inst.load_state()
    return state, AggMaps(inst.open_maps(), state.pool_slots)


def status(name: str = "default") -> dict:
    """Program, interfaces (and whether our program is still on each), jobs; "options": how
    it was attached (every AttachOptions field: an older version's state gets the defaults of
    what it did not record)."""
    state, maps = open_instance(name)
    _enter_recorded_netns(state)
    ifaces = []
    for d in state.interfaces:
        try:
            cur = links.xdp_prog_id(d["ifname"])
        except links.LinkError:
            cur = None
        ifaces.append({**d, "attached": cur == d["prog_id"], "current_prog_id": cur})
    registered = maps.workers()
    jobs = [job_dict(j, job, maps, registered) for j, job in maps.jobs().items()]
    options = {**state.options, **state.attach_options().to_dict()}
    fwd = forwarding.status(maps.fds, maps.ncpu)
    return {
        **state.to_dict(),
        "options": options,
        "interfaces": ifaces,
        "jobs": jobs,
        "forwarding": fwd,
    }


@dataclasses.dataclass(frozen=True)
class _Route:
    """What the kernel's routing table says of a worker's address (`ip route get ADDR`)."""

    oif: int | None = None  # the interface it is reached through
    src: str | None = None  # our preferred source address there
    gateway: str | None = None  # None: on-link
    port_mac: str | None = None  # the MAC of that interface
    error: str | None = None  # why there is no route (then nothing else is set)

    @property
    def on_link(self) -> bool:
        """Reached without a gateway, so that frames from it carry its own source MAC (the one
        a worker registers with, which the XDP program then matches)."""
        return self.error is None and self.gateway is None


def _route_to(ip: str) -> _Route:
    """One route lookup for a worker's address (both of add_worker's questions)."""
    from pyroute2 import IPRoute, NetlinkError

    with IPRoute() as ipr:
        try:
            route = ipr.route("get", dst=ip)[0]
        except NetlinkError as e:
            return _Route(error=os.strerror(e.code))
        oif = route.get_attr("RTA_OIF")
        link = ipr.get_links(oif)[0]
    return _Route(
        oif=oif,
        src=route.get_attr("RTA_PREFSRC"),
        gateway=route.get_attr("RTA_GATEWAY"),
        port_mac=link.get_attr("IFLA_ADDRESS"),
    )


def _copy_mac(worker: WorkerSpec, route: _Route) -> str:
    """Where a unicast copy for `worker` goes first: its own MAC on the link (the one it
    registered, else the neighbour table's), or its gateway's. Refused when neither is known."""
    if route.error is not None:
        raise Refused(f"no route to worker {worker.ip}: {route.error}")
    if route.on_link and any(mac_bytes(worker.mac)):
        return worker.mac
    hop = worker.ip if route.on_link else route.gateway
    mac = links.neighbour_mac(hop, route.oif)
    if mac is None:
        raise Refused(
            f"worker {worker.index} of job {worker.job_id}: unicast results need the MAC of "
            f"{hop}, which the neighbour table does not have: register the worker's MAC, or "
            f"reach {hop} once (`ping -c1 {hop}`) so that the kernel resolves it"
        )
    return mac


def job_dict(job_id: int, job: abi.Job, maps: AggMaps, registered=None) -> dict:
    """The job as JobSpec.to_dict() has it, with its workers and parent link; `registered`:
    maps.workers() if the caller has read it already (once for all jobs: reading the workers
    map is most of the cost)."""
    registered = maps.workers() if registered is None else registered
    workers = sorted(
        (
            {
                "index": w.index,
                "ip": ip_str(k.addr),
                "agg_port": port_ntoh(k.port),
                # the source MAC its frames must come from; all zeros: not matched
                "mac": mac_str(w.mac) if w.match_mac else "00:00:00:00:00:00",
            }
            for k, w in registered
            if w.job == job_id and w.index != limits.PARENT_INDEX
        ),
        key=lambda w: w["index"],
    )
    link = maps.parent_link(job_id)
    tree = {
        "parent_ip": "0.0.0.0",
        "parent_mac": "00:00:00:00:00:00",
        "parent_port": 0,
        "parent_slot_base": 0,
        "uplink_port": 0,
        "worker_port": 0,
        "total_workers": 0,  # not kept by the data path (the hosts' scaling uses it)
    }
    tree.update(link or {})
    return {  # JobSpec.to_dict()'s keys, and the workers
        "job_id": job_id,
        "num_workers": job.num_workers,
        "elems": job.elems,
        "slot_base": job.slot_base,
        "slot_count": job.slot_count,
        "agg_port": job.agg_port,
        "delivery": Delivery(job.delivery).name.lower(),
        "agg_ip": ip_str(job.agg_ip),
        "agg_mac": mac_str(job.agg_mac),
        "group_ip": ip_str(job.group_ip),
        "group_mac": mac_str(job.group_mac),
        "job_number": 0,  # not kept by the data path
        "udp_checksum": bool(job.flags & abi.JobFlag.VERIFY_UDP_CSUM),
        "sparse": bool(job.flags & abi.JobFlag.SPARSE),
        "wire_bits": 16 if job.flags & abi.JobFlag.WIRE16 else 32,
        # not kept by the data path: what this target asks of every sparse job (pads_empty)
        "pad_empty": bool(job.flags & abi.JobFlag.SPARSE),
        **tree,
        "workers": workers,
        "parent": parent_status(maps, job_id, link),
    }


# The counters of a tree job's parent link (docs/protocol.md section 3.7).


def parent_status(maps: AggMaps, job_id: int, link: dict | None = None) -> dict | None:
    """A tree job's parent link and its counters; None for a job without a parent."""
    link = link if link is not None else maps.parent_link(job_id)
    if link is None:
        return None
    c = maps.counters(job_id)
    return {
        "address": f"{link['parent_ip']}:{link['parent_port']}",
        "uplink_port": link["uplink_port"],
        "parent_slot_base": link["parent_slot_base"],
        "counters": {r: c[r] for r in PARENT_REASONS},
    }


def stats(name: str = "default") -> dict:
    """Counters by reason: for packets without a job, per job, and per worker."""
    _, maps = open_instance(name)
    out = {"unattributed": maps.counters(limits.NO_JOB), "jobs": {}}
    registered = maps.workers()
    for j, job in maps.jobs().items():
        workers = {}
        for _, w in registered:
            if w.job == j and w.index != limits.PARENT_INDEX:
                workers[w.index] = maps.worker_counters(j, w.index)
        out["jobs"][j] = {"reasons": maps.counters(j), "workers": dict(sorted(workers.items()))}
        parent = parent_status(maps, j)
        if parent is not None:
            out["jobs"][j]["parent"] = parent
    return out


def slot_state(g: int, name: str = "default") -> dict:
    """One slot's shared state, both versions, with the per-CPU partial tags (for debugging)."""
    _, maps = open_instance(name)
    st = maps.slot(g)
    owner = None
    for j, job in maps.jobs().items():
        if job.slot_base <= g < job.slot_base + job.slot_count:
            owner = j
    out = {"slot": g, "job": owner, "versions": []}
    if "slot_cpu" in maps.fds:  # --slot-cpus cpumap: the CPU its packets are steered to
        out["cpu"] = cpu_table.slot_owner(maps.fds, g)
    for v in (0, 1):
        res = maps.result(g, v)
        out["versions"].append(
            {
                "version": v,
                "seen": f"{st.seen[v]:#x}",
                "arrivals": st.arrivals[v],
                "added": st.added[v],
                "published": st.published[v],
                "up": st.up[v],  # tree jobs: rounds complete here and sent to the parent
                "result_e0": res.e0,
                "result_head": [
                    int.from_bytes(int(x).to_bytes(4, "little"), "big", signed=True)
                    for x in res.data[:8]
                ],
                "partial_tags": [f"{p.tag:#x}" for p in maps.partials(g, v)],
            }
        )
    return out


class XdpBackend:
    """The Backend (job/worker vocabulary) of an attached XDP aggregator.

    A spec the aggregator cannot serve raises Refused (an XdpAggError and a ValueError, as the
    Backend contract asks)."""

    def __init__(self, name: str = "default") -> None:
        self.name = name
        self.state, self.maps = open_instance(name)
        self._created: set[int] = set()  # job ids created through us on this attachment
        self._lost: dict[int, str] = {}  # job id -> why its state is gone (re-attached)
        self._seen: int | None = self.state.prog_id  # the attachment _follow last saw (None:
        # detached; our maps are then the old ones until there is a new attachment)

    # The aggregator's state can be lost under a running control endpoint: `detach --force`
    # and `attach` again under the same name make new, empty maps, while ours still hold the
    # old ones. _follow notices (the state file names another program) and switches to the new
    # maps; the jobs made on the old ones are "lost": deleting them or their workers touches
    # nothing in the new aggregator, and the diagnosis says so (job_lost). A fresh pool cannot
    # give such a job's workers a wrong sum: their (address, aggregator port) is registered in
    # no job of the new program, so their packets are dropped as drop_unknown_source before
    # any slot is touched; and the control endpoint keeps the lost job's id, slots and port
    # reserved until its ranks are gone, so no new job can take that port and adopt the stale
    # packets.
    def generation(self) -> int:
        """Which attachment this is (its program id): xdp_agg.ctl.jobtable keeps it with the
        table."""
        return self.state.prog_id

    def _follow(self) -> None:
        try:
            now = pins.Instance(self.name).load_state()
        except XdpAggError:
            now = None
        seen, self._seen = self._seen, (now.prog_id if now is not None else None)
        if now is not None and now.prog_id == self.state.prog_id:
            return
        if self._seen == seen and now is None:
            return  # still detached: what was made on the old maps is lost already
        if now is None:
            why = f"aggregator {self.name!r} was detached"
        else:
            why = (
                f"aggregator {self.name!r} was detached and attached again (program id "
                f"{self.state.prog_id} -> {now.prog_id}): its job state is gone"
            )
        for j in self._created:
            self._lost[j] = why
        self._created = set()
        if now is None:
            return  # keep the old maps until there is a new attachment to follow
        try:
            self.state, self.maps = open_instance(self.name)
        except XdpAggError:
            return

    def job_lost(self, job_id: int) -> str | None:
        """Why job `job_id` is no longer in the aggregator, or None while it is there."""
        self._follow()
        if job_id in self._lost:
            return self._lost[job_id]
        if self._seen is None:
            return f"aggregator {self.name!r} is not attached (it was detached)"
        if self.maps.get_job(job_id) is None:
            return f"job id {job_id} is not in aggregator {self.name!r} any more (deleted?)"
        return None

    def elem_sizes(self) -> tuple[int, ...]:
        """The packet sizes this attachment takes: the jumbo ones (larger than a page) only
        with --frags and in the one-arm topology (create_job says why not)."""
        jumbo = {wire.elems_for(c) for c in wire.JUMBO_SIZE_CODES}
        frags = self.state.attach_options().frags and self.state.topology != "switch"
        return tuple(sorted(n for n in wire.SIZE_CODE_ELEMS.values() if frags or n not in jumbo))

    def sparse_elems(self) -> tuple[int, ...]:
        """The sizes of elem_sizes() a sparse job may have: not the jumbo ones, whose results an
        empty contribution's frame cannot grow into (xdp_switch/ctl_maps.py)."""
        return tuple(n for n in self.elem_sizes() if n <= SPARSE_MAX_ELEMS)

    def pads_empty(self) -> bool:
        """Yes: a result is written into the frame that completes or asks, which
        bpf_xdp_adjust_tail grows within its buffer only (on veth: not at all)."""
        return True

    def create_job(self, spec: JobSpec) -> None:
        """Create (or replace) a job; in the switch topology its delivery is always BROADCAST."""
        self._follow()
        self._lost.pop(spec.job_id, None)
        self._created.add(spec.job_id)
        if self.state.topology == "switch":  # every result through the devmap; caller's spec stays
            spec = dataclasses.replace(spec, delivery=DELIVERY["switch"])
        jumbo = {wire.elems_for(c) for c in wire.JUMBO_SIZE_CODES}
        attached = self.state.attach_options()
        if spec.elems in jumbo and not attached.frags:
            raise Refused(
                f"job {spec.job_id}: {spec.elems} elements per packet are frames larger than a "
                f"page, which aggregator {self.name!r} cannot see: attach it with --frags "
                "(an XDP multi-buffer program)"
            )
        if spec.elems in jumbo and spec.delivery != Delivery.GROUP_TX:
            # measured on 6.18 veth: no devmap broadcast of a multi-buffer result reached a port
            # (every packet of a 2048-element job needed a retransmission, answered by XDP_TX);
            # redirecting multi-buffer frames was refused outright when frags came in (kernel
            # 5.18, net/core/filter.c xdp_do_redirect: "not fully supported yet")
            raise Refused(
                f"job {spec.job_id}: {spec.elems} elements per packet need group delivery in "
                f"the one-arm topology: {spec.delivery.name.lower()} delivery broadcasts results "
                "through a devmap, which does not carry multi-buffer frames"
            )
        copies = None
        if spec.delivery == Delivery.UNICAST:
            ifindex = self.state.interfaces[0]["ifindex"]  # one-arm: the one interface
            copies = (ifindex, pins.Instance(self.name).open_prog("copy"))
        try:
            self.maps.create_job(spec, copies)
        except Refused:
            raise
        except ValueError as e:  # the contract's checks, or an address that does not parse
            raise Refused(f"job {spec.job_id}: {e}") from e
        finally:
            if copies is not None:
                os.close(copies[1])
        if attached.slot_cpus == "cpumap":
            cpu_table.assign_job(
                self.maps.fds, spec.slot_base, spec.slot_count, list(attached.cpus or ())
            )

    def add_worker(self, worker: WorkerSpec) -> None:
        """Register a worker; in the switch topology also find the port it is behind and our
        address there."""
        self._follow()
        if worker.job_id in self._lost:
            raise Refused(f"job {worker.job_id}: {self._lost[worker.job_id]}")
        ifindex = agg_ip = agg_mac = None
        route = _route_to(worker.ip)
        if self.state.topology == "switch":
            ifindex, agg_ip, agg_mac = self._port_of(worker, route)
        job = self.maps.get_job(worker.job_id)
        copy_mac = None
        if job is not None and job.delivery == Delivery.UNICAST:
            copy_mac = _copy_mac(worker, route)
        if not route.on_link:
            # behind a router its frames carry the router's MAC: match its address and port only
            worker = dataclasses.replace(worker, mac="00:00:00:00:00:00")
        try:
            self.maps.add_worker(
                worker, ifindex=ifindex or 0, agg_ip=agg_ip, agg_mac=agg_mac, copy_mac=copy_mac
            )
        except Refused:
            raise
        except ValueError as e:
            raise Refused(f"worker {worker.index} of job {worker.job_id}: {e}") from e

    def _port_of(self, worker: WorkerSpec, route: _Route):
        """(ifindex, our address, our MAC) of the attached port the worker is behind."""
        if route.error is not None:
            raise Refused(f"no route to worker {worker.ip}: {route.error}")
        ours = {d["ifindex"] for d in self.state.interfaces}
        if route.oif not in ours:
            raise Refused(
                f"worker {worker.ip} is reached through ifindex {route.oif}, not an attached "
                "port: check the worker's address and the routes (`ip route get ADDR`)"
            )
        return route.oif, worker.extra.get("agg_ip") or route.src, route.port_mac

    def delete_job(self, job_id: int) -> None:
        """Delete a job and its workers (nothing happens for a job that does not exist, or was
        lost with an earlier attachment)."""
        self._follow()
        self._created.discard(job_id)
        if self._lost.pop(job_id, None) is None:
            self.maps.delete_job(job_id)

    def remove_worker(self, job_id: int, index: int) -> None:
        """Unregister a worker (of a job lost with an earlier attachment: nothing to do)."""
        self._follow()
        if job_id not in self._lost:
            self.maps.remove_worker(job_id, index)

    def jobs(self) -> list[dict]:
        """The active jobs, each as job_dict gives it."""
        self._follow()
        registered = self.maps.workers()
        return [job_dict(j, job, self.maps, registered) for j, job in self.maps.jobs().items()]

    def parent_status(self, job_id: int) -> dict | None:
        """A tree job's parent link and its counters (None without a parent)."""
        return parent_status(self.maps, job_id)

    def counters(self, job_id: int) -> dict[str, int]:
        """A job's counters by reason, summed over CPUs."""
        return self.maps.counters(job_id)

    def all_worker_counters(self) -> dict[int, dict[int, dict]]:
        """worker_counters of every job at once, {job id: {worker index: counters}}: the
        workers map read once, where worker_counters per job reads it once per job (what a
        metrics scrape of many jobs would spend most of its time on)."""
        out: dict[int, dict[int, dict]] = {}
        for _, w in self.maps.workers():
            if w.index != limits.PARENT_INDEX and w.job not in self._lost:
                out.setdefault(w.job, {})[w.index] = self.maps.worker_counters(w.job, w.index)
        return {j: dict(sorted(ws.items())) for j, ws in sorted(out.items())}

    def forwarding_stats(self) -> dict:
        """The switch topology's forwarding: mode, counters, learned MACs (forwarding.status)."""
        self._follow()
        return forwarding.status(self.maps.fds, self.maps.ncpu)

    def program_stats(self) -> KernelStats:
        """The attached programs' run time and runs (the kernel counts them only while
        kernel.bpf_stats_enabled = 1: `bpf_stats_enabled` says whether it does), each one's id
        and tag, and the kernel memory of each program and map, in bytes."""
        self._follow()
        inst = pins.Instance(self.name)
        programs = {}
        for prog in PROGRAMS:
            if not inst.prog_path(prog).exists():
                continue  # no egress program pinned: an aggregator attached before it had one
            fd = inst.open_prog(prog)
            try:
                info = bpfsys.prog_info(fd)
                programs[prog] = KernelProgram(
                    run_time_ns=info.run_time_ns,
                    run_cnt=info.run_cnt,
                    memlock=bpfsys.memlock(fd),
                    id=info.id,
                    tag=bytes(info.tag).hex(),
                )
            finally:
                os.close(fd)
        return KernelStats(
            bpf_stats_enabled=bpfsys.bpf_stats_enabled(),
            programs=programs,
            maps={m: bpfsys.memlock(fd) for m, fd in sorted(self.maps.fds.items())},
        )

    def worker_counters(self, job_id: int) -> dict[int, dict]:
        """Per-worker counters of a job, by worker index (none for a lost job)."""
        if job_id in self._lost:
            return {}
        return {
            w.index: self.maps.worker_counters(job_id, w.index)
            for _, w in self.maps.workers()
            if w.job == job_id and w.index != limits.PARENT_INDEX
        }
