"""The host library against the soft aggregator on loopback: exactness, bounds, loss, errors."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from harness.ranks import init, join_rank, ok, run_ranks, soft_cluster, start_rank

import hostlib
from hostlib import netinfo, scaling
from hostlib.engine import Faults
from hostlib.stream_state import _ranges
from xdp_agg.proto import wire

pytestmark = pytest.mark.timeout(90)


# --- scaling (block floating point) ---------------------------------------------------------
def test_exponents():
    x = np.array([[0.5, -0.25], [1.0, 0.0], [-3.0, 2.0], [0.0, 0.0], [2.0**-140, 0]], np.float32)
    # e = floor(log2(max|x|)) + 1: 0.5 -> 0, 1.0 -> 1, 3.0 -> 2; zeros and tiny clip to -128
    assert scaling.chunk_exponents(x).tolist() == [0, 1, 2, -128, -128]
    big = np.array([[3e38, 1.0]], np.float32)
    assert scaling.chunk_exponents(big).tolist() == [127]  # 128 clipped to int8


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_are_rejected(bad):
    x = np.zeros((3, 4), np.float32)
    x[1, 2] = bad
    with pytest.raises(ValueError, match="at element 6: NaN and Inf"):
        scaling.chunk_exponents(x)


@pytest.mark.parametrize("n", [1, 3, 8])
def test_quantise_round_trip_within_bound_and_never_overflows(n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((50, 64)) * 10.0 ** rng.uniform(-6, 6, (50, 1))).astype(np.float32)
    x[7] = 0.0
    e = scaling.chunk_exponents(x)
    q = scaling.quantise(x, e, n)
    assert np.abs(q.astype(np.int64)).max() <= scaling.int_range(n)
    back = scaling.dequantise(q, e, n).astype(np.float64)
    # one worker's rounding error is at most 1/(2f); the bound for n workers is n times that
    err = np.abs(back - x)
    bound = scaling.error_bound(e, n)[:, None] / n + 2.0**-24 * np.abs(back)
    assert (err <= bound).all()
    assert (back[7] == 0).all()
    # the extreme case: n workers all at the largest magnitude their exponent allows
    top = np.full((1, 64), np.nextafter(np.float32(2.0), np.float32(0)), np.float32)  # < 2^1
    qt = scaling.quantise(top, scaling.chunk_exponents(top), n).astype(np.int64)
    assert (n * qt <= 2**31 - 1).all() and (n * qt > 2**31 - 1 - 2 * n * 2**8).all()


@pytest.mark.parametrize("n", [1, 3, 8, 64])
def test_wire16_quantise_round_trip_within_bound_and_never_overflows(n):
    """At 16 bits: |q| <= pair_range(n), words that n workers sum without a carry between the
    halves (the sums unpack exactly, at the extremes too), and the round trip within the
    16-bit bound."""
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((50, 128)) * 10.0 ** rng.uniform(-6, 6, (50, 1))).astype(np.float32)
    x[7] = 0.0
    e = scaling.chunk_exponents(x)
    words = scaling.quantise(x, e, n, wire_bits=16)
    assert words.shape == (50, 64)
    q = wire.unpack_pairs(words)
    assert np.abs(q.astype(np.int64)).max() <= scaling.int_range(n, 16) == wire.pair_range(n)
    back = scaling.dequantise(words, e, n, wire_bits=16).astype(np.float64)
    err = np.abs(back - x)
    bound = scaling.error_bound(e, n, 16)[:, None] / n + 2.0**-24 * np.abs(back)
    assert (err <= bound).all()
    assert (back[7] == 0).all()
    # n workers all at +-M in every pattern of signs: the int32 word sums unpack exactly
    M = wire.pair_range(n)
    for a, b in [(M, M), (-M, -M), (M, -M), (-M, M), (0, -M), (-M, 0)]:
        w = wire.pack_pairs(np.array([a, b], np.int32)).astype(np.int64) * n
        assert -(2**31) <= w[0] < 2**31
        assert wire.unpack_pairs(w.astype(np.int32)).tolist() == [n * a, n * b]
    # the error bound is the 32-bit one scaled by M32 / M16: about 2^16 times larger
    E = np.array([0, 10, -30], np.int8)
    ratio = scaling.error_bound(E, n, 16) / scaling.error_bound(E, n)
    assert np.allclose(ratio, scaling.int_range(n) / scaling.int_range(n, 16))


def test_values_beyond_2_to_127_saturate_instead_of_wrapping():
    x = np.array([[3e38, -3e38]], np.float32)
    q = scaling.quantise(x, scaling.chunk_exponents(x), 2)
    assert q.tolist() == [[scaling.int_range(2), -scaling.int_range(2)]]


def test_progress_line(capsys):
    from hostlib.stream_state import _Progress

    p = _Progress(number=3, packets=200, plen=1034, t0=0.0)
    p.show(2.0, 50, 1)
    p.close(4.0, 200, 1)
    err = capsys.readouterr().err
    assert "all-reduce #3: 50/200 packets (25%)" in err and "1 retransmissions" in err
    assert err.endswith("200/200 packets (100%), 0.1 MB/s, 1 retransmissions\n")


def test_busy_worker_port_is_explained():
    import socket

    from hostlib.rendezvous import ControlClient

    with soft_cluster() as cl:
        # rank 0 waits at the barrier for rank 1, in vain
        t, errors = start_rank(cl, 0, 2, job="busy", rendezvous_timeout=2.0)
        ctl = ControlClient(cl.server.address, secret=cl.secret)
        port = ctl.request("status", job="busy", wait=5)["job"]["worker_port"]
        ctl.close()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as blocker:
            blocker.bind((cl.worker_ip(1), port))  # rank 1's port is taken on its address
            with pytest.raises(hostlib.HostlibError, match=f"UDP port rank 0 chose, {port}"):
                join_rank(cl, 1, 2, job="busy", rendezvous_timeout=5)
        t.join(15)
        assert errors and "barrier timeout" in str(errors[0])


# --- batched UDP I/O -------------------------------------------------------------------------
def test_gso_send_gro_receive_and_fallback_when_gso_is_refused():
    import errno
    import socket

    from harness.ranks import loopback_prefix

    from hostlib.udp_io import DatagramSocket, RowReceiver

    prefix = loopback_prefix()
    rx = DatagramSocket((f"{prefix}.1", 0))
    tx = DatagramSocket((f"{prefix}.2", 0))
    rows = np.arange(100 * 50, dtype=np.uint32).astype(np.uint8).reshape(100, 50)
    assert tx.send_rows(rows, rx.address) == 100
    assert tx.send_calls == 2 or not tx.gso  # 64 + 36 segments
    recv = RowReceiver(rx, 50, max_rows=256)
    got = recv.drain()
    assert np.array_equal(got, rows)
    if rx.gro:  # a kernel without UDP_GRO hands them over one by one
        assert rx.recv_calls <= 3

    class RefusingGSO:  # a path whose MTU is below the segment size refuses GSO with EINVAL
        def __init__(self, real):
            self.real = real

        def sendmsg(self, *a):
            raise OSError(errno.EINVAL, "Invalid argument")

        def __getattr__(self, name):
            return getattr(self.real, name)

    tx.sock = RefusingGSO(tx.sock)
    assert tx.send_rows(rows[:10], rx.address) == 10 and tx.gso is False
    assert np.array_equal(recv.drain(), rows[:10])
    # datagrams of another length are not rows: counted, skipped
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(b"short", rx.address)
    s2 = tx.sock.real
    s2.sendto(rows[0].tobytes(), rx.address)
    assert rx.wait_readable(1.0)
    assert np.array_equal(recv.drain(), rows[:1]) and recv.malformed == 1
    rx.close()
    tx.close()


def test_ranges_text():
    assert _ranges((3, 4, 5, 9)) == "3-5, 9"
    assert _ranges(()) == "none"


# --- all-reduce through the soft aggregator -------------------------------------------------
def int_inputs(rank: int, length: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed * 1000 + rank)
    # values near the int32 limits, so that the sum wraps
    return rng.integers(-(2**31), 2**31, length, dtype=np.int64).astype(np.int32)


def int_expected(n: int, length: int, seed: int = 0) -> np.ndarray:
    total = sum(int_inputs(r, length, seed).astype(np.int64) for r in range(n))
    return total.astype(np.int32)  # C cast: wraps modulo 2^32 like the aggregator


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_int32_is_bit_exact_with_wraparound(n):
    length = 3000
    with soft_cluster() as cl:
        res = ok(run_ranks(cl, n, lambda c: c.allreduce(int_inputs(c.rank, length)), window=16))
    for r in res:
        assert r.dtype == np.int32 and np.array_equal(r, int_expected(n, length))


def float_inputs(rank: int, length: int, k: int) -> np.ndarray:
    rng = np.random.default_rng(100 + rank)
    chunks = -(-length // k)
    scale = np.repeat(10.0 ** rng.uniform(-4, 4, chunks), k)[:length]  # per-chunk magnitudes
    x = rng.standard_normal(length) * scale
    x[k : 2 * k] = 0.0  # an all-zero chunk on every worker
    return x.astype(np.float32)


def assert_within_scaling_bound(got, inputs, k):
    """The bound of hostlib.scaling: n/(2f) per chunk plus float32 rounding of the result."""
    n, length = len(inputs), len(got)
    exact = sum(x.astype(np.float64) for x in inputs)
    chunks = -(-length // k)
    padded = [np.pad(x, (0, chunks * k - length)).reshape(chunks, k) for x in inputs]
    E = np.max([scaling.chunk_exponents(p) for p in padded], axis=0)  # what the aggregator agrees
    quant = np.repeat(scaling.error_bound(E, n), k)[:length]
    bound = quant * (1 + 1e-6) + 2.0**-24 * np.abs(got.astype(np.float64))
    err = np.abs(got.astype(np.float64) - exact)
    assert (err <= bound).all(), f"worst excess {np.max(err - bound)}"
    assert (got[k : 2 * k] == 0).all()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_float32_within_the_scaling_bound(n):
    length, k = 4000, 256
    with soft_cluster() as cl:
        res = ok(run_ranks(cl, n, lambda c: c.allreduce(float_inputs(c.rank, length, k)), window=8))
    inputs = [float_inputs(r, length, k) for r in range(n)]
    for got in res:
        assert got.dtype == np.float32
        assert_within_scaling_bound(got, inputs, k)
    assert all(np.array_equal(res[0], r) for r in res)  # every rank gets the same bits


def test_float16_and_bfloat16_at_32_bits():
    """wire_bits=32 for the 16-bit types: quantised from them as float32 is (in C without a
    float32 copy), the float32 bound plus the type's rounding."""
    n, length = 2, 1000
    xs = [np.linspace(-4, 4, length).astype(np.float16) * (r + 1) for r in range(n)]

    def body(c):
        out = {"f16": c.allreduce(xs[c.rank], wire_bits=32)}
        try:
            import ml_dtypes  # optional: bfloat16 only when a numpy bfloat16 dtype exists
        except ImportError:
            return out
        out["bf16"] = c.allreduce(xs[c.rank].astype(ml_dtypes.bfloat16), wire_bits=32)
        assert c.stats["wire_bits"] == 32 and c.stats["allreduces"] == 2
        return out

    with soft_cluster() as cl:
        res = ok(run_ranks(cl, n, body))
    exact = sum(x.astype(np.float64) for x in xs)
    for r in res:
        assert r["f16"].dtype == np.float16
        # float16 rounding of the result (half an ulp: 2^-11 relative) dominates
        assert np.allclose(r["f16"].astype(np.float64), exact, rtol=2**-10, atol=1e-6)
        if "bf16" in r:
            exact_bf = sum(x.astype(r["bf16"].dtype).astype(np.float64) for x in xs)
            assert r["bf16"].dtype.name == "bfloat16"
            assert np.allclose(r["bf16"].astype(np.float64), exact_bf, rtol=2**-7, atol=1e-6)


def test_lengths_and_many_tensors_in_a_row_keep_versions_alternating():
    """Lengths 1, k-1, k, k+1, 10k+3 (int32 and float32, a window smaller than most tensors):
    a slot version that did not alternate across tensors would return a stale sum."""
    k, n = 32, 3
    lengths = [1, k - 1, k, k + 1, 10 * k + 3, 7, 10 * k + 3, 1]

    def body(c):
        out = []
        for i, length in enumerate(lengths):
            out.append(c.allreduce(int_inputs(c.rank, length, seed=i)))
            out.append(c.allreduce(float_inputs(c.rank, length, k)))
        return out, c.stats

    with soft_cluster() as cl:
        res = ok(run_ranks(cl, n, body, elems=k, window=4))
        counters = cl.aggregator.counters(0)
    for out, stats in res:
        for i, length in enumerate(lengths):
            assert np.array_equal(out[2 * i], int_expected(n, length, seed=i)), length
            assert_within_scaling_bound(
                out[2 * i + 1], [float_inputs(r, length, k) for r in range(n)], k
            )
        assert stats["allreduces"] == 2 * len(lengths) and stats["stale"] == 0
    assert counters.get("drop_slot_range", 0) == 0 and counters.get("drop_bad_size", 0) == 0


def test_async_handles_out_and_inplace():
    n, length = 2, 2000

    def body(c):
        a = int_inputs(c.rank, length, seed=1)
        b = float_inputs(c.rank, length, 256)
        ha = c.allreduce_async(a)
        hb = c.allreduce_async(b)
        out = np.empty(length, np.int32)
        hc = c.allreduce_async(int_inputs(c.rank, length, seed=2), out=out)
        z = int_inputs(c.rank, 777, seed=3).reshape(7, 111)
        hz = c.allreduce_async(z, inplace=True)
        results = (ha.wait(20), hb.wait(20), hc.wait(20), hz.wait(20))
        assert ha.done() and hz.done()
        assert results[2] is out and results[3] is z
        c.barrier()
        return results, b

    with soft_cluster() as cl:
        res = ok(run_ranks(cl, n, body))
    inputs_b = [float_inputs(r, length, 256) for r in range(n)]
    for (ra, rb, rc, rz), b in res:
        assert np.array_equal(ra, int_expected(n, length, seed=1))
        assert_within_scaling_bound(rb, inputs_b, 256)
        assert np.array_equal(rc, int_expected(n, length, seed=2))
        assert rz.shape == (7, 111)
        assert np.array_equal(rz.reshape(-1), int_expected(n, 777, seed=3))


def test_odd_shapes_and_strides():
    def body(c):
        base = np.arange(40, dtype=np.int32).reshape(4, 10) * (c.rank + 1)
        strided = c.allreduce(base[:, ::3])  # non-contiguous input
        out = np.zeros((4, 20), np.float32)[:, ::2]  # non-contiguous output
        c.allreduce(base.astype(np.float32), out=out)
        scalar = c.allreduce(np.int32(7))
        empty = c.allreduce(np.zeros(0, np.float32))
        return strided, out, scalar, empty

    with soft_cluster() as cl:
        res = ok(run_ranks(cl, 2, body, elems=32))
    base = np.arange(40, dtype=np.int32).reshape(4, 10)
    for strided, out, scalar, empty in res:
        assert np.array_equal(strided, base[:, ::3] * 3)
        assert np.allclose(out, base * 3, rtol=1e-6)
        assert scalar.shape == () and int(scalar) == 14
        assert empty.shape == (0,) and empty.dtype == np.float32


@pytest.mark.parametrize("loss", [0.01, 0.05])
def test_loss_in_both_directions_is_recovered_exactly(loss):
    n, length = 4, 64 * 60

    def body(c):
        out = [c.allreduce(int_inputs(c.rank, length, seed=s)) for s in range(2)]
        out.append(c.allreduce(float_inputs(c.rank, length, 64)))
        return out, c.stats

    faults = Faults(send_loss=loss, recv_loss=loss, seed=7)
    with soft_cluster() as cl:
        res = ok(run_ranks(cl, n, body, elems=64, window=16, retransmit=0.01, faults=faults))
    inputs = [float_inputs(r, length, 64) for r in range(n)]
    for out, stats in res:
        assert np.array_equal(out[0], int_expected(n, length, seed=0))
        assert np.array_equal(out[1], int_expected(n, length, seed=1))
        assert_within_scaling_bound(out[2], inputs, 64)
    assert sum(s["fault_drops"] for _, s in res) > 0
    assert sum(s["retransmissions"] for _, s in res) > 0


def test_duplicated_packets_and_results_are_harmless():
    n, length = 2, 64 * 40

    def body(c):
        return c.allreduce(int_inputs(c.rank, length)), c.stats

    faults = Faults(send_duplicate=0.3, recv_duplicate=0.3, seed=3)
    with soft_cluster() as cl:
        res = ok(run_ranks(cl, n, body, elems=64, window=8, faults=faults))
        counters = cl.aggregator.counters(0)
    for got, stats in res:
        assert np.array_equal(got, int_expected(n, length))
        assert stats["duplicates"] > 0 and stats["results"] == 40
    assert counters.get("dup_pending", 0) + counters.get("retx_answered", 0) > 0


@pytest.mark.parametrize("native", [False, True])
def test_plain_sockets_without_gso_and_gro(native):
    from hostlib.engine import _fastpath

    if native and _fastpath is None:
        pytest.skip("hostlib._fastpath is not built")
    n, length = 2, 5000
    with soft_cluster() as cl:
        res = ok(
            run_ranks(
                cl,
                n,
                lambda c: (c.allreduce(int_inputs(c.rank, length)), c.stats),
                gso=False,
                gro=False,
                native=native,
            )
        )
    for got, stats in res:
        assert np.array_equal(got, int_expected(n, length))
        if not native:
            assert stats["send_calls"] >= stats["packets_sent"]  # one datagram per call
        else:  # sendmmsg: many plain datagrams per call, never one GSO buffer
            assert 0 < stats["send_calls"] <= stats["packets_sent"]


def test_elems_for_mtu_is_the_largest_size_that_fits():
    assert [wire.elems_for_mtu(m) for m in (1500, 3500, 4200, 9000, 65535)] == [
        256,
        768,
        1024,
        2048,
        2048,
    ]
    for mtu in (200, 1500, 3506, 4147, 9000):  # the IPv4 datagram fits, the next size would not
        k = wire.elems_for_mtu(mtu)
        assert wire.frame_len(k) - wire.ETH_HLEN <= mtu
        bigger = [n for n in wire.SIZE_CODE_ELEMS.values() if n > k]
        assert all(wire.frame_len(n) - wire.ETH_HLEN > mtu for n in bigger)
    with pytest.raises(ValueError, match="MTU 100"):
        wire.elems_for_mtu(100)


@pytest.mark.parametrize("native", [False, True])
def test_auto_elems_follow_the_path_mtu(native):
    """elems="auto": the most the path MTU towards the control endpoint allows (loopback's
    65536: 2048 per packet, the jumbo size), and the all-reduce is exact at that size."""
    from hostlib.engine import _fastpath

    if native and _fastpath is None:
        pytest.skip("hostlib._fastpath is not built")
    n, length = 2, 3 * 2048 + 5
    with soft_cluster() as cl:
        res = ok(
            run_ranks(
                cl,
                n,
                lambda c: (c.description.spec.elems, c.allreduce(int_inputs(c.rank, length))),
                elems="auto",
                native=native,
            )
        )
    want = wire.elems_for_mtu(netinfo.path_mtu_towards("127.0.0.1", 9))
    assert want == 2048
    for elems, got in res:
        assert elems == want
        assert np.array_equal(got, int_expected(n, length))


def test_stats_are_counted():
    with soft_cluster() as cl:
        (stats,) = ok(
            run_ranks(
                cl, 1, lambda c: (c.allreduce(np.ones(1000, np.int32)), c.stats)[1], elems=256
            )
        )
    own = {"data_path", "data_path_reason", "elems", "elems_reason", "lanes", "wire_bits"}
    assert set(stats) == set(hostlib.STAT_NAMES) | own
    assert stats["wire_bits"] == 32  # the last all-reduce's (int32)
    assert stats["lanes"] == hostlib.options.DEFAULT_LANES == 1
    assert (stats["data_path"], stats["data_path_reason"]) == ("udp", "")  # the default
    assert (stats["elems"], stats["elems_reason"]) == (256, "given")  # the harness's 256
    assert stats["allreduces"] == 1 and stats["elements"] == 1000
    # first transmissions (a busy host may resend on a timer: docs/protocol.md 4.4)
    sent = stats["packets_sent"] - stats["retransmissions"]
    assert sent == stats["results"] == 4
    assert stats["bytes_sent"] == stats["packets_sent"] * (10 + 1024) and stats["elapsed"] > 0


# --- errors ---------------------------------------------------------------------------------
class AcceptingBackend:
    """A backend that configures nothing: the control endpoint works, no aggregator answers."""

    def __init__(self):
        self._jobs = {}

    def create_job(self, spec):
        self._jobs[spec.job_id] = spec

    def delete_job(self, job_id):
        self._jobs.pop(job_id, None)

    def add_worker(self, worker):
        pass

    def remove_worker(self, job_id, index):
        pass

    def jobs(self):
        return [s.to_dict() for s in self._jobs.values()]


def test_absent_aggregator_gives_a_clear_timeout_within_the_deadline():
    with soft_cluster(backend=AcceptingBackend()) as cl:
        t0 = time.monotonic()
        (err,) = run_ranks(cl, 1, lambda c: c.allreduce(np.ones(100, np.int32)), timeout=1.0)
        took = time.monotonic() - t0
    assert isinstance(err, hostlib.AllreduceTimeout)
    assert took < 6
    text = str(err)
    assert "no result at all from the aggregator at" in text
    assert f"{cl.agg_ip}:{0xBEE0}" in text and "never answered" in text
    assert "no per-worker counters" in text  # this backend cannot tell more
    assert err.outstanding == 1 and err.results == 0 and err.data_address == (cl.agg_ip, 0xBEE0)


@pytest.mark.parametrize("how", ["idle", "closed"])
def test_an_absent_worker_is_named(how):
    """Rank 1 joins but never all-reduces (idle), or has left (closed): rank 0's timeout
    names it."""
    rank1_done = threading.Event()

    def body(c):
        if c.rank == 1:
            if how == "closed":
                c.close()
            rank1_done.wait(20)
            return None
        try:
            c.allreduce(np.ones(300, np.int32), timeout=1.0)
        finally:
            rank1_done.set()

    with soft_cluster() as cl:
        err = run_ranks(cl, 2, body, elems=64, window=4)[0]
    assert isinstance(err, hostlib.AllreduceTimeout), err
    text = str(err)
    if how == "idle":
        assert "lagging: rank 1 (0 contributions)" in text
    else:
        assert "rank 1 left the job at" in text and "behind by" in text
    assert err.diagnosis is not None and err.outstanding == 5


def test_communicator_refuses_work_after_a_timeout():
    def body(c):
        with pytest.raises(hostlib.AllreduceTimeout):
            c.allreduce(np.ones(10, np.int32), timeout=0.3)
        with pytest.raises(hostlib.HostlibError, match="unusable after an earlier failure"):
            c.allreduce(np.ones(10, np.int32))
        return True

    with soft_cluster(backend=AcceptingBackend()) as cl:
        assert ok(run_ranks(cl, 1, body)) == [True]


def test_bad_arguments():
    def body(c):
        with pytest.raises(TypeError, match="float64"):
            c.allreduce(np.ones(3))
        with pytest.raises(ValueError, match="NaN"):
            c.allreduce(np.array([1.0, np.nan], np.float32))
        with pytest.raises(ValueError, match="out must be"):
            c.allreduce(np.ones(3, np.int32), out=np.empty(4, np.int32))
        # a rejected tensor leaves the communicator usable
        return c.allreduce(np.full(5, 2, np.int32))

    with soft_cluster() as cl:
        (got,) = ok(run_ranks(cl, 1, body))
        assert got.tolist() == [2] * 5
        with pytest.raises(ValueError, match="rank 3 is not in 0..1"):
            init(3, 2, cl.endpoint)
        with pytest.raises(ValueError, match="not a wire size"):
            init(0, 2, cl.endpoint, elems=100)


def test_a_second_run_with_a_live_job_name_is_refused():
    def body(c):
        with pytest.raises(hostlib.RendezvousError, match="'test' already exists"):
            init(0, 1, c_endpoint[0], job="test", ip=c_endpoint[1], secret_file=c_endpoint[2])
        return True

    with soft_cluster() as cl:
        c_endpoint = (cl.endpoint, cl.worker_ip(5), cl.secret_file)
        assert ok(run_ranks(cl, 1, body)) == [True]


def test_world_size_mismatch_is_refused(soft):
    cl = soft
    t, errors = start_rank(cl, 0, 2, job="w", rendezvous_timeout=1.0)
    with pytest.raises(ValueError, match="world_size 2, this rank was started with 3"):
        join_rank(cl, 1, 3, job="w", rendezvous_timeout=5)
    t.join(15)
    assert errors and "barrier timeout" in str(errors[0])


def test_elems_auto_takes_what_the_path_and_the_aggregator_allow(monkeypatch):
    """elems="auto" (HostOptions' default): rank 0 takes the most the path MTU towards the
    control endpoint (the loopback: 2048) and the aggregator (its `ping` answer) allow;
    comm.stats says what and why on every rank."""
    from xdp_agg.targets.soft import SoftAggregator

    x = np.arange(5000, dtype=np.int32)

    def body(c):
        return c.allreduce(x), c.stats

    with soft_cluster() as cl:
        got = ok(run_ranks(cl, 2, body, job="wide", elems="auto"))
    assert all(np.array_equal(out, 2 * x) for out, _ in got)
    assert [st["elems"] for _, st in got] == [2048, 2048]
    assert "carries up to 2048" in got[0][1]["elems_reason"]
    assert got[1][1]["elems_reason"] == "the job's, as rank 0 made it"
    # an aggregator that takes fewer sizes (as the P4 target: 32, 64 and 256)
    monkeypatch.setattr(SoftAggregator, "elem_sizes", lambda self: (32, 64, 256), raising=False)
    with soft_cluster() as cl:
        got = ok(run_ranks(cl, 2, body, job="narrow", elems="auto"))
    assert all(np.array_equal(out, 2 * x) for out, _ in got)
    assert [st["elems"] for _, st in got] == [256, 256]
    assert "the aggregator takes up to 256" in got[0][1]["elems_reason"]


def test_allreduce_timeout_copy_keeps_the_facts_it_is_not_told_to_change():
    e = hostlib.AllreduceTimeout(
        "no answer",
        data_address=("198.18.0.1", 48864),
        packets=10,
        outstanding=3,
        outstanding_slots=(1, 2, 3),
        results=7,
    )
    c = e.copy("aggregator 1 of 2: no answer", stripe=1, endpoint=("198.18.0.1", 4000))
    assert c.args[0] == "aggregator 1 of 2: no answer"
    assert (c.data_address, c.packets, c.outstanding, c.outstanding_slots, c.results) == (
        ("198.18.0.1", 48864),
        10,
        3,
        (1, 2, 3),
        7,
    )
    assert (c.stripe, c.endpoint, c.diagnosis) == (1, ("198.18.0.1", 4000), None)
    d = c.with_diagnosis("(rank 1 absent)", {"absent": [1]})
    assert d.args[0] == "aggregator 1 of 2: no answer (rank 1 absent)"
    assert (d.diagnosis, d.stripe, d.outstanding_slots) == ({"absent": [1]}, 1, (1, 2, 3))
    with pytest.raises(TypeError, match="no attribute"):
        e.copy("x", packet=1)


# --- 16-bit elements (docs/protocol.md 5.6) -----------------------------------------------------
def wire16_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        return np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    return np.dtype(name)


# half a unit in the last place, relative: the result's own rounding (from float32)
WIRE16_ROUNDING = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}


def assert_within_wire16_bound(got, inputs, k, name):
    """scaling's bound at 16 bits, per chunk of k elements: n / (2 f) with f from M = (2^15 -
    1) // n, plus float32 rounding, plus the type's rounding of the result (and float16's
    subnormal spacing, 2^-24, half of it)."""
    n, length = len(inputs), len(got)
    xs = [x.astype(np.float64) for x in inputs]
    exact = sum(xs)
    chunks = -(-length // k)
    padded = [np.pad(x, (0, chunks * k - length)).reshape(chunks, k) for x in inputs]
    E = np.max([scaling.chunk_exponents(p) for p in padded], axis=0)
    quant = np.repeat(scaling.error_bound(E, n, 16), k)[:length]
    r = np.abs(got.astype(np.float64))
    bound = quant * (1 + 1e-6) + (2.0**-24 + WIRE16_ROUNDING[name]) * r + 2.0**-25
    err = np.abs(got.astype(np.float64) - exact)
    assert (err <= bound).all(), f"worst excess {np.max(err - bound)}"
    assert (got[k : 2 * k] == 0).all()
    return float(np.max(err / bound))


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_wire16_allreduce_within_the_bound(name, n):
    """bfloat16 and float16 at their default width (16), float32 with wire_bits=16: each rank
    gets the same bits, in the array's own dtype, within scaling.error_bound(E, n, 16) and the
    type's rounding of the exact float64 sum. Rank 0 runs the C loop, the others numpy."""
    from hostlib.engine import _fastpath

    if _fastpath is None:
        pytest.skip("hostlib._fastpath is not built (rank 0 runs the C loop)")
    length, elems = 4000, 64
    k = 2 * elems  # a chunk is a packet's elements: two a word
    dtype = wire16_dtype(name)
    top = 2 if name == "float16" else 4  # float16: sums within its range
    inputs = [float_inputs(r, length, k) for r in range(n)]
    inputs = [(x / 10.0 ** (4 - top)).astype(dtype) for x in inputs]

    def body(c):
        out = c.allreduce(inputs[c.rank], wire_bits=16 if name == "float32" else None)
        return out, c.stats

    with soft_cluster() as cl:
        per = {"per_rank": lambda r: {"native": r == 0 or None}}
        res = ok(run_ranks(cl, n, body, elems=elems, window=8, **per))
    for got, st in res:
        assert got.dtype == dtype and got.shape == (length,)
        assert st["wire_bits"] == 16
        assert_within_wire16_bound(got, inputs, k, name)
        assert got.tobytes() == res[0][0].tobytes()
    # ceil(L / k) data packets (half a 32-bit all-reduce's) and the window; and once, the
    # companion job's token round the 32-bit job: 256 int32
    st = res[0][1]
    assert st["allreduces"] == 2
    assert st["results"] == -(-length // k) + 8 + -(-256 // elems)


def test_wire16_choices_and_bad_input():
    """wire_bits per call: None is 16 for the 16-bit types and 32 for float32 and int32; int32
    at 16 bits, another width and other dtypes are refused before anything is sent, NaN and Inf
    with the 32-bit path's error. The companion job exists once, as "<job>~w16"."""
    n, length = 2, 700
    ml_dtypes = pytest.importorskip("ml_dtypes")

    def body(c):
        seen = []
        x = np.linspace(-1, 1, length, dtype=np.float32) * (c.rank + 1)
        for a, bits in [
            (x, None),
            (x.astype(np.float16), None),
            (x, 16),
            (x.astype(ml_dtypes.bfloat16), 32),
            (x.astype(ml_dtypes.bfloat16), None),
            (np.arange(length, dtype=np.int32), None),
        ]:
            out = c.allreduce(a, wire_bits=bits)
            seen.append((out.dtype.name, c.stats["wire_bits"]))
        sent = c.stats["packets_sent"]
        with pytest.raises(ValueError, match="int32 is exact only at 32 bits"):
            c.allreduce(np.arange(5, dtype=np.int32), wire_bits=16)
        with pytest.raises(ValueError, match="wire_bits must be 32, 16 or None"):
            c.allreduce(x, wire_bits=8)
        with pytest.raises(TypeError, match="not float64"):
            c.allreduce(x.astype(np.float64), wire_bits=16)
        h = x.astype(np.float16)
        h[123] = np.nan
        with pytest.raises(ValueError, match="contains nan at element 123"):
            c.allreduce(h)
        assert c.stats["packets_sent"] == sent  # nothing sent for any of them
        return seen, sorted(c._companions), c._companions[16].job

    with soft_cluster() as cl:
        res = ok(run_ranks(cl, n, body, job="choice", elems=64, window=8))
    for seen, companions, job in res:
        assert seen == [
            ("float32", 32),
            ("float16", 16),
            ("float32", 16),
            ("bfloat16", 32),
            ("bfloat16", 16),
            ("int32", 32),
        ]
        assert companions == [16] and job == "choice~w16"


def test_wire16_width_mismatch_between_ranks_is_a_clear_error():
    """Rank 0 asks for 16 bits where rank 1 asks for 32: neither gets a sum; both fail with
    a HostlibError that says what is missing (no hang, no wrong sum)."""
    x = np.linspace(-1, 1, 3000, dtype=np.float32)

    def body(c):
        return c.allreduce(x, wire_bits=16 if c.rank == 0 else 32)

    t0 = time.monotonic()
    with soft_cluster() as cl:
        res = run_ranks(cl, 2, body, job="mismatch", elems=64, window=8, timeout=2.0,
                        rendezvous_timeout=3.0, deadline=40.0)  # fmt: skip
    # rank 0 waits for rank 1 at the companion job's barrier, which names it; rank 1's 32-bit
    # all-reduce stalls, and the endpoint says rank 0 lags
    assert isinstance(res[0], hostlib.RendezvousError), res
    assert "'mismatch~w16'" in str(res[0]) and "rank(s) 1 of 2 did not register" in str(res[0])
    assert isinstance(res[1], hostlib.AllreduceTimeout) and "lagging: rank 0" in str(res[1])
    assert time.monotonic() - t0 < 40


def test_wire16_over_stripes_and_lanes():
    """A job striped over two aggregators with two lanes at each: its 16-bit companion is too
    (the same endpoints and lanes), and gives the same bits on every rank within the bound."""
    n, length, elems = 2, 40_000, 64
    k = 2 * elems
    inputs = [float_inputs(r, length, k) for r in range(n)]

    def body(c):
        out = c.allreduce(inputs[c.rank], wire_bits=16)
        comp = c._companions[16]
        return out, comp.lanes, len(comp.descriptions), comp.description.spec.wire_bits

    with soft_cluster(aggregators=2) as cl:
        res = ok(run_ranks(cl, n, body, elems=elems, window=8, lanes=2))
    for got, lanes, stripes, bits in res:
        assert (lanes, stripes, bits) == (2, 2, 16)
        assert_within_wire16_bound(got, inputs, k, "float32")
        assert got.tobytes() == res[0][0].tobytes()
