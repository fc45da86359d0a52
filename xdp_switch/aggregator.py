"""An attached XDP aggregator: attach, detach, status, counters, and its job/worker Backend.

Two delivery modes (docs/protocol.md section 3.5):
- one-arm: a single interface; a finished sum is sent once, with XDP_TX, to the job's group
  address (multicast, or the subnet broadcast), which every worker receives;
- switch: several interfaces, one per worker port; the sum is broadcast through a devmap to every
  port, where the egress program addresses the copy to the job's worker behind that port.
Retransmissions of a completed slot are answered to their sender alone, in both modes.
"""

from __future__ import annotations

import dataclasses
import os
import time

import bpfsys
from aggproto import limits
from aggproto.jobs import Delivery, JobSpec, WorkerSpec

from . import abi, links, loader, pins
from .ctl_maps import AggMaps, ip_str, mac_str, port_ntoh

MODES = ("one-arm", "switch")


class AggregatorError(RuntimeError):
    """A control-plane operation failed; the message says what to do."""


def _check_root() -> None:
    if os.geteuid() != 0:
        raise AggregatorError("this needs root (BPF maps and XDP): run with sudo")


def attach(
    ifaces: list[str],
    *,
    name: str = "default",
    mode: str | None = None,
    xdp_mode: str = "native",
    pool_slots: int = limits.DEFAULT_POOL_SLOTS,
    netns: str | None = None,
    cflags: tuple[str, ...] = (),
    variant: str = "percpu",
) -> pins.State:
    """Load the program, pin it, and attach it to `ifaces` (in the current namespace).

    One interface means one-arm mode and several switch mode, unless `mode` says otherwise.
    Everything made is rolled back if a step fails.
    """
    _check_root()
    if not ifaces:
        raise AggregatorError("name at least one interface to attach to")
    mode = mode or ("one-arm" if len(ifaces) == 1 else "switch")
    if mode not in MODES:
        raise AggregatorError(f"mode must be one of {MODES}")
    if mode == "one-arm" and len(ifaces) != 1:
        raise AggregatorError("one-arm mode uses exactly one interface")
    if len(ifaces) > limits.MAX_PORTS:
        raise AggregatorError(f"at most {limits.MAX_PORTS} interfaces")
    inst = pins.Instance(name)
    if inst.exists():
        raise AggregatorError(
            f"an aggregator named {name!r} is already attached: `xdp-agg --name {name} detach` first, "
            "or attach another under a different --name"
        )
    if not pins.bpffs_mounted():
        raise AggregatorError(
            f"no bpffs at {pins.pin_root().parent}: mount it with `mount -t bpf bpf /sys/fs/bpf`"
        )
    infos = []
    for ifname in ifaces:
        try:
            cur = links.xdp_prog_id(ifname)
            info = links.addresses(ifname)
        except links.LinkError as e:
            raise AggregatorError(str(e)) from None
        if cur:
            raise AggregatorError(
                f"another XDP program (id {cur}) is already attached to {ifname}; remove it first "
                f"(`ip link set dev {ifname} xdp off`) if it is not needed"
            )
        infos.append(info)
    try:
        prog = loader.load(pool_slots=pool_slots, cflags=cflags, variant=variant)
    except loader.LoadError as e:
        raise AggregatorError(str(e)) from None
    done: list[dict] = []
    try:
        inst.pin(prog.maps, {"ingress": prog.progs[loader.PROG_INGRESS], "egress": prog.progs[loader.PROG_EGRESS]})
        maps = AggMaps(prog.maps, pool_slots)
        ingress_id = bpfsys.prog_info(prog.progs[loader.PROG_INGRESS]).id
        egress_id = bpfsys.prog_info(prog.progs[loader.PROG_EGRESS]).id
        for i, info in enumerate(infos):
            if mode == "switch":
                maps.set_port(i, info["ifindex"], prog.progs[loader.PROG_EGRESS])
            links.attach_xdp(info["ifname"], prog.progs[loader.PROG_INGRESS], xdp_mode)
            done.append({"ifname": info["ifname"], "ifindex": info["ifindex"], "prog_id": ingress_id})
        state = pins.State(
            name=name,
            mode=mode,
            xdp_mode=xdp_mode,
            netns=netns,
            interfaces=done,
            pool_slots=pool_slots,
            prog_id=ingress_id,
            egress_prog_id=egress_id,
            attached_at=time.time(),
            options={"cflags": list(cflags), "nr_cpus": prog.nr_cpus, "variant": variant},
        )
        inst.save_state(state)
        return state
    except Exception as e:
        for d in done:
            links.detach_xdp(d["ifname"], d["prog_id"])
        inst.remove()
        if isinstance(e, links.LinkError):
            raise AggregatorError(str(e)) from None
        raise
    finally:
        # The pins hold the program and maps now; drop this process's references.
        os.close(prog.maps["partials"])
        prog.bpf.cleanup()


def _enter_recorded_netns(state: pins.State | None) -> None:
    """Commands given without --netns act in the namespace `attach` ran in, if it still exists."""
    if state and state.netns and not links.in_netns(state.netns) and os.path.exists(f"/var/run/netns/{state.netns}"):
        links.enter_netns(state.netns)


def detach(name: str = "default") -> dict:
    """Remove what `attach` made: our program from each interface (only if it is still ours),
    the pins and the state file. Returns what was done."""
    _check_root()
    inst = pins.Instance(name)
    if not inst.exists():
        raise AggregatorError(f"no aggregator named {name!r} is attached (see `xdp-agg status`)")
    report = {"name": name, "detached": [], "left_alone": []}
    try:
        state = inst.load_state()
    except FileNotFoundError:
        state = None
    _enter_recorded_netns(state)
    for d in state.interfaces if state else []:
        try:
            ok = links.detach_xdp(d["ifname"], d["prog_id"])
        except links.LinkError:
            ok = False
        (report["detached"] if ok else report["left_alone"]).append(d["ifname"])
    inst.remove()
    return report


def open_instance(name: str = "default") -> tuple[pins.State, AggMaps]:
    """The state and maps of an attached aggregator."""
    inst = pins.Instance(name)
    try:
        state = inst.load_state()
        fds = inst.open_maps()
    except FileNotFoundError as e:
        raise AggregatorError(f"{e}: attach one with `xdp-agg attach IFACE`") from None
    except PermissionError:
        raise AggregatorError("reading the aggregator's maps needs root: run with sudo") from None
    return state, AggMaps(fds, state.pool_slots)


def status(name: str = "default") -> dict:
    """Program, interfaces (and whether our program is still on each), jobs."""
    state, maps = open_instance(name)
    _enter_recorded_netns(state)
    ifaces = []
    for d in state.interfaces:
        try:
            cur = links.xdp_prog_id(d["ifname"])
        except links.LinkError:
            cur = None
        ifaces.append({**d, "attached": cur == d["prog_id"], "current_prog_id": cur})
    jobs = [job_dict(j, job, maps) for j, job in maps.jobs().items()]
    return {**state.to_dict(), "interfaces": ifaces, "jobs": jobs}


def job_dict(job_id: int, job: abi.Job, maps: AggMaps) -> dict:
    workers = sorted(
        (
            {"index": w.index, "ip": ip_str(k.addr), "agg_port": port_ntoh(k.port)}
            for k, w in maps.workers()
            if w.job == job_id
        ),
        key=lambda w: w["index"],
    )
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
        "workers": workers,
    }


def stats(name: str = "default") -> dict:
    """Counters by reason: for packets without a job, per job, and per worker."""
    _, maps = open_instance(name)
    out = {"unattributed": maps.counters(limits.NO_JOB), "jobs": {}}
    for j, job in maps.jobs().items():
        workers = {}
        for _, w in maps.workers():
            if w.job == j:
                workers[w.index] = maps.worker_counters(j, w.index)
        out["jobs"][j] = {"reasons": maps.counters(j), "workers": dict(sorted(workers.items()))}
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
    for v in (0, 1):
        res = maps.result(g, v)
        out["versions"].append(
            {
                "version": v,
                "seen": f"{st.seen[v]:#x}",
                "arrivals": st.arrivals[v],
                "added": st.added[v],
                "published": st.published[v],
                "result_e0": res.e0,
                "result_head": [int.from_bytes(int(x).to_bytes(4, "little"), "big", signed=True) for x in res.data[:8]],
                "partial_tags": [f"{p.tag:#x}" for p in maps.partials(g, v)],
            }
        )
    return out


class XdpBackend:
    """The Backend (job/worker vocabulary) of an attached XDP aggregator."""

    def __init__(self, name: str = "default") -> None:
        self.name = name
        self.state, self.maps = open_instance(name)

    def create_job(self, spec: JobSpec) -> None:
        if self.state.mode == "switch":  # every result through the devmap; the caller's spec stays
            spec = dataclasses.replace(spec, delivery=Delivery.BROADCAST)
        self.maps.create_job(spec)

    def delete_job(self, job_id: int) -> None:
        self.maps.delete_job(job_id)

    def add_worker(self, worker: WorkerSpec) -> None:
        """In switch mode, also find the port the worker is behind and our address there."""
        ifindex = agg_ip = agg_mac = None
        if self.state.mode == "switch":
            ifindex, agg_ip, agg_mac = self._port_of(worker)
        self.maps.add_worker(worker, ifindex=ifindex or 0, agg_ip=agg_ip, agg_mac=agg_mac)

    def _port_of(self, worker: WorkerSpec):
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            route = ipr.route("get", dst=worker.ip)[0]
            oif = route.get_attr("RTA_OIF")
            src = route.get_attr("RTA_PREFSRC")
            link = ipr.get_links(oif)[0]
        ours = {d["ifindex"] for d in self.state.interfaces}
        if oif not in ours:
            raise ValueError(f"worker {worker.ip} is reached through ifindex {oif}, not an attached port")
        return oif, worker.extra.get("agg_ip") or src, link.get_attr("IFLA_ADDRESS")

    def remove_worker(self, job_id: int, index: int) -> None:
        self.maps.remove_worker(job_id, index)

    def jobs(self) -> list[dict]:
        return [job_dict(j, job, self.maps) for j, job in self.maps.jobs().items()]

    def worker_counters(self, job_id: int) -> dict[int, dict]:
        return {w.index: self.maps.worker_counters(job_id, w.index) for _, w in self.maps.workers() if w.job == job_id}
