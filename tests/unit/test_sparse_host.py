"""Sparse all-reduces of the host library (docs/protocol.md section 8) against the reference
model behind real sockets (SoftAggregator): no root, no BPF. Both loops: the numpy reference
(hostlib.numpy_sparse, native=False) and the C loop (hostlib/fp_sparse.c, native=True).

Each engine test runs n StreamEngines in threads, one per worker, on a sparse job, and checks
the sums against numpy (int32: exact, wrapping) and against the same engines' dense all-reduce
of the same tensors (int32 and float32: byte for byte, since a block's agreed exponent is the
same maximum either way: zero blocks send the neutral exponent in a dense all-reduce), clean and
under loss and duplication, and that the zero blocks did not travel. The C loop sends the numpy
loop's datagrams byte for byte (against a scripted aggregator, tests/harness/echo.py, as
tests/unit/test_fastpath.py compares the dense loops).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from harness.dtypes import WIRE16_CASES, as_dtype
from harness.echo import EchoAggregator
from harness.ranks import loopback_prefix

from hostlib.engine import EngineConfig, Faults, StreamEngine, _fastpath
from hostlib.native_sparse import NativeSparseLoop
from hostlib.numpy_sparse import NumpySparseLoop
from hostlib.udp_io import DatagramSocket
from xdp_agg.proto import wire
from xdp_agg.proto.jobs import JobSpec, WorkerSpec
from xdp_agg.targets.soft import SoftAggregator

pytestmark = pytest.mark.timeout(120)

K = 32  # elements per packet (block)
JOB = 3


LOOPS = [
    pytest.param(False, id="numpy"),
    pytest.param(
        True,
        id="c",
        marks=pytest.mark.skipif(_fastpath is None, reason="hostlib._fastpath is not built"),
    ),
]


@pytest.fixture(params=LOOPS)
def native(request) -> bool:
    """Which loop runs the engines: the numpy reference (False) or the C loop (True)."""
    return request.param


class Workers:
    """n engines on a sparse job of a SoftAggregator, all-reducing together in threads, with
    the C loop (native) or the numpy one."""

    def __init__(
        self,
        agg: SoftAggregator,
        prefix: str,
        n: int,
        window: int,
        faults=None,
        native=False,
        pad=False,
        wire_bits=32,
    ):
        port = wire.UDP_PORT + 1
        agg.create_job(
            JobSpec(
                JOB, n, K, slot_base=4, slot_count=window, agg_port=port, sparse=True,
                wire_bits=wire_bits,
            )
        )  # fmt: skip
        self.engines = []
        for i in range(n):
            sock = DatagramSocket((f"{prefix}.{10 + i}", 0))
            ip, p = sock.address
            agg.add_worker(WorkerSpec(JOB, i, ip, p, agg_port=port))
            cfg = EngineConfig(
                JOB, n, K, 4, window, (f"{prefix}.1", port), native=native, rto=0.005,
                pad_empty=pad, wire_bits=wire_bits,
            )  # fmt: skip
            f = Faults(**faults, seed=i) if faults else None
            self.engines.append(StreamEngine(sock, cfg, f))
            loop = NativeSparseLoop if native else NumpySparseLoop
            assert isinstance(self.engines[-1].sparse_loop, loop)

    def allreduce(self, tensors: list[np.ndarray], sparse: bool, inplace=False) -> list:
        # outputs not zeroed: the zero blocks of the result must be written
        outs = [t if inplace else np.full_like(t, 77) for t in tensors]
        errors: list = []

        def run(i: int) -> None:
            e, t = self.engines[i], tensors[i]
            fn = e.allreduce
            try:
                fn(t, outs[i], timeout=20.0, sparse=sparse)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(tensors))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads), "an all-reduce hangs"
        return outs

    def close(self) -> None:
        for e in self.engines:
            e.state.sock.close()


@pytest.fixture
def cluster(native):
    prefix = loopback_prefix()
    agg = SoftAggregator(f"{prefix}.1").start()
    made: list[Workers] = []

    def make(n: int, window: int = 8, faults=None, pad=False, wire_bits=32) -> Workers:
        w = Workers(agg, prefix, n, window, faults, native, pad, wire_bits)
        made.append(w)
        return w

    yield make, agg
    for w in made:
        w.close()
    agg.stop()


def blocky(rng, n: int, blocks: int, density: float, same: bool, dtype, tail: int = 0):
    """n tensors of `blocks` blocks of K (plus `tail` elements), a `density` share of the blocks
    non-zero: the same blocks on every worker, or drawn for each."""
    L = blocks * K + tail
    shared = rng.random(-(-L // K)) < density
    out = []
    for _ in range(n):
        keep = shared if same else rng.random(-(-L // K)) < density
        if dtype == np.int32:
            x = rng.integers(-(2**31), 2**31, size=L, dtype=np.int64).astype(np.int32)
        else:
            x = (rng.standard_normal(L) * 10.0 ** rng.integers(-3, 4, size=L)).astype(np.float32)
        x[~np.repeat(keep, K)[:L]] = 0
        out.append(x)
    return out


def wrapped_sum(tensors):
    return (
        (np.sum([t.astype(np.int64) for t in tensors], axis=0) & 0xFFFFFFFF)
        .astype(np.uint32)
        .view(np.int32)
    )


@pytest.mark.parametrize("same", [True, False], ids=["same-blocks", "independent"])
@pytest.mark.parametrize("density", [0.0, 0.1, 0.5, 1.0])
def test_int32_exact_and_equal_to_dense(cluster, density, same):
    """Exact sums, the dense all-reduce's bytes; each worker skips its zero blocks; the union
    of the workers' blocks is what the loop reports (union_blocks, for sparse="auto")."""
    make, agg = cluster
    rng = np.random.default_rng(int(density * 10) + same)
    w = make(3)
    xs = blocky(rng, 3, 40, density, same, np.int32, tail=5)
    sparse = w.allreduce(xs, sparse=True)
    dense = w.allreduce(xs, sparse=False)
    want = wrapped_sum(xs)
    for s, d in zip(sparse, dense):
        np.testing.assert_array_equal(s, want)
        assert s.tobytes() == d.tobytes()
    st = [e.stats for e in w.engines]
    zero = [
        int(np.count_nonzero(~np.any(np.pad(x, (0, -len(x) % K)).reshape(-1, K), 1))) for x in xs
    ]
    assert density == 1.0 or same is False or zero[0] > 0  # the tensors do have zero blocks
    assert [s["blocks_skipped"] for s in st] == zero
    assert all(s["sparse_allreduces"] == 1 for s in st)
    union = np.any([np.pad(x, (0, -len(x) % K)).reshape(-1, K) != 0 for x in xs], axis=(0, 2))
    assert all(e.sparse_loop.union_blocks == np.count_nonzero(union) for e in w.engines)
    assert all(e.sparse_loop.blocks == len(union) for e in w.engines)
    counts = agg.counters(JOB)
    assert not any(v for name, v in counts.items() if name.startswith("drop_")), counts


@pytest.mark.parametrize("same", [True, False], ids=["same-blocks", "independent"])
@pytest.mark.parametrize("density", [0.0, 0.1, 1.0])
def test_float32_equal_to_dense_byte_for_byte(cluster, density, same):
    make, _ = cluster
    rng = np.random.default_rng(100 + int(density * 10) + same)
    w = make(4, window=6)
    xs = blocky(rng, 4, 30, density, same, np.float32, tail=7)
    sparse = w.allreduce(xs, sparse=True)
    dense = w.allreduce(xs, sparse=False)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    for s, d in zip(sparse, dense):
        assert s.tobytes() == d.tobytes()
        assert np.all(np.abs(s - exact) <= 1e-3 * np.abs(exact).max() + 1e-30)


def test_zero_blocks_do_not_travel(cluster):
    """At 10% density on the same blocks, every worker sends a payload only for its non-zero
    blocks, and the other rounds' packets are headers: bytes fall with the density."""
    make, agg = cluster
    rng = np.random.default_rng(7)
    w = make(2, window=4)
    xs = blocky(rng, 2, 200, 0.1, True, np.int32)
    nonzero = int(np.count_nonzero(np.any(xs[0].reshape(-1, K) != 0, axis=1)))
    w.allreduce(xs, sparse=True)
    st = w.engines[0].stats
    data_len = wire.sparse_payload_len(K, False)
    # every packet is a header or a block; only the non-zero blocks carry data
    payloads = (st["bytes_sent"] - st["packets_sent"] * wire.SPARSE_VALUES_AT) // (4 * K)
    assert payloads == nonzero
    assert st["bytes_sent"] < 0.2 * 200 * data_len


@pytest.mark.parametrize("kind", [np.int32, np.float32])
def test_in_place_and_under_loss_and_duplication(cluster, kind):
    make, agg = cluster
    rng = np.random.default_rng(11)
    faults = dict(send_loss=0.1, recv_loss=0.1, send_duplicate=0.1, recv_duplicate=0.1)
    w = make(3, window=5, faults=faults)
    xs = blocky(rng, 3, 60, 0.2, False, kind, tail=3)
    want = [x.copy() for x in xs]
    outs = w.allreduce([x.copy() for x in xs], sparse=True, inplace=True)
    assert sum(e.stats["retransmissions"] for e in w.engines) > 0
    assert sum(e.stats["fault_drops"] for e in w.engines) > 0
    if kind == np.int32:
        for o in outs:
            np.testing.assert_array_equal(o, wrapped_sum(want))
    dense = w.allreduce([x.copy() for x in want], sparse=False)
    for o, d in zip(outs, dense):
        assert o.tobytes() == d.tobytes()


def test_sparse_and_dense_all_reduces_alternate_on_the_slots(cluster):
    """Slot versions stay lined up when sparse all-reduces (a slot's rounds depend on the data)
    and dense ones follow each other on the same engines."""
    make, _ = cluster
    rng = np.random.default_rng(3)
    w = make(2, window=4)
    for i in range(6):
        xs = blocky(rng, 2, 13, [0.0, 0.3, 1.0][i % 3], i % 2 == 0, np.int32)
        outs = w.allreduce(xs, sparse=i % 2 == 1)
        for o in outs:
            np.testing.assert_array_equal(o, wrapped_sum(xs))


@pytest.mark.parametrize("native", LOOPS)
def test_a_result_that_skips_this_workers_data_is_refused(native):
    """The aggregator (here a socket of the test's) answers block 0 by sending the slot past
    block 2, where this worker has data: the all-reduce raises, naming the blocks; the slots'
    versions advance by the rounds they ran."""
    import socket

    from hostlib.errors import SparseProtocolError

    prefix = loopback_prefix()
    agg = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    agg.bind((f"{prefix}.1", 0))
    agg.settimeout(5)
    sock = DatagramSocket((f"{prefix}.10", 0))
    cfg = EngineConfig(JOB, 1, K, 0, 2, agg.getsockname(), native=native, timeout=5.0)
    eng = StreamEngine(sock, cfg)
    x = np.zeros(6 * K, dtype=np.int32)
    x[0] = x[2 * K] = 1  # blocks 0 and 2, both in column 0 of 2
    errors: list = []
    t = threading.Thread(target=lambda: _catch(errors, eng.allreduce, x, x.copy(), 5.0))
    t.start()
    try:
        for _ in range(2):  # the first round of each slot
            data, addr = agg.recvfrom(65536)
            m = wire.Message.from_bytes(data)
            if m.slot == 0:
                bad = data
        m = wire.Message.from_bytes(bad)
        assert m.sparse == wire.Sparse(0, 2, 6)
        answer = wire.build_sparse_payload(
            job_number=m.job_number, size_code=m.size, tsi=m.tsi, slot=m.slot,
            version=m.version, block=0, next=4, blocks=6, values=m.values,
        )  # fmt: skip
        agg.sendto(answer, addr)
        t.join(10)
    finally:
        agg.close()
        sock.close()
    assert len(errors) == 1 and isinstance(errors[0], SparseProtocolError), errors
    assert "slot 0 from block 0 to block 4 of 6" in str(errors[0]) and "is 2" in str(errors[0])
    assert "(column 0 of 2)" in str(errors[0])
    assert eng.state.versions.tolist() == [1, 1]  # one round each (slot 1's never answered)


def _catch(errors: list, fn, *args) -> None:
    try:
        fn(*args, sparse=True)
    except BaseException as e:  # noqa: BLE001 - the test asserts on it
        errors.append(e)


# --- the C loop sends the numpy loop's datagrams ----------------------------------------------
class SparseEcho(EchoAggregator):
    """EchoAggregator for sparse rounds: answers a contribution as if a second worker had sent
    one too, deterministically from the packet alone. That worker's next block is one column
    step on (block + w) for every third tsi, else none: the result's next is the smaller of the
    two, so some rounds visit blocks this worker has no data in (it sends empty packets there).
    The sum is the contribution's values plus add * (tsi + i); an empty contribution gets a
    block of data back for every second tsi past the first window (the other worker had data:
    not in a float announce round, where no one sends any). e0: the other worker's exponent
    (bump[tsi % 64]) where the next is its block, maxed with the contribution's where both name
    it. Dense packets get EchoAggregator's answer."""

    def __init__(self, window: int, **kw) -> None:
        super().__init__(**kw)
        self.window = window

    def result(self, data: bytes) -> bytes:
        m = wire.Message.from_bytes(data)
        sp = m.sparse
        if sp is None:
            return super().result(data)
        w = min(self.window, sp.blocks)
        other = sp.block + w if m.tsi % 3 == 0 and sp.block + w < sp.blocks else sp.blocks
        nxt = min(sp.next, other)
        bump = int(self.bump[m.tsi % 64])
        e0 = m.e0 if nxt < other else bump if nxt < sp.next else max(m.e0, bump)
        extra = self.add * (m.tsi + np.arange(K, dtype=np.int64))
        values = None
        if m.msg_type == wire.MSG_TYPE_SPARSE:
            values = m.values.astype(np.int64) + extra
        elif m.tsi >= w and m.tsi % 2 == 0:
            values = extra
        if values is not None:
            values = (values & 0xFFFFFFFF).astype(np.uint32).view(np.int32)  # mod 2^32
        return wire.build_sparse_payload(
            job_number=m.job_number, size_code=m.size, tsi=m.tsi, slot=m.slot,
            version=m.version, block=sp.block, next=nxt, blocks=sp.blocks, values=values, e0=e0,
            wire_bits=m.wire_bits,
        )  # fmt: skip


def sparse_sequence() -> list[tuple[np.ndarray, bool]]:
    """All-reduces in a row, (tensor, sparse): int32 and float32 at several densities, with
    tails, a zero block, -0.0, subnormals (non-zero, exponent clipped to -128), values at the
    top exponent (clipped at M), nothing anywhere, one block, and dense ones between (the slot
    versions must stay lined up)."""
    rng = np.random.default_rng(21)
    f = blocky(rng, 1, 45, 0.5, True, np.float32, tail=3)[0]
    f[2 * K : 3 * K] = 0.0
    f[3 * K : 4 * K] = -0.0  # zero, as numpy's x != 0 says
    f[7 * K : 8 * K] = np.float32(2.0**-140)
    f[9 * K : 9 * K + 5] = np.float32(3e38) * np.array([1, -1, 1, -1, 1], np.float32)
    return [
        (blocky(rng, 1, 37, 0.3, True, np.int32, tail=5)[0], True),
        (f, True),
        (np.zeros(3 * K, np.int32), True),
        (np.arange(5 * K, dtype=np.int32), False),
        (np.array([0.25, -7.0, 1e-3], np.float32), True),
        (blocky(rng, 1, 30, 1.0, True, np.float32)[0], True),
        (blocky(rng, 1, 50, 0.1, True, np.int32)[0], True),
        (blocky(rng, 1, 20, 0.6, True, np.float32, tail=1)[0], False),
        (blocky(rng, 1, 64, 0.05, True, np.float32)[0], True),
    ]


def run_echo(native: bool, sequence, *, agg_kw=None, faults=None, rto=0.02, window=8, wire_bits=32):
    """`sequence` on one engine against SparseEcho; (outputs, datagrams by (job number, tsi),
    stats, union_blocks after each all-reduce)."""
    agg = SparseEcho(window, **(agg_kw or {}))
    sock = DatagramSocket((agg.worker_ip(), 0))
    # the timers' floor at rto (not the round trip's): a slow echo on a busy host must not
    # make the loops' datagram counts differ by spurious expiries
    cfg = EngineConfig(
        0, 2, K, 5, window, agg.address, rto=rto, native=native, timeout=10.0,
        wire_bits=wire_bits, rto_floor=rto,
    )  # fmt: skip
    eng = StreamEngine(sock, cfg, faults)
    try:
        outs, unions = [], []
        for x, sparse in sequence:
            out = np.full_like(x, -5)  # not zeroed: the result's zero blocks must be written
            run = eng.allreduce
            run(x, out, sparse=sparse)
            outs.append(out)
            unions.append(eng.sparse_loop.union_blocks)
        time.sleep(0.05)  # late answers and duplicates still on their way
        return outs, agg.packets(), dict(eng.stats), unions
    finally:
        sock.close()
        agg.close()


SPARSE_STATS = ("sparse_allreduces", "blocks_skipped", "empty_sent", "allreduces", "elements")

needs_c = pytest.mark.skipif(_fastpath is None, reason="hostlib._fastpath is not built")


@needs_c
def test_both_loops_send_the_same_datagrams_and_get_the_same_results():
    seq = sparse_sequence()
    ref_out, ref_pk, ref_st, ref_u = run_echo(False, seq)
    nat_out, nat_pk, nat_st, nat_u = run_echo(True, seq)
    assert set(ref_pk) == set(nat_pk)
    for key in ref_pk:
        assert ref_pk[key] == nat_pk[key], f"datagram {key} differs"
    for a, b in zip(ref_out, nat_out):
        assert a.tobytes() == b.tobytes()
    assert ref_u == nat_u and max(ref_u) > 0
    lengths = {len(d) for d in ref_pk.values()}
    assert {wire.SPARSE_VALUES_AT, wire.sparse_payload_len(K, False)} <= lengths
    for name in SPARSE_STATS + ("packets_sent", "bytes_sent", "results"):
        assert ref_st[name] == nat_st[name], name
    assert nat_st["retransmissions"] == 0 and nat_st["sparse_allreduces"] == 7


@needs_c
def test_same_datagrams_when_the_path_drops_duplicates_and_reorders():
    seq = sparse_sequence()[:6]
    agg_kw = {
        "drop": {t: 1 + t % 2 for t in range(0, 200, 7)},
        "dup": set(range(3, 200, 5)),
        "reverse": True,
    }
    ref_out, ref_pk, ref_st, _ = run_echo(False, seq, agg_kw=agg_kw, rto=0.005)
    nat_out, nat_pk, nat_st, _ = run_echo(True, seq, agg_kw=agg_kw, rto=0.005)
    assert ref_pk == nat_pk
    assert all(a.tobytes() == b.tobytes() for a, b in zip(ref_out, nat_out))
    for st in (ref_st, nat_st):
        assert st["retransmissions"] > 0 and st["duplicates"] > 0


@needs_c
def test_same_datagrams_under_engine_faults():
    seq = sparse_sequence()[:5]
    faults = Faults(send_loss=0.1, recv_loss=0.1, send_duplicate=0.2, recv_duplicate=0.2, seed=4)
    ref_out, ref_pk, _, _ = run_echo(False, seq, faults=faults, rto=0.005)
    nat_out, nat_pk, nat_st, _ = run_echo(True, seq, faults=faults, rto=0.005)
    assert ref_pk == nat_pk
    assert all(a.tobytes() == b.tobytes() for a, b in zip(ref_out, nat_out))
    assert nat_st["fault_drops"] > 0 and nat_st["retransmissions"] > 0
    assert nat_st["duplicates"] > 0


@needs_c
def test_gro_buffers_of_mixed_lengths_are_cut_into_their_results():
    """Results coalesced by UDP GRO (the echo sends runs of one length as GSO messages, a
    header-only result ending a run of full ones): the C loop cuts each buffer at the segment
    size, the last datagram shorter, and gets the numpy loop's results."""
    seq = sparse_sequence()
    ref_out, ref_pk, _, _ = run_echo(False, seq)
    nat_out, nat_pk, nat_st, _ = run_echo(True, seq, agg_kw={"gso": True})
    assert ref_pk == nat_pk
    assert all(a.tobytes() == b.tobytes() for a, b in zip(ref_out, nat_out))
    assert nat_st["malformed"] == 0 and nat_st["retransmissions"] == 0


@needs_c
def test_after_a_stall_both_loops_line_up_alike():
    """A sparse all-reduce that stalls (the echo goes silent after 5 answers) raises
    AllreduceTimeout in both loops, and advances the slots' versions by the rounds they ran:
    the next all-reduce sends the same datagrams from either loop."""
    import hostlib

    x = sparse_sequence()[0][0]
    sent = {}
    for native in (False, True):
        agg = SparseEcho(4, answer_limit=5)
        sock = DatagramSocket((agg.worker_ip(), 0))
        cfg = EngineConfig(0, 2, K, 5, 4, agg.address, rto=0.05, native=native, timeout=0.3)
        eng = StreamEngine(sock, cfg)
        try:
            with pytest.raises(hostlib.AllreduceTimeout):
                eng.allreduce(x, np.empty_like(x), sparse=True)
            agg.answer_limit = None
            eng.allreduce(x, np.empty_like(x), sparse=True)
            time.sleep(0.05)
            sent[native] = {key: v for key, v in agg.packets().items() if key[0] == 1}
        finally:
            sock.close()
            agg.close()
    assert sent[False] and sent[False] == sent[True]


@needs_c
def test_block_scan_matches_numpy():
    """_fastpath.block_scan: the non-zero blocks and float exponents of the numpy loop's
    _tensor (scaling.chunk_exponents), and the first NaN or Inf."""
    from hostlib.numpy_sparse import _tensor

    rng = np.random.default_rng(2)
    for dtype in (np.int32, np.float32):
        x = blocky(rng, 1, 70, 0.3, False, dtype, tail=11)[0]
        x[5 * K + 3] = -0.0 if dtype == np.float32 else 0
        x[9 * K] = np.int32(-(2**31)) if dtype == np.int32 else np.float32(2.0**-149)
        t = _tensor(x, np.empty_like(x), K, 8, dtype == np.float32)
        nonzero, exps, bad, count = _fastpath.block_scan(x, K, np.dtype(dtype).name)
        assert bad == -1 and np.frombuffer(nonzero, np.uint8).tolist() == t.nonzero.tolist()
        assert count == np.count_nonzero(t.nonzero)
        if dtype == np.float32:
            assert np.frombuffer(exps, np.int8).tolist() == t.exps.tolist()
        else:
            assert exps is None
    f = np.ones(10 * K, np.float32)
    f[3 * K + 1] = np.inf
    assert _fastpath.block_scan(f, K, "float32")[2] == 3 * K + 1


@pytest.mark.parametrize("native", LOOPS)
def test_nan_is_refused_before_anything_is_sent(native):
    agg = SparseEcho(8)
    sock = DatagramSocket((agg.worker_ip(), 0))
    eng = StreamEngine(sock, EngineConfig(0, 2, K, 5, 8, agg.address, native=native))
    try:
        x = np.ones(10 * K, np.float32)
        x[7 * K + 2] = np.nan
        with pytest.raises(ValueError, match="contains nan at element 226"):
            eng.allreduce(x, np.empty_like(x), sparse=True)
        time.sleep(0.05)
        assert agg.received == [] and eng.counter == 0
    finally:
        sock.close()
        agg.close()


# --- through the communicator ---------------------------------------------------------------------
def _column(comm, n_blocks: int, rank: int, dtype=np.int32) -> np.ndarray:
    """A tensor whose blocks 3r and 3r + 1 (mod n_blocks) are non-zero on rank r."""
    k = comm.description.spec.elems
    x = np.zeros(n_blocks * k, dtype=dtype)
    for b in (3 * rank % n_blocks, (3 * rank + 1) % n_blocks):
        x[b * k : (b + 1) * k] = np.arange(k) + rank + 1
    return x


@pytest.mark.parametrize(
    "native,lanes",
    [(False, 1), pytest.param(True, 1, marks=needs_c), pytest.param(True, 2, marks=needs_c)],
    ids=["numpy", "c", "c-2-lanes"],
)
def test_communicator_sparse_auto_and_explicit(native, lanes):
    """A sparse job (the endpoint's default): "auto" runs the first all-reduce of a length
    sparse, keeps it sparse while the results stay sparse and goes dense after a dense result;
    every sum is exact; sparse=True on a dense job is refused before anything is sent. After a
    sparse all-reduce "auto" goes by the union of blocks the loop counted (exact: 6 of 40,
    where sampling every 8th block of the result would say 1 of 5), lanes' parts added up."""
    from harness.ranks import ok, run_ranks, soft_cluster

    n, blocks = 3, 40 * lanes**3  # with 2 lanes, both get a part (MIN_LANE_PACKETS)

    def body(comm):
        k = comm.description.spec.elems
        assert comm.description.spec.sparse
        x = _column(comm, blocks, comm.rank)
        want = sum(_column(comm, blocks, r) for r in range(n))
        runs = []
        for i in range(3):
            np.testing.assert_array_equal(comm.allreduce(x), want)
            runs.append(comm.stats["sparse_allreduces"] // lanes)
        assert comm._engine.last_union == (6, blocks)
        assert comm._chooser.density("int32", blocks * k) == 6 / blocks
        full = np.ones(blocks * k, dtype=np.int32)
        np.testing.assert_array_equal(comm.allreduce(full), n * full)  # sparse: first of it
        np.testing.assert_array_equal(comm.allreduce(full), n * full)  # dense: it came back full
        runs.append(comm.stats["sparse_allreduces"] // lanes)
        assert comm._engine.last_union is None
        np.testing.assert_array_equal(comm.allreduce(full, sparse=True), n * full)
        f = _column(comm, blocks, comm.rank, np.float32) / 7
        got = comm.allreduce(f, sparse=True)
        dense = comm.allreduce(f, sparse=False)
        assert got.tobytes() == dense.tobytes()
        return runs, comm.stats["blocks_skipped"]

    with soft_cluster(defaults={"sparse": True}) as cl:
        kw = {"native": native, "lanes": lanes}
        results = ok(run_ranks(cl, n, body, job="sparse", elems=32, window=8, **kw))
    for runs, skipped in results:
        assert runs == [1, 2, 3, 4]  # the three sparse, the first full one sparse, then dense
        assert skipped >= 3 * (blocks - 2)

    with soft_cluster() as cl:  # a dense job

        def refused(comm):
            assert not comm.description.spec.sparse
            with pytest.raises(ValueError, match="sparse=True on a dense job"):
                comm.allreduce(np.ones(8, np.int32), sparse=True)
            with pytest.raises(ValueError, match="True, False or 'auto'"):
                comm.allreduce(np.ones(8, np.int32), sparse="yes")
            return comm.allreduce(np.ones(8, np.int32))  # "auto": dense, and fine

        for r in ok(run_ranks(cl, 2, refused, job="dense", elems=32, window=8)):
            np.testing.assert_array_equal(r, 2)


@pytest.mark.parametrize("native", [False])  # the aggregator's checks: one loop is enough
def test_bad_sparse_contributions_are_counted_in_the_metrics(cluster):
    """A block outside the tensor, a next going backwards, another block than its round's:
    each dropped under its own reason, which the Prometheus exposition shows as a drop; the
    slot's round still completes with the right sum."""
    import socket

    from xdp_agg.app import metrics

    make, agg = cluster
    w = make(2, window=2)
    ip, port = w.engines[0].state.sock.address
    w.engines[0].state.sock.close()  # its address now sends the test's own datagrams
    raw = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    raw.bind((ip, port))
    dest = w.engines[0].state.cfg.data_address

    def payload(block: int, nxt: int, value: int, blocks: int = 10) -> bytes:
        """A data contribution to slot 4 (the job's first), version 0, every element `value`."""
        return wire.Message(
            wire.MSG_TYPE_SPARSE, wire.size_code_for(K), 0, 0, 4, 0, 0, 0,
            np.full(K, value, np.int32), sparse=wire.Sparse(block, nxt, blocks),
        ).to_bytes()  # fmt: skip

    try:
        raw.sendto(payload(10, 10, 5), dest)  # block = blocks: outside the tensor
        raw.sendto(payload(0, 11, 5), dest)  # next beyond it
        raw.sendto(payload(4, 2, 5), dest)  # next backwards
        raw.sendto(payload(4, 6, 5), dest)  # a good one: the round of slot 4 is at block 4
        other = w.engines[1].state.sock
        for block in (6, 4):  # the other worker: another block, then the right one
            row = np.frombuffer(payload(block, 8, 7), np.uint8).reshape(1, -1)
            other.send_rows(row, dest)
        raw.settimeout(5)
        result = wire.Message.from_bytes(raw.recv(65536))
    finally:
        raw.close()
    assert result.sparse == wire.Sparse(4, 6, 10)
    np.testing.assert_array_equal(result.values, np.full(K, 12))
    c = agg.counters(JOB)
    assert (c["drop_sparse_range"], c["drop_sparse_backwards"], c["drop_sparse_mismatch"]) == (
        2,
        1,
        1,
    )
    text = metrics.exposition(metrics.Sources(backend=agg, target="soft"))
    for reason, n in (("drop_sparse_range", 2), ("drop_sparse_mismatch", 1)):
        line = f'xdpagg_drops_total{{job_id="{JOB}",reason="{reason}",target="soft"}} {n}.0'
        assert line in text, [t for t in text.splitlines() if "sparse" in t]


def test_padded_empties(cluster):
    """A job whose hosts pad their empty contributions (JobSpec.pad_empty, for XDP): the same
    sums, and every contribution is a block long."""
    make, agg = cluster
    rng = np.random.default_rng(21)
    w = make(3, window=4, pad=True)
    xs = blocky(rng, 3, 30, 0.2, False, np.int32)
    for o in w.allreduce(xs, sparse=True):
        np.testing.assert_array_equal(o, wrapped_sum(xs))
    st = w.engines[0].stats
    assert st["empty_sent"] > 0
    assert st["bytes_sent"] == st["packets_sent"] * wire.sparse_payload_len(K, False)


# --- 16-bit elements and 16-bit types (docs/protocol.md 5.6) ------------------------------------


def wire16_sequence(dtype: str) -> list[tuple[np.ndarray, bool]]:
    """sparse_sequence's float all-reduces, in `dtype`."""
    return [(as_dtype(x, dtype), sp) for x, sp in sparse_sequence() if x.dtype == np.float32]


@needs_c
@pytest.mark.parametrize("dtype, bits", WIRE16_CASES)
def test_wire16_sparse_both_loops_and_kernels_send_the_same_datagrams(dtype, bits):
    """Every type at either width: the C loop (AVX2 and scalar kernels) sends the numpy
    loop's datagrams, width bit included, and writes the same results into the type."""
    seq = wire16_sequence(dtype)
    ref_out, ref_pk, ref_st, ref_u = run_echo(False, seq, wire_bits=bits)
    runs = [run_echo(True, seq, wire_bits=bits)]
    if _fastpath.simd() == "avx2":
        prev = _fastpath.set_simd("scalar")
        try:
            runs.append(run_echo(True, seq, wire_bits=bits))
        finally:
            _fastpath.set_simd(prev)
    for nat_out, nat_pk, nat_st, nat_u in runs:
        assert ref_pk == nat_pk and ref_u == nat_u
        assert all(
            a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in zip(ref_out, nat_out)
        )
        for name in SPARSE_STATS + ("packets_sent", "bytes_sent", "results"):
            assert ref_st[name] == nat_st[name], name
    width = {bool(d[0] & wire.TYPE_SIZE_WIRE16_MASK) for d in ref_pk.values()}
    assert width == {bits == 16}
    # a block is a packet's elements: 2K at 16 bits
    data = [d for d in ref_pk.values() if d[0] >> 4 == wire.MSG_TYPE_SPARSE]
    assert data and all(len(d) == wire.sparse_payload_len(K, False) for d in data)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_wire16_sparse_sums_equal_the_dense_ones(cluster, dtype):
    """Through the soft aggregator on a 16-bit sparse job: the sparse all-reduce gives the
    dense one's bytes (a block's agreed exponent is the same maximum either way)."""
    make, _agg = cluster
    rng = np.random.default_rng(8)
    xs = [as_dtype(x, dtype) for x in blocky(rng, 3, 40, 0.3, False, np.float32, tail=7)]
    w = make(3, wire_bits=16)
    sparse = w.allreduce(xs, sparse=True)
    dense = w.allreduce(xs, sparse=False)
    for a, b in zip(sparse, dense):
        assert a.dtype == xs[0].dtype and a.tobytes() == b.tobytes()
    st = w.engines[0].stats
    assert st["sparse_allreduces"] == 1 and st["blocks_skipped"] > 0


@pytest.mark.parametrize(
    "kind,wire_bits,sparse",
    [
        pytest.param(np.int32, 32, False, id="int32-dense"),
        pytest.param(np.float32, 16, False, id="float32-wire16-dense"),
        pytest.param(np.int32, 32, True, id="int32-sparse"),
        pytest.param(np.float32, 16, True, id="float32-wire16-sparse"),
    ],
)
def test_early_loss_results_exact_under_loss_and_duplication(cluster, kind, wire_bits, sparse):
    """docs/protocol.md 4.4: with losses found early (early_losses counted), every rank gets the
    same bits, int32 sums are exact, and a sparse all-reduce gives what a dense one of the same
    tensors gives on the same lossy engines, byte for byte, at 32 and 16 bits."""
    make, _agg = cluster
    rng = np.random.default_rng(5)
    faults = dict(send_loss=0.05, recv_loss=0.05, send_duplicate=0.05, recv_duplicate=0.05)
    w = make(3, window=8, faults=faults, wire_bits=wire_bits)
    xs = blocky(rng, 3, 120, 0.5 if sparse else 1.0, False, kind, tail=3)
    got = w.allreduce([x.copy() for x in xs], sparse=sparse)
    assert all(g.tobytes() == got[0].tobytes() for g in got)
    if kind == np.int32:
        np.testing.assert_array_equal(got[0], wrapped_sum(xs))
    if sparse:
        dense = w.allreduce([x.copy() for x in xs], sparse=False)
        assert got[0].tobytes() == dense[0].tobytes()
    stats = [e.stats for e in w.engines]
    assert sum(s["fault_drops"] for s in stats) > 0
    assert sum(s["early_losses"] for s in stats) > 0
