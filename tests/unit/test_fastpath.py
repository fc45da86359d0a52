"""The C loop (hostlib._fastpath) against the numpy reference loop: the same packets byte for
byte, the same results (also under loss, duplication and reordering), the same timeouts, and
AVX2 kernels identical to the scalar ones. Loopback only, no root.

Most tests drive a StreamEngine directly against EchoAggregator (tests/harness/echo.py), a
scripted aggregator that records every datagram and answers each with a deterministic function
of it (as if the other workers had contributed), so that the two loops can be compared on
exactly what they send.
"""

from __future__ import annotations

import socket
import time
from collections import defaultdict

import numpy as np
import pytest
from harness.dtypes import WIRE16_CASES, as_dtype
from harness.echo import EchoAggregator
from harness.ranks import loopback_prefix, ok, run_ranks, soft_cluster

import hostlib
from hostlib import scaling
from hostlib.engine import STAT_NAMES, EngineConfig, Faults, StreamEngine, _fastpath
from hostlib.options import HostOptions
from hostlib.udp_io import DatagramSocket
from xdp_agg.proto import wire

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        _fastpath is None,
        reason="hostlib._fastpath is not built (python setup.py build_ext --inplace)",
    ),
]

HAVE_AVX2 = _fastpath is not None and _fastpath.simd() == "avx2"


def make_engine(
    agg: EchoAggregator,
    native: bool,
    *,
    n: int = 2,
    elems: int = 32,
    window: int = 8,
    faults: Faults | None = None,
    **cfg,
) -> StreamEngine:
    sock = DatagramSocket((agg.worker_ip(), 0))
    rto = cfg.pop("rto", 0.02)
    config = EngineConfig(
        job_id=0,
        scaling_workers=n,
        elems=elems,
        slot_base=5,
        window=window,
        data_address=agg.address,
        rto=rto,
        # the timers' floor at rto unless a test asks: a slow echo on a busy host must not
        # cause spurious expiries where a test counts datagrams
        rto_floor=cfg.pop("rto_floor", rto),
        native=native,
        timeout=cfg.pop("timeout", 10.0),
        **cfg,
    )
    return StreamEngine(sock, config, faults)


def run_sequence(native: bool, tensors, *, agg_kw=None, **engine_kw):
    """All-reduce `tensors` in a row on one engine; (outputs, packets sent, stats)."""
    agg = EchoAggregator(**(agg_kw or {}))
    eng = make_engine(agg, native, **engine_kw)
    try:
        outs = []
        for x in tensors:
            out = np.empty_like(x)
            if x.dtype == np.int32:
                eng.allreduce(x, out)
            else:
                eng.allreduce(x, out)
            outs.append(out)
        time.sleep(0.05)  # late answers and duplicates still on their way
        return outs, agg.packets(), dict(eng.stats)
    finally:
        eng.state.sock.close()
        agg.close()


def mixed_tensors(k: int = 32, window: int = 8) -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    f = rng.standard_normal(20 * k + 5) * 10.0 ** rng.uniform(-5, 5, 20 * k + 5)
    f = f.astype(np.float32)
    f[2 * k : 3 * k] = 0.0  # an all-zero chunk
    f[5 * k + 3] = -0.0
    f[7 * k : 8 * k] = np.float32(2.0**-140)  # subnormals: exponent clipped to -128
    huge = np.full(3 * k + 1, 3e38, np.float32)  # exponent 128 -> E_MAX: clipped at M
    huge[1::2] *= -1
    huge[k : 2 * k] = 1.5
    halves = (np.arange(k, dtype=np.float32) - k / 2) / 4  # float16-exact values, ties at M/2
    f16 = np.linspace(-60000, 60000, 4 * k + 7).astype(np.float16).astype(np.float32)
    return [
        rng.integers(-(2**31), 2**31, 10 * k + 3, dtype=np.int64).astype(np.int32),  # a tail
        f,
        np.arange(5, dtype=np.int32) - 2,  # shorter than one window
        np.array([0.25, -7.0, 1e-3], np.float32),  # one chunk: w = 1
        np.zeros(3 * k, np.float32),
        huge,
        halves,
        f16,
        rng.integers(-5, 5, window * k, dtype=np.int32),  # exactly one window
    ]


# --- (a) the same packets, byte for byte ----------------------------------------------------
@pytest.mark.parametrize("n", [1, 3])
def test_both_loops_send_the_same_bytes_and_get_the_same_results(n):
    tensors = mixed_tensors()
    ref_out, ref_pk, ref_st = run_sequence(False, tensors, n=n)
    nat_out, nat_pk, nat_st = run_sequence(True, tensors, n=n)
    assert len(ref_pk) == sum(
        -(-t.size // 32) + (min(8, -(-t.size // 32)) if t.dtype == np.float32 else 0)
        for t in tensors
    )
    assert set(ref_pk) == set(nat_pk)
    for key in ref_pk:
        assert ref_pk[key] == nat_pk[key], f"packet {key} differs"
    for a, b in zip(ref_out, nat_out):
        assert a.tobytes() == b.tobytes()
    for st in (ref_st, nat_st):
        assert st["results"] == len(ref_pk) and st["retransmissions"] == 0
        assert st["allreduces"] == len(tensors)


def test_without_busy_polling_both_loops_send_the_same_bytes_and_results(monkeypatch):
    """EngineConfig.spin=False (XDP_AGG_SPIN=0, for machines with more workers than cores):
    the numpy loop never spins, and both loops still send the bytes they send when spinning."""
    from hostlib.numpy_dense import NumpyDenseLoop

    tensors = mixed_tensors()
    spun_out, spun_pk, _ = run_sequence(False, tensors)

    def never(self):
        raise AssertionError("spun with spin=False")

    monkeypatch.setattr(NumpyDenseLoop, "_spin", never)
    for native in (False, True):
        out, pk, st = run_sequence(native, tensors, spin=False)
        assert pk == spun_pk and st["retransmissions"] == 0
        assert all(a.tobytes() == b.tobytes() for a, b in zip(out, spun_out))


def test_spin_follows_the_environment(monkeypatch):
    assert HostOptions.from_env().spin is True
    monkeypatch.setenv("XDP_AGG_SPIN", "0")
    assert HostOptions.from_env().spin is False
    assert HostOptions().spin is True  # the environment counts only through from_env
    assert HostOptions.from_env(spin=True).spin is True  # an explicit choice wins


def test_int_results_are_the_echoed_sums():
    """The echo adds add * (tsi + i) to each value: check the C loop's copy-back directly."""
    x = np.arange(3 * 32 + 7, dtype=np.int32) * 1000003
    (out,), _, _ = run_sequence(True, [x], agg_kw={"bump": False, "add": 1})
    p = np.arange(x.size) // 32
    want = (x.astype(np.int64) + p + np.arange(x.size) % 32).astype(np.int32)
    assert np.array_equal(out, want)


def test_scalar_and_avx2_loops_send_the_same_bytes():
    if not HAVE_AVX2:
        pytest.skip("this CPU has no AVX2: only the scalar kernels exist here")
    tensors = mixed_tensors()
    prev = _fastpath.set_simd("scalar")
    try:
        sc_out, sc_pk, _ = run_sequence(True, tensors, n=3)
    finally:
        _fastpath.set_simd(prev)
    av_out, av_pk, _ = run_sequence(True, tensors, n=3)
    assert sc_pk == av_pk
    assert all(a.tobytes() == b.tobytes() for a, b in zip(sc_out, av_out))


# --- (b) the same results under loss, duplication and reordering ----------------------------
def test_same_results_when_the_path_drops_duplicates_and_reorders():
    tensors = mixed_tensors()
    agg_kw = {
        "drop": {t: 1 + t % 2 for t in range(0, 200, 7)},
        "dup": set(range(3, 200, 5)),
        "reverse": True,
    }
    ref_out, ref_pk, ref_st = run_sequence(False, tensors, agg_kw=agg_kw, rto=0.005)
    nat_out, nat_pk, nat_st = run_sequence(True, tensors, agg_kw=agg_kw, rto=0.005)
    assert ref_pk == nat_pk
    assert all(a.tobytes() == b.tobytes() for a, b in zip(ref_out, nat_out))
    for st in (ref_st, nat_st):
        assert st["retransmissions"] > 0 and st["duplicates"] > 0


def test_same_results_under_engine_faults():
    tensors = mixed_tensors()[:3]
    faults = Faults(send_loss=0.1, recv_loss=0.1, send_duplicate=0.2, recv_duplicate=0.2, seed=4)
    ref_out, ref_pk, _ = run_sequence(False, tensors, faults=faults, rto=0.005)
    nat_out, nat_pk, nat_st = run_sequence(True, tensors, faults=faults, rto=0.005)
    assert ref_pk == nat_pk
    assert all(a.tobytes() == b.tobytes() for a, b in zip(ref_out, nat_out))
    assert nat_st["fault_drops"] > 0 and nat_st["retransmissions"] > 0
    assert nat_st["duplicates"] > 0


@pytest.mark.parametrize("native", [False, True])
def test_early_loss_a_resent_packets_slot_waits_for_late_copies(native):
    """A slot whose packet was sent twice takes its next packet only once the last copy is
    rto_floor / 2 old at the least (docs/protocol.md 3.3: a late copy arriving after it would
    count in the slot's next round). A lower bound on time: load only lengthens it. Without
    the wait the next packet goes a round trip after the copy."""
    x = np.arange(40 * 32, dtype=np.int32)
    agg = EchoAggregator(drop={3: 1})  # packet 3's first copy lost: it is sent twice
    # rto_floor 0.1 s: the slot waits 50 ms at least, far longer than a round trip here
    eng = make_engine(agg, native, window=8, elems=32, rto_floor=0.1)
    try:
        eng.allreduce(x, np.empty_like(x))
    finally:
        eng.state.sock.close()
        agg.close()
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for data, t in zip(agg.received, agg.arrived):
        tsi = int.from_bytes(data[2:6], "big")
        first.setdefault(tsi, t)
        last[tsi] = t
    assert last[3] > first[3]  # sent twice
    assert first[3 + 8] - last[3] >= 0.05  # rto_floor / 2, the least the slot waits


@pytest.mark.parametrize("native", [False, True])
def test_a_late_first_answer_counts_as_spurious(native):
    x = np.arange(40 * 32, dtype=np.int32)
    late = {3, 17, 30}
    # packet 39, the last, is lost three times; the late first answers go when its third copy
    # arrives, so they come back before its fourth copy's answer ends the all-reduce
    agg_kw = {"bump": False, "add": 0, "late": late, "late_until": (39, 3), "drop": {39: 3}}
    (out,), _, st = run_sequence(native, [x], agg_kw=agg_kw, rto=0.01)
    assert np.array_equal(out, x)
    assert st["spurious"] == len(late) and st["duplicates"] >= len(late)
    assert set(st) == set(STAT_NAMES)


def test_mixed_loops_in_one_job_with_loss_and_float16_through_the_communicator():
    """Rank 0 runs the C loop, ranks 1 and 2 the numpy one, through the soft aggregator with
    engine faults: every rank gets the same bits, int32 sums are exact."""
    n, length = 3, 64 * 37 + 5
    try:
        import ml_dtypes
    except ImportError:
        ml_dtypes = None

    def inputs(r):
        rng = np.random.default_rng(r)
        xi = rng.integers(-(2**31), 2**31, length, dtype=np.int64).astype(np.int32)
        xf = (rng.standard_normal(length) * 10.0 ** rng.uniform(-3, 3, length)).astype(np.float32)
        return xi, xf, xf.astype(np.float16)

    def body(c):
        xi, xf, xh = inputs(c.rank)
        out = [c.allreduce(xi), c.allreduce(xf), c.allreduce(xh)]
        if ml_dtypes is not None:
            out.append(c.allreduce(xf.astype(ml_dtypes.bfloat16)))
        return out, c._engine.native

    with soft_cluster() as cl:
        results = run_ranks(
            cl,
            n,
            body,
            job="mixed",
            elems=64,
            window=8,
            retransmit=0.01,
            rendezvous_timeout=15,
            per_rank=lambda r: {
                "native": r == 0,
                "faults": Faults(send_loss=0.03, recv_loss=0.03, seed=r),
            },
        )
    res = ok(results)
    assert [native for _, native in res] == [True, False, False]
    want = sum(inputs(r)[0].astype(np.int64) for r in range(n)).astype(np.int32)
    for out, _ in res:
        assert np.array_equal(out[0], want)
        assert out[2].dtype == np.float16
        for got, ref in zip(out, res[0][0]):
            assert got.dtype == ref.dtype and got.tobytes() == ref.tobytes()


# --- (c) timeouts -----------------------------------------------------------------------------
@pytest.mark.parametrize("native", [False, True])
def test_no_answer_at_all_times_out_with_the_diagnosis(native):
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    prefix = loopback_prefix()
    silent.bind((f"{prefix}.1", 0))
    sock = DatagramSocket((f"{prefix}.2", 0))
    cfg = EngineConfig(
        job_id=0,
        scaling_workers=1,
        elems=32,
        slot_base=100,
        window=4,
        data_address=silent.getsockname(),
        native=native,
        timeout=0.4,
        rto=0.05,
    )
    eng = StreamEngine(sock, cfg)
    try:
        t0 = time.monotonic()
        with pytest.raises(hostlib.AllreduceTimeout) as ei:
            eng.allreduce(np.ones(100, np.float32), np.empty(100, np.float32))
        assert 0.35 < time.monotonic() - t0 < 3
        err = ei.value
        assert "got no result at all from the aggregator at" in str(err)
        assert "never answered" in str(err) and "in flight in slot(s) 100-103" in str(err)
        assert err.packets == 8 and err.outstanding == 8 and err.results == 0
        assert err.outstanding_slots == (100, 101, 102, 103)
        assert eng.stats["retransmissions"] > 0
        # the versions advanced as if the all-reduce had completed (8 packets over 4 slots)
        assert eng.state.versions[:4].tolist() == [0, 0, 0, 0] and eng.counter == 1
    finally:
        sock.close()
        silent.close()


def test_a_stall_half_way_gives_the_same_timeout_in_both_loops():
    errors = []
    for native in (False, True):
        agg = EchoAggregator(answer_limit=20)
        eng = make_engine(agg, native, elems=32, window=8, timeout=0.4, rto=0.05)
        try:
            with pytest.raises(hostlib.AllreduceTimeout) as ei:
                eng.allreduce(np.ones(64 * 32, np.int32), np.empty(64 * 32, np.int32))
            errors.append(ei.value)
            assert eng.state.versions.tolist() == [0] * 8  # 64 packets: every slot used 8 times
        finally:
            eng.state.sock.close()
            agg.close()
    for err in errors:
        assert "made no progress for 0.4 s: 44 of 64 packet(s) without a result" in str(err)
        assert "(20 results received from" in str(err)
        assert err.results == 20 and err.outstanding == 44 and len(err.outstanding_slots) > 0


def test_nan_is_rejected_before_anything_is_sent():
    agg = EchoAggregator()
    eng = make_engine(agg, True)
    try:
        x = np.ones(100, np.float32)
        x[77] = np.inf
        with pytest.raises(ValueError, match="contains inf at element 77: NaN and Inf"):
            eng.allreduce(x, np.empty_like(x))
        assert eng.counter == 0 and eng.stats["packets_sent"] == 0
    finally:
        eng.state.sock.close()
        agg.close()


# --- the congestion window ----------------------------------------------------------------
def _cwnd_after(drop, **kw) -> float:
    x = np.arange(300 * 32, dtype=np.int32)
    agg_kw = {"bump": False, "add": 0, "drop": dict(drop), **kw.pop("agg_kw", {})}
    kw.setdefault("rto", 0.005)
    (out,), _, st = run_sequence(True, [x], agg_kw=agg_kw, window=64, **kw)
    assert np.array_equal(out, x)
    return st["cwnd"]


def test_early_loss_window_halves_for_a_queue_not_for_random_loss():
    """docs/protocol.md 4.4: a loss cuts the window where srtt shows a queue (queue_delay above
    the least round trip: here every answer from packet 100 on waits 40 ms, against a
    queue_delay of 10 ms), not for random loss on a path without one (a queue_delay of 0.5 s,
    which no busy host's echo reaches); timers only (early_loss off) cut it for every loss,
    as before; "fixed" never."""
    drop = {t: 1 for t in range(0, 300, 10)}
    assert _cwnd_after(drop, queue_delay=0.5, rto=0.5) == 64
    # rto 0.2 s, above the queue's 40 ms: the queued answers come before any timer, so they give
    # round-trip samples (a resent packet's would not: Karn) and srtt shows the queue whatever
    # the load; with 5 ms timers every queued packet was resent first, and srtt could stay low
    queued = {"queue": (100, 0.04)}
    assert 1 <= _cwnd_after(drop, queue_delay=0.01, rto=0.2, agg_kw=queued) < 64
    assert 1 <= _cwnd_after(drop, early_loss=False) < 64
    assert _cwnd_after(drop, cwnd="fixed", early_loss=False) == 64
    assert _cwnd_after({}) == 64  # slow start reaches the slot window without loss


def test_early_loss_window_holds_when_rounds_wait_for_other_ranks_resends():
    """docs/protocol.md 4.4: a round also waits while another rank resends its lost packet, so
    at n = 8 and 10% loss many answers come late with no queue on the path. Here a third of
    the answers from packet 100 on come 40 ms late (queue_delay 10 ms) besides the random
    losses: the standing round trip (the least of the last 4) stays at the path's, and the
    window is not cut; srtt, which averages the late ones in, would cut it to 1 (the n = 8,
    10% loss collapse: 19 rounds a second)."""
    drop = {t: 1 for t in range(0, 300, 10)}
    waits = {"late": {t for t in range(100, 300) if t % 3 == 0}, "late_s": 0.04}
    assert _cwnd_after(drop, queue_delay=0.01, rto=0.2, agg_kw=waits) == 64


def test_bad_cwnd_mode_is_refused():
    agg = EchoAggregator()
    try:
        with pytest.raises(ValueError, match="cwnd must be 'aimd' or 'fixed'"):
            make_engine(agg, True, cwnd="cubic")
    finally:
        agg.close()


# --- (d) the kernels --------------------------------------------------------------------------
def tricky_floats(k: int, rows: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)) * 10.0 ** rng.uniform(-30, 30, (rows, 1))
    x = x.astype(np.float32)
    x[0] = 0
    x[1, ::3] = np.float32(2.0**-149) * np.arange(1, k + 1, 3)  # subnormals
    x[2] = np.float32(3.3e38)
    x[2, ::2] *= -1
    # exact ties for n = 1 (M odd): x = +-2^(E-1) gives x f = +-M / 2
    x[3] = np.float32(0.5)
    x[3, 1::2] = -0.5
    x[3, 5] = 1.0 - 2**-24
    x[4] = (np.arange(k) - k / 2).astype(np.float32) * np.float32(2.0**-7)
    return x


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_kernels_match_numpy_and_each_other(n):
    k = 77  # not a multiple of the vector width
    x = tricky_floats(k, 40, seed=n)
    flat = x.reshape(-1)[:-5]  # a short last chunk
    rows = -(-flat.size // k)
    padded = np.zeros(rows * k, np.float32)
    padded[: flat.size] = flat
    e_ref = scaling.chunk_exponents(padded.reshape(rows, k))
    agreed = np.maximum(e_ref, np.int8(-3))  # some chunks use a larger agreed exponent
    q_ref = scaling.quantise(padded.reshape(rows, k), agreed, n, out=np.empty((rows, k), ">i4"))
    sums = (np.random.default_rng(n).integers(-(2**31), 2**31, (rows, k))).astype(">i4")
    with np.errstate(over="ignore"):  # sums of values near 2^127 overflow float32: inf
        d_ref = scaling.dequantise(sums, agreed, n).reshape(-1)[: flat.size]
    modes = ["scalar"] + (["avx2"] if HAVE_AVX2 else [])
    prev = _fastpath.simd()
    try:
        for mode in modes:
            _fastpath.set_simd(mode)
            e, bad = _fastpath.chunk_exponents(flat, k)
            assert bad == -1 and np.frombuffer(e, np.int8).tolist() == e_ref.tolist(), mode
            q = _fastpath.quantise(flat, agreed.tobytes(), n, k)
            assert q == q_ref.tobytes(), mode
            d = np.frombuffer(
                _fastpath.dequantise(
                    sums.reshape(-1)[: flat.size].tobytes(), agreed.tobytes(), n, k
                ),
                np.float32,
            )
            assert d.tobytes() == d_ref.tobytes(), mode
    finally:
        _fastpath.set_simd(prev)


def test_chunk_exponents_find_the_first_nan_or_inf():
    x = np.ones(1000, np.float32)
    x[613], x[900] = np.nan, -np.inf
    for mode in ["scalar"] + (["avx2"] if HAVE_AVX2 else []):
        prev = _fastpath.set_simd(mode)
        try:
            assert _fastpath.chunk_exponents(x, 64)[1] == 613
            assert _fastpath.chunk_exponents(x[614:], 64)[1] == 900 - 614
        finally:
            _fastpath.set_simd(prev)
    with pytest.raises(ValueError, match="must be 'avx2' or 'scalar'"):
        _fastpath.set_simd("sse9")


def test_engine_choice_follows_config_and_environment(monkeypatch):
    agg = EchoAggregator()
    try:
        assert make_engine(agg, None).native is True
        assert make_engine(agg, False).native is False
        monkeypatch.setenv("XDP_AGG_NATIVE", "0")
        assert make_engine(agg, HostOptions.from_env().native).native is False
        assert make_engine(agg, HostOptions.from_env(native=True).native).native is True
    finally:
        agg.close()


def test_stats_of_the_native_loop():
    x = np.ones(64 * 100, np.int32)
    _, _, st = run_sequence(True, [x, x], window=16)
    assert set(st) == set(STAT_NAMES)
    assert st["packets_sent"] == st["results"] == 400 and st["allreduces"] == 2
    assert st["bytes_sent"] == 400 * wire.udp_payload_len(32) == st["bytes_received"]
    assert 0 < st["send_calls"] < 400 and 0 < st["recv_calls"] and st["rtt"] > 0
    assert st["elapsed"] > 0 and st["stale"] == st["malformed"] == st["spurious"] == 0


def test_a_closed_engine_keeps_its_counters_and_refuses_all_reduces():
    """close() releases the C loop's data path then (an AF_XDP socket: hostlib/_xsk.c), not
    when the engine is collected; its data path and counters stay readable, an all-reduce
    raises, and a second close does nothing."""
    agg = EchoAggregator()
    eng = make_engine(agg, True)
    try:
        x = np.ones(32 * 10, np.int32)
        eng.allreduce(x, np.empty_like(x))
        eng.close()
        eng.close()
        assert eng.data_path == "udp" and eng.stats["results"] == 10
        with pytest.raises(ValueError, match="the engine is closed"):
            eng.allreduce(x, np.empty_like(x))
    finally:
        eng.state.sock.close()
        agg.close()


def test_stale_and_malformed_datagrams_are_counted():
    agg = EchoAggregator()
    eng = make_engine(agg, True, window=4)
    try:
        x = np.ones(32 * 10, np.int32)
        eng.allreduce(x, np.empty_like(x))
        # a result of that finished all-reduce, and a short datagram, before the next one
        old = agg.result(agg.received[0])
        agg.sock.sendto(old, eng.state.sock.address)
        agg.sock.sendto(b"short", eng.state.sock.address)
        time.sleep(0.05)
        out = np.empty_like(x)
        eng.allreduce(x, out)
        assert eng.stats["stale"] == 1 and eng.stats["malformed"] == 1
        assert eng.stats["results"] == 20
    finally:
        eng.state.sock.close()
        agg.close()


def test_progress_callback_runs_during_a_long_allreduce(capsys):
    agg = EchoAggregator(bump=False, drop={5: 1})
    # stuck on packet 5 for 1.2 s: timers only (later results would show it lost at once)
    eng = make_engine(agg, True, rto=1.2, early_loss=False, progress=True)
    try:
        x = np.ones(32 * 20, np.int32)
        eng.allreduce(x, np.empty_like(x))
    finally:
        eng.state.sock.close()
        agg.close()
    err = capsys.readouterr().err
    assert "hostlib all-reduce #0:" in err and "20/20 packets (100%)" in err


def test_packets_and_counters_per_allreduce_are_independent_of_earlier_failures():
    """After a stalled all-reduce the engine's versions line up again: the next all-reduce with
    a working aggregator sends what a fresh numpy engine sends after the same failure."""
    sent = defaultdict(dict)
    for native in (False, True):
        agg = EchoAggregator(answer_limit=5)
        eng = make_engine(agg, native, window=4, timeout=0.3, rto=0.05)
        try:
            with pytest.raises(hostlib.AllreduceTimeout):
                eng.allreduce(np.ones(32 * 9, np.int32), np.empty(32 * 9, np.int32))
            agg.answer_limit = None
            x = np.arange(32 * 6, dtype=np.int32)
            eng.allreduce(x, np.empty_like(x))
            time.sleep(0.05)
            sent[native] = {key: v for key, v in agg.packets().items() if key[0] == 1}
        finally:
            eng.state.sock.close()
            agg.close()
    assert len(sent[False]) == 6 and sent[False] == sent[True]


def test_ranks_with_small_congestion_windows_do_not_wait_for_each_other():
    """Heavy loss keeps the congestion windows small and makes the ranks see results in
    different orders. A window that let each rank choose which ready packets go first could
    leave rank A waiting on a packet that rank B holds back and vice versa; the C loop always
    lets the lowest unfinished packet go, so the stream keeps moving."""
    n, length, reps = 3, 64 * 40, 6

    def body(c):
        out = [c.allreduce(np.arange(length, dtype=np.int32) + i) for i in range(reps)]
        return out, c.stats

    with soft_cluster() as cl:
        results = run_ranks(
            cl,
            n,
            body,
            job="aimd",
            elems=64,
            window=16,
            timeout=5.0,
            retransmit=0.005,
            rendezvous_timeout=15,
            native=True,
            early_loss=False,  # timers only: their loss keeps the windows small (4.4)
            per_rank=lambda r: {"faults": Faults(send_loss=0.05, recv_loss=0.25, seed=r)},
        )
    for out, stats in ok(results):
        for i, got in enumerate(out):
            assert np.array_equal(got, (np.arange(length) + i).astype(np.int32) * n)
        assert stats["cwnd"] < 16 and stats["retransmissions"] > 0


# --- (g) the extension's interface -------------------------------------------------------------
def test_the_engine_takes_keyword_arguments_only():
    with pytest.raises(TypeError, match="keyword arguments only"):
        _fastpath.Engine(3, "127.0.0.1", 9, 32, 4, 1, 0, 0, 0.01, 0.25)
    with pytest.raises(ValueError, match="Engine needs fd, host"):
        _fastpath.Engine(fd=3, host="127.0.0.1", port=9)


def test_a_build_with_other_wire_constants_refuses_to_import():
    """hostlib.native_stream checks the constants the extension was built with (fp_wire.h,
    generated from xdp_agg.proto.wire) with an if, not an assert that python -O would strip."""
    import types

    from hostlib import native_stream

    assert set(_fastpath.WIRE) >= {"VALUES_AT", "EXP_HLEN", "POOL_SLOT_MASK"}
    native_stream._check_wire(_fastpath)  # the build under test is current
    stale = types.SimpleNamespace(**{n: getattr(_fastpath, n) for n in _fastpath.WIRE})
    stale.WIRE, stale.VALUES_AT = _fastpath.WIRE, wire.VALUES_AT + 2
    with pytest.raises(ImportError, match=r"VALUES_AT 12 \(xdp_agg.proto.wire: 10\)"):
        native_stream._check_wire(stale)


# --- (e) 16-bit elements and 16-bit types (docs/protocol.md 5.6) --------------------------------


def wire16_tensors(dtype: str) -> list[np.ndarray]:
    """mixed_tensors' float ones in `dtype`, and one with float16 subnormals and halfway
    cases."""
    out = [as_dtype(t, dtype) for t in mixed_tensors() if t.dtype == np.float32]
    tiny = np.float32(2.0**-24) * np.arange(-40, 41, dtype=np.float32)  # float16 subnormals
    return out + [as_dtype(tiny, dtype)]


@pytest.mark.parametrize("dtype, bits", WIRE16_CASES)
@pytest.mark.parametrize("n", [1, 3])
def test_wire16_both_loops_and_kernels_send_the_same_bytes(dtype, bits, n):
    """Each type at each width: numpy, the C loop with AVX2 and with scalar kernels send the
    same packets (half as many at 16 bits) and write the same results in the tensor's type."""
    tensors = wire16_tensors(dtype)
    ref_out, ref_pk, ref_st = run_sequence(False, tensors, n=n, wire_bits=bits)
    runs = [run_sequence(True, tensors, n=n, wire_bits=bits)]
    if HAVE_AVX2:
        prev = _fastpath.set_simd("scalar")
        try:
            runs.append(run_sequence(True, tensors, n=n, wire_bits=bits))
        finally:
            _fastpath.set_simd(prev)
    ke = 32 * 32 // bits  # a packet's elements
    assert len(ref_pk) == sum(-(-t.size // ke) + min(8, -(-t.size // ke)) for t in tensors)
    for out, pk, st in runs:
        assert pk == ref_pk
        for a, b in zip(ref_out, out):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
        assert st["results"] == len(ref_pk) and st["retransmissions"] == 0
    assert {bool(p[0] & wire.TYPE_SIZE_WIRE16_MASK) for p in ref_pk.values()} == {bits == 16}


def wire16_kernel_inputs(dtype: str, k: int, n: int):
    """Chunks of tricky values in `dtype` (flat, a short last chunk), their agreed exponents
    (some above their own) and random sums, (flat, rows, agreed, sums as words)."""
    x = tricky_floats(k, 40, seed=n)
    if dtype != "float32":  # within the type's range, its subnormals included
        top = 6e4 if dtype == "float16" else 3e38
        x = np.clip(x * np.float32(2.0**-100 if dtype == "float16" else 1), -top, top)
        x[5] = np.float32(2.0**-24) * (np.arange(k) - k // 2)
    flat = as_dtype(x.reshape(-1)[:-5], dtype)
    rows = -(-flat.size // k)
    padded = np.zeros(rows * k, flat.dtype)
    padded[: flat.size] = flat
    agreed = np.maximum(scaling.chunk_exponents(padded.reshape(rows, k)), np.int8(-20))
    return flat, padded.reshape(rows, k), agreed


@pytest.mark.parametrize("dtype, bits", WIRE16_CASES)
@pytest.mark.parametrize("n", [1, 3, 64])
def test_wire16_kernels_match_numpy(dtype, bits, n):
    """_fastpath's chunk exponents, quantise and dequantise of each type at each width, AVX2
    and scalar, against hostlib.scaling (the numpy loop's)."""
    k = 78 if bits == 16 else 77  # not a multiple of the vector width (two elements a word)
    flat, rows, agreed = wire16_kernel_inputs(dtype, k, n)
    words = k * bits // 32
    q_ref = scaling.quantise(rows, agreed, n, np.empty((len(rows), words), ">i4"), None, bits)
    rng = np.random.default_rng(n)
    sums = rng.integers(-(2**31), 2**31, (len(rows), words)).astype(">i4")
    with np.errstate(over="ignore"):  # sums of values near the top overflow: inf
        d_ref = scaling.dequantise(sums, agreed, n, np.empty(rows.shape, flat.dtype), bits)
    d_ref = d_ref.reshape(-1)[: flat.size]
    nwords = -(-flat.size * bits // 32)
    prev = _fastpath.simd()
    try:
        for mode in ["scalar"] + (["avx2"] if HAVE_AVX2 else []):
            _fastpath.set_simd(mode)
            e, bad = _fastpath.chunk_exponents(flat, k, dtype)
            want = scaling.chunk_exponents(rows)
            assert bad == -1 and np.frombuffer(e, np.int8).tolist() == want.tolist(), mode
            q = _fastpath.quantise(flat, agreed.tobytes(), n, k, dtype, bits)
            assert q == q_ref.tobytes(), mode
            s = sums.reshape(-1)[:nwords].tobytes()
            d = _fastpath.dequantise(s, agreed.tobytes(), n, k, dtype, bits)
            d = np.frombuffer(d, flat.dtype)[: flat.size]
            assert d.tobytes() == d_ref.tobytes(), mode
    finally:
        _fastpath.set_simd(prev)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_wire16_narrowing_rounds_to_nearest_even_like_numpy(dtype):
    """The C loop's float32 -> bfloat16/float16 (the scalar routines, AVX2's rounding, F16C)
    against numpy's astype, on the float32 values of random sums over every exponent: normal
    values, the type's subnormals, float16's overflow to Inf, and ties (asserted present)."""
    k, chunks = 64, 4096
    rng = np.random.default_rng(3)
    sums = rng.integers(-(2**31), 2**31, chunks * k).astype(">i4")
    sums[::31] &= ~0xFFF  # more values whose float32 ends in a tie of the 16-bit type
    E = np.resize(np.arange(-128, 128, dtype=np.int8), chunks)
    out = np.empty((chunks, k), as_dtype(np.zeros(1, np.float32), dtype).dtype)
    with np.errstate(over="ignore"):
        ref = scaling.dequantise(sums.reshape(chunks, k), E, 1, out, 32)
        f32 = scaling.dequantise(sums.reshape(chunks, k), E, 1).view(np.uint32)
    cut = 16 if dtype == "bfloat16" else 13
    ties = np.count_nonzero((f32 & ((1 << cut) - 1)) == 1 << (cut - 1))
    assert ties > 10
    assert np.isinf(ref.astype(np.float32)).any() == (dtype == "float16")  # below bf16 max
    for mode in ["scalar"] + (["avx2"] if HAVE_AVX2 else []):
        prev = _fastpath.set_simd(mode)
        try:
            got = _fastpath.dequantise(sums.tobytes(), E.tobytes(), 1, k, dtype, 32)
        finally:
            _fastpath.set_simd(prev)
        assert got == ref.tobytes(), mode


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_wire16_chunk_exponents_find_the_first_nan_or_inf(dtype):
    x = as_dtype(np.ones(1000, np.float32), dtype)
    x[613], x[900] = np.nan, -np.inf
    for mode in ["scalar"] + (["avx2"] if HAVE_AVX2 else []):
        prev = _fastpath.set_simd(mode)
        try:
            assert _fastpath.chunk_exponents(x, 64, dtype)[1] == 613
            assert _fastpath.chunk_exponents(x[614:], 64, dtype)[1] == 900 - 614
            assert _fastpath.block_scan(x, 64, dtype)[2] == 613
        finally:
            _fastpath.set_simd(prev)


@pytest.mark.parametrize("native", [False, True])
def test_wire16_engine_refuses_int32_and_nan_before_sending(native):
    agg = EchoAggregator()
    eng = make_engine(agg, native, wire_bits=16)
    try:
        x = np.arange(100, dtype=np.int32)
        with pytest.raises(ValueError, match="int32 is exact only at 32 bits"):
            eng.allreduce(x, np.empty_like(x))
        h = as_dtype(np.ones(300, np.float32), "float16")
        h[77] = np.inf
        with pytest.raises(ValueError, match="contains inf at element 77"):
            eng.allreduce(h, np.empty_like(h))
        time.sleep(0.02)
        assert agg.packets() == {} and eng.stats["packets_sent"] == 0
    finally:
        eng.state.sock.close()
        agg.close()


def test_wire16_the_c_engine_checks_dtype_and_width_itself():
    """_fastpath.Engine refuses an unknown dtype, int32 on a 16-bit stream and another width,
    whoever calls it (hostlib.engine checks first; the C type does not rely on that)."""
    agg = EchoAggregator()
    eng = make_engine(agg, True, wire_bits=16)
    fast = eng.stream.fast
    x = np.zeros(64, np.int32)
    try:
        for dtype, match in [("int32", "int32 is exact only at 32 bits"), ("int64", "dtype must")]:
            with pytest.raises(ValueError, match=match):
                fast.allreduce(dtype, x, x, 1, 1, 0, b"\0", None, 1.0)
        with pytest.raises(ValueError, match="wire_bits must be 32 or 16, not 8"):
            _fastpath.Engine(
                fd=eng.state.sock.fileno(), host="127.0.0.1", port=9, elems=32, window=4,
                scaling_workers=1, type_size=0x10, slot_base=0, rto=0.01, rto_max=0.25,
                wire_bits=8,
            )  # fmt: skip
    finally:
        eng.state.sock.close()
        agg.close()


# --- (e) early loss detection (docs/protocol.md 4.4) -------------------------------------------
@pytest.mark.parametrize("native", [False, True])
def test_early_loss_found_from_later_results_not_the_timer(native):
    """Packet 5's first copy gets no answer; its timer is at least 1 s, so only the results of
    packets sent after it can have shown it lost: one early resend, no timer expired."""
    x = np.arange(60 * 32, dtype=np.int32)
    agg_kw = {"bump": False, "add": 0, "drop": {5: 1}}
    (out,), _, st = run_sequence(native, [x], agg_kw=agg_kw, rto=1.0, rto_floor=1.0)
    assert np.array_equal(out, x)
    assert (st["early_losses"], st["timeouts"], st["retransmissions"]) == (1, 0, 1)


@pytest.mark.parametrize("native", [False, True])
def test_early_loss_off_waits_for_the_timer(native):
    x = np.arange(60 * 32, dtype=np.int32)
    agg_kw = {"bump": False, "add": 0, "drop": {5: 1}}
    (out,), _, st = run_sequence(native, [x], agg_kw=agg_kw, rto=0.02, early_loss=False)
    assert np.array_equal(out, x)
    assert (st["early_losses"], st["timeouts"], st["retransmissions"]) == (0, 1, 1)


@pytest.mark.parametrize("native", [False, True])
def test_early_loss_of_a_resend_is_found_early_too(native):
    """Packet 5 loses its first three copies: each resend is shown lost by the results of the
    packets sent after it, as the first copy was (no timer of 1 s expired)."""
    x = np.arange(80 * 32, dtype=np.int32)
    agg_kw = {"bump": False, "add": 0, "drop": {5: 3}}
    (out,), _, st = run_sequence(native, [x], agg_kw=agg_kw, rto=1.0, rto_floor=1.0)
    assert np.array_equal(out, x)
    assert (st["early_losses"], st["timeouts"]) == (3, 0)


@pytest.mark.parametrize("native", [False, True])
def test_early_loss_reordered_answers_are_not_losses(native):
    """Every batch of answers comes back in reverse order, in one GSO send (so it is all there
    at once): the drain takes a whole batch before anything is judged lost, so reordering
    within it costs no resend."""
    x = np.arange(60 * 32, dtype=np.int32)
    agg_kw = {"bump": False, "add": 0, "reverse": True, "gso": True}
    (out,), _, st = run_sequence(native, [x], agg_kw=agg_kw, rto=1.0, rto_floor=1.0)
    assert np.array_equal(out, x)
    assert st["retransmissions"] == st["spurious"] == 0


def test_early_loss_a_slot_after_a_resent_round_waits_for_the_hold():
    """docs/protocol.md 4.4: a worker that resent a slot's round holds its copy of the slot's
    next packet (late_copies: 1 srtt, at least rto_floor / 2), so the other workers find that
    next packet lost only a round trip after the hold, not at 2 srtt, where every resend made
    them resend too. A slot whose round was neither resent nor slow keeps 2 srtt."""
    from hostlib.loss_detect import LOSS_AGE_RTTS, Rack, RttEstimator, late_copy_hold, loss_age
    from hostlib.stream_state import EngineConfig

    cfg = EngineConfig(1, 1, 32, 0, 4, ("198.18.0.1", 1), rto_floor=0.002)
    rtt = RttEstimator()
    for _ in range(20):
        rtt.update(0.0002)
    srtt = rtt.srtt
    assert loss_age(rtt, cfg, True) == late_copy_hold(srtt, cfg) + srtt == 0.001 + srtt
    rack = Rack(4)
    rack.sent(0, 4, 0, now=0.0)  # packets 0..3 in slots 0..3
    tries = np.array([1, 0, 0, 0])  # slot 0's round was resent, slot 1's came in time ...
    rack.took(0, 2, tries[:2], now=0.0003, rtt=rtt)
    rack.took(2, 3, tries[2:3], now=0.0009, rtt=rtt)  # ... slot 2's late (> 2 srtt): slow
    assert list(rack.held[:3]) == [True, False, True]
    rack.sent(0, 3, 4, now=0.001)  # packets 4, 5, 6 take slots 0, 1, 2
    rack.sent(3, 4, 7, now=0.0011)  # and packet 7 slot 3, after them
    rack.took(3, 4, tries[3:], now=0.0013, rtt=rtt)  # 7's result: evidence against 4, 5, 6
    deadline = np.full(4, 1.0)
    deadline[3] = np.inf
    rack.detect(deadline, 0.0013, rtt, cfg)
    assert deadline[1] == pytest.approx(0.001 + LOSS_AGE_RTTS * srtt)  # as before
    assert deadline[0] == deadline[2] == pytest.approx(0.001 + loss_age(rtt, cfg, True))


def test_early_loss_a_late_result_is_late_within_the_round_trips_spread():
    """docs/protocol.md 4.4: a packet is found lost by evidence only once older than 2 srtt or
    srtt + 4 rttvar, whichever is more: where round trips spread (a busy host's softirq late
    on one CPU), a result that late is no loss."""
    from hostlib.loss_detect import LOSS_AGE_RTTS, RttEstimator, loss_age
    from hostlib.stream_state import EngineConfig

    cfg = EngineConfig(1, 1, 32, 0, 4, ("198.18.0.1", 1))

    steady, jittery = RttEstimator(), RttEstimator()
    for i in range(50):
        steady.update(0.001)
        jittery.update(0.0005 if i % 2 else 0.0015)  # the same mean, spread by 0.5 ms
    assert loss_age(steady, cfg, False) == pytest.approx(LOSS_AGE_RTTS * steady.srtt)
    assert loss_age(jittery, cfg, False) == pytest.approx(jittery.srtt + 4 * jittery.rttvar)
    assert loss_age(jittery, cfg, False) > LOSS_AGE_RTTS * jittery.srtt


def test_early_loss_timer_floor_follows_the_round_trip():
    """docs/protocol.md 4.4: rto until a round trip is measured; then srtt + 4 rttvar above a
    floor of 3 srtt (at least rto_floor, at most rto); timers only: the floor is rto."""
    from hostlib.loss_detect import RttEstimator

    e = RttEstimator()
    assert e.rto(0.015, 0.25, 0.002) == 0.015
    for _ in range(50):
        e.update(0.0001)  # 100 us, steady: rttvar decays
    assert e.min_rtt == 0.0001
    assert e.rto(0.015, 0.25, 0.002) == 0.002  # the least floor
    assert e.rto(0.015, 0.25, None) == 0.015  # timers only
    for _ in range(50):
        e.update(0.004)
    assert 0.0115 <= e.rto(0.015, 0.25, 0.002) <= 0.015  # 3 srtt, at most rto
    assert e.reo_wnd() == 0.0001 / 4
    e.needless(3)  # resends answered too soon: more reordering allowed, the floor raised
    assert e.reo_wnd() == 4 * 0.0001 / 4
    assert e.rto(0.015, 0.25, 0.002) == 0.015  # 8 x 3 srtt, at most rto
    e.early(16)
    assert e.reo_wnd() == 2 * 0.0001 / 4
    for _ in range(50):
        e.update(0.0001)
    e.run_ended(e.needless_count)  # an all-reduce without a needless resend: the floor falls
    assert e.floor_mult == 4 and e.rto(0.015, 0.25, 0.002) == 4 * 0.002
    e.timers_expired(np.array([0, 2]))  # back-off as far as the most expired packet's: 2^3
    assert e.backoff == 8 and e.rto(0.015, 0.25, 0.002) == 8 * 4 * 0.002
    e.update(0.0001)  # a round trip sampled: no back-off
    assert e.backoff == 1


@pytest.mark.parametrize("native", [False, True])
def test_early_loss_after_a_burst_the_probe_restarts_the_window(native):
    """A burst: the 32 datagrams from the 100th on get no answer, the window in flight (16) and
    the resends that follow. While nothing answers, a timer's expiry resends the earliest
    expired packet alone (RFC 6298 5.4), not the window: the 16 resends of the burst go one at
    a time. The lowest packet's timer, which does not double (a probe), then goes through; its
    answer shows the 15 others lost, and they go at once, found early, rather than on their
    own doubled timers (which would make early_losses 0)."""
    x = np.arange(200 * 32, dtype=np.int32)
    agg_kw = {"bump": False, "add": 0, "blackout": (100, 32)}
    (out,), _, st = run_sequence(native, [x], agg_kw=agg_kw, window=16, rto=0.02)
    assert np.array_equal(out, x)
    assert st["retransmissions"] == 32  # 16 in the burst, the probe, the 15 found early
    assert 1 <= st["timeouts"] < 16  # one at a time: never the whole window at once
    assert st["early_losses"] >= 15  # and went again on the probe's evidence
