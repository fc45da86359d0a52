"""Typed access to the aggregator's maps: jobs, workers, ports, slots and counters.

Everything the control plane writes or reads goes through here, with the ctypes structures of
xdp_agg.codegen.abi, so the Python side and bpf/generated/abi.h share one definition.
"""

from __future__ import annotations

import ctypes as ct
import ipaddress
import os
import socket
import time

from xdp_agg import bpfsys
from xdp_agg.codegen import abi
from xdp_agg.ctl.backend import check_job, check_worker
from xdp_agg.proto import keys, limits, wire
from xdp_agg.proto.jobs import Delivery, JobSpec, WorkerSpec, mac_bytes
from xdp_agg.proto.reasons import Reason

from . import loader

# The largest packet of a sparse job: its result, written into whatever packet completes or asks
# for it, must fit the buffer of an empty contribution (docs/protocol.md 8.3).
SPARSE_MAX_ELEMS = max(n for c, n in wire.SIZE_CODE_ELEMS.items() if c not in wire.JUMBO_SIZE_CODES)


def ip_be(addr: str) -> int:
    """An IPv4 address as the u32 a __be32 field holds on this host."""
    return int.from_bytes(socket.inet_aton(str(ipaddress.IPv4Address(addr))), "little")


def ip_str(raw: int) -> str:
    return socket.inet_ntoa(int(raw).to_bytes(4, "little"))


def port_ntoh(raw: int) -> int:
    """A UDP port as a map holds it (network order, read as a host integer) -> the port."""
    return socket.ntohs(raw)


def port_be(port: int) -> int:
    return socket.htons(port)


def mac_str(raw) -> str:
    return ":".join(f"{b:02x}" for b in bytes(raw))


def worker_value(w: WorkerSpec) -> abi.Worker:
    """The `workers` map value of a worker: its job and index, and its MAC, matched as
    p4app-switchML's switch matches it, unless it is all zeros (not known: no match)."""
    v = abi.Worker(job=w.job_id, index=w.index)
    v.mac[:] = mac_bytes(w.mac)
    v.match_mac = int(any(v.mac))
    return v


class AggMaps:
    """The aggregator's maps, by name -> fd (from a fresh load or from the pins)."""

    def __init__(self, fds: dict[str, int], pool_slots: int) -> None:
        self.fds = fds
        self.pool_slots = pool_slots
        self.ncpu = bpfsys.possible_cpus()

    # --- jobs -----------------------------------------------------------------------------
    def get_job(self, job_id: int) -> abi.Job | None:
        job = abi.Job()
        if not bpfsys.map_lookup(self.fds["jobs"], ct.c_uint32(job_id), job) or not job.active:
            return None
        return job

    def create_job(self, spec: JobSpec, copies: tuple[int, int] | None = None) -> None:
        """Write a job and clear its slots; refuses specs the program cannot serve (the checks
        every backend makes, xdp_agg.ctl.backend.check_job; re-creating a job replaces it). A job of
        unicast delivery needs `copies`: (the interface's ifindex, the copy program's fd)."""
        check_job(
            spec, {j: (o.slot_base, o.slot_count) for j, o in self.jobs().items()}, self.pool_slots
        )
        if spec.has_parent and spec.delivery == Delivery.BROADCAST:
            # up and answers leave with XDP_TX through the one interface
            raise ValueError("a job with a parent needs the one-arm topology")
        if spec.sparse and wire.size_code_for(spec.elems) in wire.JUMBO_SIZE_CODES:
            # an empty contribution (a 64-byte frame, in one buffer) answered with a block of
            # data must grow past a page, and bpf_xdp_adjust_tail grows a frame within its
            # buffer only (bpf/sparse.h write_sparse)
            raise ValueError(
                f"a sparse job of {spec.elems} elements per packet: an empty contribution cannot "
                "grow into a result larger than a page in XDP (sparse jobs take at most "
                f"{SPARSE_MAX_ELEMS} elements here)"
            )
        if spec.delivery == Delivery.UNICAST and copies is None:
            raise ValueError("a job of unicast delivery needs its interface and copy program")
        end = spec.slot_base + spec.slot_count
        if self.get_job(spec.job_id) is not None:
            self.delete_job(spec.job_id)
        zero = abi.Slot()
        owner = ct.c_uint32(spec.job_id + 1)
        for g in range(spec.slot_base, end):
            bpfsys.map_update(self.fds["slots"], ct.c_uint32(g), zero)
            bpfsys.map_update(self.fds["slot_owner"], ct.c_uint32(g), owner)
        job = abi.Job(
            active=1,
            num_workers=spec.num_workers,
            elems=spec.elems,
            size_code=wire.size_code_for(spec.elems),
            slot_base=spec.slot_base,
            slot_count=spec.slot_count,
            delivery=int(spec.delivery),
            # A fresh epoch per creation: per-CPU partial sums left by an earlier job on the same
            # slots carry another tag and are never added in.
            epoch=(time.monotonic_ns() >> 10) & 0xFFFFFFFF or 1,
            agg_port=spec.agg_port,
            flags=(int(abi.JobFlag.VERIFY_UDP_CSUM) if spec.udp_checksum else 0)
            | (int(abi.JobFlag.TREE) if spec.has_parent else 0)
            | (int(abi.JobFlag.SPARSE) if spec.sparse else 0)
            | (int(abi.JobFlag.WIRE16) if spec.wire_bits == 16 else 0),
            agg_ip=ip_be(spec.agg_ip),
            group_ip=ip_be(spec.group_ip),
        )
        job.agg_mac[:] = mac_bytes(spec.agg_mac)
        job.group_mac[:] = mac_bytes(spec.group_mac)
        if spec.has_parent:
            job.parent_ip = ip_be(spec.parent_ip)
            job.parent_mac[:] = mac_bytes(spec.parent_mac)
            job.parent_port = port_be(spec.parent_port)
            job.uplink_port = port_be(spec.uplink_port)
            job.down_port = port_be(spec.worker_port)
            job.parent_slot_base = spec.parent_slot_base
        self._clear_counters(spec.job_id)
        if spec.delivery == Delivery.UNICAST:
            assert copies is not None
            self._set_copies(spec.job_id, spec.num_workers, *copies)
        if spec.has_parent:
            # The parent's results are recognised like a worker's packets, by (its address, the
            # port they come to): the job's worker PARENT_INDEX.
            key = abi.WorkerKey(addr=ip_be(spec.parent_ip), port=port_be(spec.uplink_port))
            other = abi.Worker()
            if bpfsys.map_lookup(self.fds["workers"], key, other):
                raise ValueError(
                    f"{spec.parent_ip} -> port {spec.uplink_port:#x} is already worker "
                    f"{other.index} of job {other.job}: choose another uplink port"
                )
            bpfsys.map_update(
                self.fds["workers"], key, abi.Worker(job=spec.job_id, index=limits.PARENT_INDEX)
            )
        bpfsys.map_update(self.fds["jobs"], ct.c_uint32(spec.job_id), job)

    def delete_job(self, job_id: int) -> None:
        """Deactivate a job, free its slots, and remove its workers and port entries."""
        job = self.get_job(job_id)
        bpfsys.map_update(self.fds["jobs"], ct.c_uint32(job_id), abi.Job())
        for key, w in self.workers():
            if w.job == job_id:
                bpfsys.map_delete(self.fds["workers"], key)
        for key in bpfsys.map_keys(self.fds["port_workers"], abi.PortKey):
            if key.job == job_id:
                bpfsys.map_delete(self.fds["port_workers"], key)
        self._clear_copies(job_id)
        if job is not None:
            for g in range(job.slot_base, job.slot_base + job.slot_count):
                bpfsys.map_update(self.fds["slot_owner"], ct.c_uint32(g), ct.c_uint32(0))

    def jobs(self) -> dict[int, abi.Job]:
        out = {}
        for j in range(limits.MAX_JOBS):
            job = self.get_job(j)
            if job is not None:
                out[j] = job
        return out

    # --- workers --------------------------------------------------------------------------
    def parent_link(self, job_id: int) -> dict | None:
        """A tree job's parent link as configured (None for a job without a parent)."""
        job = self.get_job(job_id)
        if job is None or not job.flags & abi.JobFlag.TREE:
            return None
        return {
            "parent_ip": ip_str(job.parent_ip),
            "parent_mac": mac_str(job.parent_mac),
            "parent_port": port_ntoh(job.parent_port),
            "parent_slot_base": job.parent_slot_base,
            "uplink_port": port_ntoh(job.uplink_port),
            "worker_port": port_ntoh(job.down_port),
        }

    def add_worker(
        self,
        w: WorkerSpec,
        ifindex: int = 0,
        agg_ip: str | None = None,
        agg_mac: str | None = None,
        copy_mac: str | None = None,
    ) -> None:
        """Register a worker; with ifindex (the switch topology) also how to address it there;
        with copy_mac (a job of unicast delivery) where its copy of each result goes: that MAC
        (its own, or its next hop's) and its address."""
        owners = {
            (ip_str(k.addr), port_ntoh(k.port)): (o.job, o.index)
            for k, o in self.workers()
            if o.index != limits.PARENT_INDEX
        }
        check_worker(w, self.get_job(w.job_id), owners)
        key = abi.WorkerKey(addr=ip_be(w.ip), port=port_be(w.agg_port))
        bpfsys.map_update(self.fds["workers"], key, worker_value(w))
        zero = (abi.WorkerStats * self.ncpu)()
        bpfsys.map_update(
            self.fds["worker_stats"], ct.c_uint32(keys.worker_key(w.job_id, w.index)), zero
        )
        if ifindex:
            pw = abi.PortWorker(
                ip=ip_be(w.ip),
                agg_ip=ip_be(agg_ip or "0.0.0.0"),
                port=port_be(w.port),
                agg_port=port_be(w.agg_port),
                index=w.index,
            )
            pw.mac[:] = mac_bytes(w.mac)
            pw.agg_mac[:] = mac_bytes(agg_mac or "00:00:00:00:00:00")
            bpfsys.map_update(
                self.fds["port_workers"], abi.PortKey(ifindex=ifindex, job=w.job_id), pw
            )
        if copy_mac:
            dest = abi.PortWorker(ip=ip_be(w.ip), port=port_be(w.port), index=w.index)
            dest.mac[:] = mac_bytes(copy_mac)
            bpfsys.map_update(self.fds["copy_dests"], self._copy_key(w.job_id, w.index), dest)

    def remove_worker(self, job_id: int, index: int) -> bool:
        found = False
        for key, w in self.workers():
            if w.job == job_id and w.index == index:
                bpfsys.map_delete(self.fds["workers"], key)
                found = True
        for key in bpfsys.map_keys(self.fds["port_workers"], abi.PortKey):
            pw = abi.PortWorker()
            if (
                key.job == job_id
                and bpfsys.map_lookup(self.fds["port_workers"], key, pw)
                and pw.index == index
            ):
                bpfsys.map_delete(self.fds["port_workers"], key)
        if 0 <= index < limits.MAX_WORKERS:
            bpfsys.map_update(
                self.fds["copy_dests"], self._copy_key(job_id, index), abi.PortWorker()
            )
        return found

    def workers(self) -> list[tuple[abi.WorkerKey, abi.Worker]]:
        out = []
        for key in bpfsys.map_keys(self.fds["workers"], abi.WorkerKey):
            w = abi.Worker()
            if bpfsys.map_lookup(self.fds["workers"], key, w):
                out.append((key, w))
        return out

    # --- switch-mode ports ------------------------------------------------------------------
    def set_port(self, index: int, ifindex: int, egress_prog_fd: int) -> None:
        """Put an interface in the broadcast devmap, with the egress program on its entry."""
        val = (ct.c_uint32 * 2)(ifindex, egress_prog_fd)  # struct bpf_devmap_val {ifindex, prog fd}
        bpfsys.map_update(self.fds["tx_ports"], ct.c_uint32(index), val)

    # --- unicast delivery -------------------------------------------------------------------
    @staticmethod
    def _copy_key(job_id: int, index: int) -> ct.c_uint32:
        return ct.c_uint32(keys.worker_key(job_id, index))

    def _set_copies(self, job_id: int, n: int, ifindex: int, copy_prog_fd: int) -> None:
        """Give job `job_id` its devmap of n copies (bpf/maps.h job_copies): n entries, each the
        interface `ifindex` with the copy program, which addresses copy k to worker k."""
        self._clear_copies(job_id)
        devmap = loader.job_copies_devmap(f"copies{job_id}")
        try:
            for k in range(n):
                val = (ct.c_uint32 * 2)(ifindex, copy_prog_fd)  # struct bpf_devmap_val
                bpfsys.map_update(devmap, ct.c_uint32(k), val)
            bpfsys.map_update(self.fds["job_copies"], ct.c_uint32(job_id), ct.c_uint32(devmap))
        finally:
            os.close(devmap)  # job_copies holds it now

    def copy_dest(self, job_id: int, index: int) -> abi.PortWorker:
        """Where job `job_id`'s copy for worker `index` goes (all zero: nowhere)."""
        dest = abi.PortWorker()
        bpfsys.map_lookup(self.fds["copy_dests"], self._copy_key(job_id, index), dest)
        return dest

    def _clear_copies(self, job_id: int) -> None:
        """Remove job `job_id`'s devmap of copies and where they went (nothing if it had none)."""
        if "copy_dests" not in self.fds:
            return  # an aggregator (or a source, bench/xdp_compare.py) before unicast delivery
        bpfsys.map_delete(self.fds["job_copies"], ct.c_uint32(job_id))  # False: it had none
        for k in range(limits.MAX_WORKERS):
            bpfsys.map_update(self.fds["copy_dests"], self._copy_key(job_id, k), abi.PortWorker())

    # --- state and counters -----------------------------------------------------------------
    def slot(self, g: int) -> abi.Slot:
        st = abi.Slot()
        if not 0 <= g < self.pool_slots or not bpfsys.map_lookup(
            self.fds["slots"], ct.c_uint32(g), st
        ):
            raise ValueError(f"slot {g} is outside the pool of {self.pool_slots}")
        return st

    def result(self, g: int, version: int) -> abi.Result:
        r = abi.Result()
        bpfsys.map_lookup(self.fds["results"], ct.c_uint32(keys.pool_entry(g, version)), r)
        return r

    def partials(self, g: int, version: int) -> list[abi.Partial]:
        vals = (abi.Partial * self.ncpu)()
        bpfsys.map_lookup(self.fds["partials"], ct.c_uint32(keys.pool_entry(g, version)), vals)
        return list(vals)

    def counters(self, job_row: int) -> dict[str, int]:
        """Counters by reason for a job (or abi.NO_JOB), summed over CPUs."""
        out = {}
        vals = (ct.c_uint64 * self.ncpu)()
        for r in Reason:
            bpfsys.map_lookup(self.fds["stats"], ct.c_uint32(keys.counter_key(job_row, r)), vals)
            out[r.name.lower()] = int(sum(vals))
        return out

    def worker_counters(self, job_id: int, index: int) -> dict[str, int]:
        vals = (abi.WorkerStats * self.ncpu)()
        bpfsys.map_lookup(
            self.fds["worker_stats"], ct.c_uint32(keys.worker_key(job_id, index)), vals
        )
        return {
            name: int(sum(getattr(v, name) for v in vals)) for name, _ in abi.WorkerStats._fields_
        }

    def _clear_counters(self, job_id: int) -> None:
        zero = (ct.c_uint64 * self.ncpu)()
        for r in Reason:
            bpfsys.map_update(self.fds["stats"], ct.c_uint32(keys.counter_key(job_id, r)), zero)
        zw = (abi.WorkerStats * self.ncpu)()
        for i in range(limits.MAX_WORKERS):
            bpfsys.map_update(self.fds["worker_stats"], ct.c_uint32(keys.worker_key(job_id, i)), zw)
