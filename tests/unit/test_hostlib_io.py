"""The host library's batched receive (recvmmsg, with and without UDP GRO), the in-thread
all-reduce, and the progress display (loopback, no root)."""

from __future__ import annotations

import io
import socket
import sys
import threading

import numpy as np
import pytest
from harness.ranks import loopback_prefix, ok, run_ranks, soft_cluster

from hostlib import udp_io
from hostlib.udp_io import DatagramSocket, RowReceiver

pytestmark = pytest.mark.timeout(60)


def _pair(gro: bool):
    prefix = loopback_prefix()
    rx = DatagramSocket((f"{prefix}.1", 0), gro=gro)
    tx = DatagramSocket((f"{prefix}.2", 0))
    return rx, tx


def _rows(m: int, plen: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (m, plen), dtype=np.uint8)


@pytest.mark.skipif(not udp_io._HAVE_MMSG, reason="no recvmmsg in this libc")
def test_one_recvmmsg_drains_many_plain_datagrams():
    rx, tx = _pair(gro=False)
    try:
        rows = _rows(200, 40)
        tx.gso = False  # 200 separate datagrams
        assert tx.send_rows(rows, rx.address) == 200
        recv = RowReceiver(rx, 40, max_rows=256)
        got = recv.drain()
        assert np.array_equal(got, rows) and rx.recv_calls == 1
        assert len(recv.drain()) == 0 and recv.bytes == 200 * 40
        # a short datagram and a long one (truncated to the row) are not rows
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"short", rx.address)
            s.sendto(bytes(41), rx.address)
            s.sendto(rows[3].tobytes(), rx.address)
        assert rx.wait_readable(1.0)
        got = recv.drain()
        assert np.array_equal(got, rows[3:4]) and recv.malformed == 2
    finally:
        rx.close()
        tx.close()


@pytest.mark.skipif(not udp_io._HAVE_MMSG, reason="no recvmmsg in this libc")
def test_recvmmsg_with_gro_keeps_order_across_coalesced_and_single_datagrams():
    rx, tx = _pair(gro=True)
    try:
        plen = 50
        rows = _rows(150, plen, seed=1)
        assert tx.send_rows(rows[:100], rx.address) == 100  # GSO: 64 + 36 segments
        tx.sock.sendto(rows[100].tobytes(), rx.address)  # one plain datagram
        assert tx.send_rows(rows[101:150], rx.address) == 49
        recv = RowReceiver(rx, plen, max_rows=256)
        got = recv.drain()
        assert np.array_equal(got, rows) and recv.malformed == 0
        if rx.gro:
            assert rx.recv_calls == 1
        # a coalesced buffer whose last datagram is shorter: the full rows stay, one malformed
        buf = np.concatenate([rows[:5].reshape(-1), rows[5, :20]])
        tx.sock.sendmsg(
            [buf.tobytes()],
            [(udp_io.SOL_UDP, udp_io.UDP_SEGMENT, plen.to_bytes(2, sys.byteorder))],
            0,
            rx.address,
        )
        assert rx.wait_readable(1.0)
        got = recv.drain()
        assert np.array_equal(got, rows[:5]) and recv.malformed == 1
        # single datagrams only: rows are a view of the receive slots, 64 KiB apart
        tx.gso = False
        tx.send_rows(rows[:3], rx.address)
        got = recv.drain()
        assert np.array_equal(got, rows[:3])
    finally:
        rx.close()
        tx.close()


def test_the_recvmsg_fallback_still_works(monkeypatch):
    monkeypatch.setattr(udp_io, "_HAVE_MMSG", False)
    rx, tx = _pair(gro=True)
    try:
        rows = _rows(70, 30, seed=2)
        assert tx.send_rows(rows, rx.address) == 70
        recv = RowReceiver(rx, 30, max_rows=256)
        assert recv._mm is None
        assert np.array_equal(recv.drain(), rows)
    finally:
        rx.close()
        tx.close()


def test_lengths_around_the_packet_size_with_gro_off_and_on():
    """Tensors of k-1, k, k+1 and many k + 1 elements, float32 and int32, in and out of place,
    through sockets with GRO on and off: the padded last row has a buffer of its own."""
    k, n = 64, 2

    def body(c):
        out = []
        for i, length in enumerate([k - 1, k, k + 1, 40 * k + 1]):
            xi = np.arange(length, dtype=np.int32) * (c.rank + 1) + i
            xf = (np.arange(length, dtype=np.float32) - length / 2) * (c.rank + 1)
            out.append((length, c.allreduce(xi), c.allreduce(xf.copy(), inplace=True)))
        return out

    for gro in (False, True):
        with soft_cluster() as cl:
            res = ok(run_ranks(cl, n, body, elems=k, window=8, gro=gro))
        for per_rank in res:
            for i, (length, si, sf) in enumerate(per_rank):
                base = np.arange(length, dtype=np.int64)
                assert np.array_equal(si, (base * 3 + 2 * i).astype(np.int32))
                assert np.allclose(sf, (base - length / 2) * 3, rtol=1e-6, atol=1e-3)


def test_blocking_allreduce_runs_in_the_callers_thread_and_keeps_order_behind_async_ones():
    def body(c):
        eng = c._engine
        threads = []
        real = eng.dense_loop.run  # the dense loop this engine runs (C or numpy)

        def spy(*args):
            threads.append(threading.current_thread().name)
            return real(*args)

        eng.dense_loop.run = spy
        a = c.allreduce(np.full(10, c.rank + 1, np.int32))  # nothing queued: this thread
        h1 = c.allreduce_async(np.full(3000, 1, np.int32))
        h2 = c.allreduce_async(np.full(3000, 2, np.int32))
        b = c.allreduce(np.full(10, 5, np.int32))  # behind two queued ones: the executor, in order
        r1, r2 = h1.wait(20), h2.wait(20)
        return a, r1, r2, b, threads, threading.current_thread().name

    with soft_cluster() as cl:
        res = ok(run_ranks(cl, 2, body, elems=64, window=8))
    for a, r1, r2, b, threads, me in res:
        assert (a == 3).all() and (r1 == 2).all() and (r2 == 4).all() and (b == 10).all()
        assert threads[0] == me
        assert all(t.startswith("hostlib-r") for t in threads[1:]) and len(threads) == 4


def test_progress_prints_whole_lines_when_stderr_is_not_a_terminal(monkeypatch):
    from hostlib.stream_state import _Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    for stream, tty in ((io.StringIO(), False), (Tty(), True)):
        monkeypatch.setattr(sys, "stderr", stream)
        p = _Progress(number=1, packets=100, plen=1000, t0=0.0)
        assert p.next == 1.0
        p.show(1.0, 10, 0)
        assert p.next == (1.5 if tty else 6.0)
        p.show(6.0, 60, 2)
        p.close(7.0, 100, 2)
        text = stream.getvalue()
        if tty:
            assert text.startswith("\rhostlib all-reduce #1: 10/100") and text.endswith(
                "2 retransmissions\n"
            )
            assert text.count("\n") == 1
        else:
            lines = text.splitlines()
            assert len(lines) == 3 and "\r" not in text and text.endswith("\n")
            assert lines[0].startswith("hostlib all-reduce #1: 10/100 packets (10%)")
            assert lines[2].startswith("hostlib all-reduce #1: 100/100 packets (100%)")


def test_stats_count_one_receive_call_per_batch(monkeypatch):
    """The numpy loop's RowReceiver (one recvmmsg a batch) as the stats count it. The numpy loop,
    not the C loop: a Python aggregator answers one result at a time, which the C loop takes as
    it comes (a wake-up and a call that finds nothing more: about 1.5 calls a result, measured
    on 2026-12-06), while the numpy loop, slower, finds them waiting (14 calls for 200)."""
    monkeypatch.setenv("XDP_AGG_NATIVE", "0")
    with soft_cluster() as cl:
        (stats,) = ok(
            run_ranks(
                cl,
                1,
                lambda c: (c.allreduce(np.ones(64 * 200, np.int32)), c.stats)[1],
                elems=64,
                window=64,
            )
        )
    # first transmissions (a busy host may resend on a timer: docs/protocol.md 4.4)
    assert stats["results"] == 200 == stats["packets_sent"] - stats["retransmissions"]
    if udp_io._HAVE_MMSG:
        assert stats["recv_calls"] < stats["results"]


def test_busy_poll_earns_credit_when_results_come_and_backs_off_when_they_do_not():
    from hostlib.engine import EngineConfig, StreamEngine
    from hostlib.numpy_dense import _SPIN_BACKOFF

    rx, tx = _pair(gro=True)
    try:
        # job 0, one worker, 32 elements, slots 0..3; the numpy loop is the one that busy-polls
        cfg = EngineConfig(0, 1, 32, 0, 4, tx.address, native=False)
        eng = StreamEngine(rx, cfg).dense_loop
        assert len(eng._spin()) == 0  # nothing arrives: a failed spin, spinning stops
        assert eng._spin_credit == -_SPIN_BACKOFF
        calls = rx.recv_calls
        assert len(eng._spin()) == 0 and rx.recv_calls == calls  # skipped, not spun
        assert eng._spin_credit == -_SPIN_BACKOFF + 1
        eng._spin_credit = 0
        tx.send_rows(_rows(1, eng.plen), rx.address)
        assert len(eng._spin()) == 1 and eng._spin_credit == 1
    finally:
        rx.close()
        tx.close()


def test_receive_drops_counts_what_a_full_buffer_lost():
    """receive_drops() reads the kernel's per-socket drop counter (/proc/net/udp): what the
    engine reports as stats["receive_drops"], so a worker sees its own socket's losses."""
    import time

    r = DatagramSocket(("127.0.0.1", 0), rcvbuf=4096, gro=False)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        r.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # room for a few datagrams
        assert r.receive_drops() == 0
        for _ in range(200):
            s.sendto(b"x" * 1000, r.address)
        time.sleep(0.05)
        got = len(list(r.recv_datagrams(max_calls=400)))
        assert got + r.receive_drops() == 200 and r.receive_drops() > 100
    finally:
        s.close()
        r.close()
