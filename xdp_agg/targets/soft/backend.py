"""A userspace UDP aggregator: the reference model behind real sockets.

SoftAggregator speaks the Backend protocol (xdp_agg/ctl/backend.py) like the XDP target, but every
datagram goes through model.ReferenceAggregator, one at a time, under one lock. It needs no root
and no BPF, so the host library and the control endpoint can be tested anywhere, and since it is
the serial state machine itself it doubles as an executable specification of what a worker sees.

It is Python-bound (tens of microseconds per packet): a test and development tool, not a
data path. Batching still helps it: workers' GSO bursts arrive as one GRO buffer, and the
results for one destination leave as one GSO send.

Delivery: a completed slot (TO_ALL) is sent to every registered worker's address of the job by
unicast (there is no group address on loopback), from the job's aggregator port: with
Delivery.BROADCAST (the switch topology) and Delivery.UNICAST (one-arm, a copy per worker) to
the completing request's source port, as the XDP and P4 switches do; else (one-arm, where the
XDP aggregator sends one copy to the group at that port, on which lane l of every worker
listens: worker_port + l) to the port w registered plus the request's lane offset (its source
port less its sender's registered port), so that workers on one loopback may register ports of
their own. A retransmission for a completed slot
(TO_SENDER) is answered to the source address of the datagram.
"""

from __future__ import annotations

import os
import selectors
import threading
from collections import Counter, defaultdict

import numpy as np

from hostlib.udp_io import DatagramSocket
from xdp_agg.ctl.backend import check_job, check_worker
from xdp_agg.proto import wire
from xdp_agg.proto.jobs import Delivery, JobSpec, WorkerSpec
from xdp_agg.proto.limits import NO_JOB
from xdp_agg.proto.model import Action, ReferenceAggregator
from xdp_agg.proto.reasons import Reason

# how the per-worker counters (named as in abi.WORKER_STATS) follow from a verdict's reason
_CONTRIBUTION = {Reason.AGGREGATED, Reason.COMPLETED}
_DUPLICATE = {Reason.RETX_ANSWERED, Reason.DUP_PENDING}


class SoftAggregator:
    """Userspace aggregator on UDP sockets bound to (bind_ip, agg_port) for the ports in use.

    Use as a context manager, or start()/stop(). All methods are thread-safe.
    """

    def __init__(self, bind_ip: str = "127.0.0.1", *, gso: bool = True, gro: bool = True) -> None:
        self.bind_ip = bind_ip
        self._gso, self._gro = gso, gro
        self._lock = threading.Lock()
        self._model = ReferenceAggregator()
        self._specs: dict[int, JobSpec] = {}
        self._workers: dict[int, dict[int, WorkerSpec]] = {}
        self._reasons: dict[int, Counter] = defaultdict(Counter)  # job id (or NO_JOB) -> counts
        self._worker_stats: dict[tuple[int, int], Counter] = defaultdict(Counter)
        self._socks: dict[int, DatagramSocket] = {}  # aggregator port -> socket
        self._new_socks: list[tuple[int, DatagramSocket]] = []  # for the loop to register
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> "SoftAggregator":
        """Start serving in a background thread."""
        if self._closed:
            raise RuntimeError("SoftAggregator is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="soft-aggregator", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and close every socket. Idempotent."""
        if self._closed:
            return
        self._stopping = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            for s in self._socks.values():
                s.close()
            self._socks.clear()
            self._new_socks.clear()
        self._sel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._closed = True

    def __enter__(self) -> "SoftAggregator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- Backend protocol -------------------------------------------------------------------
    def sparse_elems(self) -> tuple[int, ...]:
        """Every wire size: the model runs sparse rounds of any (docs/protocol.md section 8)."""
        return tuple(sorted(wire.SIZE_CODE_ELEMS.values()))

    def pads_empty(self) -> bool:
        """No: its results are new datagrams, of any length."""
        return False

    def create_job(self, spec: JobSpec) -> None:
        """Create (or re-create) a job; its slot state starts cleared. ValueError on a bad or
        clashing spec (xdp_agg.ctl.backend.check_job: the model keys slots by job, but a real
        aggregator shares one pool, and this one keeps that contract)."""
        if spec.has_parent:
            raise ValueError(
                "the software aggregator has no two-level aggregation (the XDP aggregator does)"
            )
        with self._lock:
            ranges = {j: (o.slot_base, o.slot_count) for j, o in self._specs.items()}
            check_job(spec, ranges, wire.MAX_SLOTS)
            if spec.job_id in self._specs:
                self._delete_job(spec.job_id)
            self._open_port(spec.agg_port)
            self._model.create_job_spec(spec)  # no parent: refused above
            self._specs[spec.job_id] = spec
            self._workers[spec.job_id] = {}
            self._reasons.pop(spec.job_id, None)
            for key in [k for k in self._worker_stats if k[0] == spec.job_id]:
                del self._worker_stats[key]

    def delete_job(self, job_id: int) -> None:
        """Delete a job and its workers (a no-op for an unknown job)."""
        with self._lock:
            self._delete_job(job_id)

    def _delete_job(self, job_id: int) -> None:
        """delete_job with the lock held."""
        self._model.delete_job(job_id)
        self._specs.pop(job_id, None)
        self._workers.pop(job_id, None)

    def add_worker(self, worker: WorkerSpec) -> None:
        """Register worker `index` of a job: datagrams from worker.ip to worker.agg_port."""
        with self._lock:
            check_worker(worker, self._specs.get(worker.job_id), self._model.workers)
            self._model.add_worker(worker.job_id, worker.index, worker.ip, worker.agg_port)
            self._workers[worker.job_id][worker.index] = worker

    def remove_worker(self, job_id: int, index: int) -> None:
        """Unregister a worker (a no-op if it is not registered)."""
        with self._lock:
            if self._workers.get(job_id, {}).pop(index, None) is not None:
                self._model.remove_worker(job_id, index)

    def jobs(self) -> list[dict]:
        """The configured jobs, each a JobSpec.to_dict() with a 'workers' list."""
        with self._lock:
            out = []
            for job_id, spec in sorted(self._specs.items()):
                d = spec.to_dict()
                d["workers"] = [w.to_dict() for _, w in sorted(self._workers[job_id].items())]
                out.append(d)
            return out

    # --- counters ---------------------------------------------------------------------------
    def counters(self, job_id: int) -> dict[str, int]:
        """Verdict reasons counted for a job (abi.NO_JOB for packets of no job), by name."""
        with self._lock:
            c = self._reasons.get(job_id, Counter())
            return {r.name.lower(): c[r] for r in Reason if c[r]}

    def worker_counters(self, job_id: int) -> dict[int, dict[str, int]]:
        """Per-worker counters of a job, named like abi.WORKER_STATS's fields."""
        with self._lock:
            indices = set(self._workers.get(job_id, {})) | {
                i for (j, i) in self._worker_stats if j == job_id
            }
            names = ("packets", "contributions", "duplicates", "answered", "dropped")
            return {
                i: {n: self._worker_stats[(job_id, i)][n] for n in names} for i in sorted(indices)
            }

    # --- data path --------------------------------------------------------------------------
    def _open_port(self, port: int) -> None:
        """Bind the socket of an aggregator port, once (called with the lock held)."""
        if port in self._socks:
            return
        s = DatagramSocket((self.bind_ip, port), gso=self._gso, gro=self._gro)
        self._socks[port] = s
        self._new_socks.append((port, s))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _loop(self) -> None:
        while not self._stopping:
            for key, _ in self._sel.select(timeout=0.5):
                if key.data is None:
                    self._drain_wake()
                else:
                    port, sock = key.data
                    self._serve(port, sock)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            new, self._new_socks = self._new_socks, []
        for port, sock in new:
            self._sel.register(sock.fileno(), selectors.EVENT_READ, (port, sock))

    def _serve(self, port: int, sock: DatagramSocket) -> None:
        """Process what is waiting on one port; send the results grouped per destination."""
        out: dict[tuple[tuple[str, int], int], list[bytes]] = defaultdict(list)
        with self._lock:
            for data, src in sock.recv_datagrams(max_calls=64):
                v = self._model.process(src[0], port, data)
                job = v.job_id if v.job_id is not None else NO_JOB
                self._reasons[job][v.reason] += 1
                if v.worker is not None:
                    self._count_worker(v.job_id, v.worker, v.reason)
                if v.action is Action.TO_ALL:
                    workers = self._workers.get(v.job_id, {})
                    sender = workers.get(v.worker)
                    for w in workers.values():
                        out[(self._result_to(w, src, sender), len(v.payload))].append(v.payload)
                elif v.action is Action.TO_SENDER:
                    out[(src, len(v.payload))].append(v.payload)
        for (dest, plen), payloads in out.items():
            rows = np.frombuffer(b"".join(payloads), dtype=np.uint8).reshape(len(payloads), plen)
            sock.send_rows(rows, dest)

    def _result_to(self, w: WorkerSpec, src: tuple[str, int], sender: WorkerSpec | None):
        """Where worker w's copy of a result completed by `sender`'s request from `src` goes:
        to the request's source port (switch) or w's port at the same lane offset (one-arm),
        as the module's docstring says, so that each lane (thread) of a host gets its own
        slots' results (docs/protocol.md 1.4)."""
        if self._specs[w.job_id].delivery in (Delivery.BROADCAST, Delivery.UNICAST):
            return (w.ip, src[1])
        port = w.port + (src[1] - sender.port if sender is not None else 0)
        return (w.ip, port if 0 < port < 65536 else w.port)

    def _count_worker(self, job_id: int, index: int, reason: Reason) -> None:
        c = self._worker_stats[(job_id, index)]
        c["packets"] += 1
        if reason in _CONTRIBUTION:
            c["contributions"] += 1
        elif reason in _DUPLICATE:
            c["duplicates"] += 1
            if reason is Reason.RETX_ANSWERED:
                c["answered"] += 1
        else:
            c["dropped"] += 1
