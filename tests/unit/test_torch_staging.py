"""Device tensors through the channel in chunks (hostlib.pt.staging), tested on the CPU with a fake
device (tests/harness/fake_device.py) that runs the copies on threads and checks their order.

- the staged results equal the CPU path's bit for bit, for every wire dtype, SUM and AVG, sizes
  that are and are not multiples of the chunk, one element, empty and non-contiguous tensors,
  several tensors in flight and a coalesced list (the backend's _aggregate), through a
  communicator that block-scales per packet as the aggregator does, and through hostlib and the
  soft aggregator on loopback;
- the copies overlap the aggregation: counted (every copy down but each tensor's first and every
  copy up but its last finish inside an aggregation), never timed; a staging that waits for each
  copy overlaps none;
- the fake's checks catch a slot reused before its copy up and a chunk read before its copy
  down (a broken ring is caught), and the ring's pinned memory is allocated once;
- a failure mid-tensor fails the future with every started copy finished, and with a fallback
  the rest of the tensor goes over gloo;
- on a machine with CUDA, the same equality with torch.cuda's streams (skipped here).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not importable: pip install 'xdp-agg[torch]' (make test does)"
)

from harness.fake_device import CheckingComm, FakeDevice, ScalingComm  # noqa: E402
from harness.pt_checks import ThreadGroup, same_bytes, staged_mismatches, varied_input  # noqa: E402

from hostlib.errors import HostlibError  # noqa: E402
from hostlib.pt.channel import AggregatorLost, AllreduceChannel  # noqa: E402
from hostlib.pt.staging import DeviceJob, StagingRing, chunk_elems  # noqa: E402

ELEMS = 256  # int32 per packet of the test communicators
CHUNK = 3 * ELEMS  # elements per chunk in these tests
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32)
SIZES = (1, 300, CHUNK, CHUNK + 1, 4 * CHUNK, 5 * CHUNK - 77)


def _chunk(dtype) -> int:
    """A staged chunk of `dtype` at its default width: CHUNK elements of float32 and int32 (at
    32 bits), 2 CHUNK of bfloat16 and float16 (at 16 bits: as many packets, of twice the
    elements, fill the same slot)."""
    return CHUNK * 4 // dtype.itemsize


def _ops(dtype):
    return (False,) if dtype == torch.int32 else (False, True)  # AVG of int32 is refused


def _channels(fake, **kw):
    """(staged, cpu): two channels over ScalingComms, the first staging every tensor through
    `fake` in chunks of CHUNK elements."""
    staged = AllreduceChannel(
        ScalingComm(elems=ELEMS, device=fake, **kw), stage_on=fake, chunk_bytes=CHUNK * 4
    )
    cpu = AllreduceChannel(ScalingComm(elems=ELEMS), stage_on=lambda t: None)
    return staged, cpu


def test_staged_results_equal_the_cpu_path_bit_for_bit(fake):
    staged, cpu = _channels(fake)
    for dtype in DTYPES:
        for n in SIZES:
            for avg in _ops(dtype):
                x = varied_input(dtype, n, seed=n)
                a, b = x.clone(), x.clone()
                assert staged.submit(a, average=avg).wait() is a
                cpu.submit(b, average=avg).wait()
                assert same_bytes(a, b), (dtype, n, avg)
    # one wire all-reduce per chunk, each chunk _chunk(dtype) elements but a tensor's last
    per_tensor = [-(-n // _chunk(d)) for d in DTYPES for n in SIZES for _ in _ops(d)]
    assert len(staged.comm.lengths) == sum(per_tensor) and max(staged.comm.lengths) == 2 * CHUNK
    assert staged.stats["staged"] == staged.stats["allreduces"] > 0
    assert staged.stats["bytes"] == cpu.stats["bytes"]
    staged.close()
    cpu.close()


def test_chunks_off_the_packets_would_change_the_floats(fake):
    """The comparison above can see a wrong cut: chunks of 700 elements (not whole packets of
    256) give other float32 sums than the CPU path."""
    staged, cpu = _channels(fake)
    staged._packet_elems = 100  # so that chunk_elems rounds 700 elements to 700
    staged.chunk_bytes = 700 * 4
    x = varied_input(torch.float32, 5 * CHUNK, seed=3)
    a, b = x.clone(), x.clone()
    staged.submit(a).wait()
    cpu.submit(b).wait()
    assert not same_bytes(a, b)
    staged.close()
    cpu.close()


def test_empty_non_contiguous_and_several_tensors_in_flight(fake):
    staged, cpu = _channels(fake)
    empty = torch.empty(0)
    assert staged.submit(empty).wait() is empty and fake.count("down") == 0
    # a non-contiguous tensor: staged through a contiguous copy, written back on the device
    base = varied_input(torch.float16, 4 * CHUNK, seed=5).reshape(4, CHUNK)
    a, b = base.clone().t(), base.clone().t()
    staged.submit(a, average=True).wait()
    cpu.submit(b, average=True).wait()
    assert not a.is_contiguous() and same_bytes(a, b)
    assert fake.count("within") == 1
    # several tensors submitted at once, of every dtype: queued, run in order through the ring
    xs = [varied_input(d, n, seed=i) for i, (d, n) in enumerate(zip(DTYPES * 2, SIZES + SIZES[:2]))]
    mine = [x.clone() for x in xs]
    futs = [staged.submit(t) for t in mine]
    for t, f in zip(mine, futs):
        assert f.wait() is t
    for t, x in zip(mine, xs):
        want = x.clone()
        cpu.submit(want).wait()
        assert same_bytes(t, want), (x.dtype, x.numel())
    assert fake.pinned_calls == 1  # one ring, reused by every call
    staged.close()
    assert not staged._rings  # its pinned memory let go
    cpu.close()


def test_a_coalesced_list_through_the_backend(fake):
    """all_reduce_coalesced's path (ProcessGroupXdpAgg._aggregate): one flat stream per wire
    dtype and width, staged in chunks, each tensor copied back from its slice."""
    from hostlib.pt.backend import ProcessGroupXdpAgg

    staged, cpu = _channels(fake)
    xs = [
        varied_input(d, n, seed=n) for d, n in zip(DTYPES * 2, (700, 1, 2000, 900, 33, 1500, 5, 8))
    ]
    got, want = [x.clone() for x in xs], [x.clone() for x in xs]
    ProcessGroupXdpAgg._aggregate(SimpleNamespace(channel=staged), got, False).wait()
    ProcessGroupXdpAgg._aggregate(SimpleNamespace(channel=cpu), want, False).wait()
    for g, w in zip(got, want):
        assert same_bytes(g, w), (g.dtype, g.numel())
    # float32 and int32 at 32 bits, float16 and bfloat16 each as itself at 16
    assert staged.stats["staged"] == 4 and staged.stats["wire16"] == 2
    staged.close()
    cpu.close()


def test_copies_overlap_the_aggregation_counted(fake):
    """Of a tensor of k chunks, copies down 2..k finish inside the aggregation of the chunk
    before, copies up 1..k-1 inside the aggregation of the chunk after: k - 1 each."""
    staged, _ = _channels(fake)
    for k in (1, 2, 5):
        before = {kind: fake.overlapped(kind) for kind in ("down", "up")}
        staged.submit(varied_input(torch.float32, k * CHUNK, seed=k)).wait()
        assert fake.overlapped("down") - before["down"] == k - 1
        assert fake.overlapped("up") - before["up"] == k - 1
    assert fake.count("down") == fake.count("up") == 8
    assert fake.aggregations == 8
    staged.close()


class _Serial:
    """A device that waits for each copy as soon as it starts it: what staging without overlap
    does."""

    def __init__(self, fake) -> None:
        self.fake = fake

    def __call__(self, tensor):
        return self

    def __getattr__(self, name):
        return getattr(self.fake, name)

    def copy_down(self, src, dst, after):
        ev = self.fake.copy_down(src, dst, after)
        self.fake.wait(ev)
        return ev

    def copy_up(self, src, dst, after):
        ev = self.fake.copy_up(src, dst, after)
        self.fake.wait(ev)
        return ev


def test_a_staging_without_overlap_counts_none(fake):
    staged = AllreduceChannel(
        ScalingComm(elems=ELEMS, device=fake), stage_on=_Serial(fake), chunk_bytes=CHUNK * 4
    )
    staged.submit(varied_input(torch.float32, 5 * CHUNK, seed=1)).wait()
    assert fake.count("down") == 5 and fake.overlapped("down") == fake.overlapped("up") == 0
    staged.close()


def _ring_run(ring: StagingRing, fake, x: torch.Tensor) -> None:
    comm = ScalingComm(elems=ELEMS, device=fake)
    ring.run(DeviceJob(x, fake), 1, lambda src, out: comm.allreduce(src, out=out), False)


def test_the_fake_catches_a_slot_reused_before_its_copy_up():
    """A ring that starts a copy down into a slot without waiting for the slot's last copy up
    (with 2 slots that copy up is still pending): the fake reports it."""

    class Careless(StagingRing):
        def _copy_down(self, job, bounds, slot):
            a, b = bounds
            return self.device.copy_down(
                job.flat[a:b], self._image(slot, job.flat.dtype, b - a), [job.ready]
            )

    fake = FakeDevice()
    with contextlib.suppress(ValueError):  # it may sum the 0xFF fill (NaN) it raced with
        _ring_run(
            Careless(fake, CHUNK, slots=2), fake, varied_input(torch.float32, 4 * CHUNK, seed=2)
        )
    fake.close()
    assert any("without waiting" in v for v in fake.violations), fake.violations
    good = FakeDevice()  # the real ring with 2 slots keeps the rule
    _ring_run(
        StagingRing(good, CHUNK, slots=2), good, varied_input(torch.float32, 4 * CHUNK, seed=2)
    )
    good.close()
    assert not good.violations, good.violations


def test_the_fake_catches_a_chunk_read_before_its_copy_down():
    class Hasty(FakeDevice):  # the host does not wait for copies down
        def wait(self, event):
            if event.op.kind != "down":
                super().wait(event)

    fake = Hasty()
    _ring_run(StagingRing(fake, CHUNK), fake, varied_input(torch.float32, 3 * CHUNK, seed=4))
    fake.close()
    assert any("before the host waited" in v for v in fake.violations), fake.violations


def test_a_failure_mid_tensor_fails_the_future_after_every_copy(fake):
    staged, _ = _channels(fake, fail_at=2, error=HostlibError("the aggregator is gone"))
    with pytest.raises(AggregatorLost, match="all-reduce #2"):
        staged.submit(varied_input(torch.float32, 5 * CHUNK, seed=6)).wait()
    assert fake.idle()  # the copy down of chunk 3 and the copies up of 0 and 1 have finished
    x = varied_input(torch.int32, 2 * CHUNK, seed=7)
    t = x.clone()
    staged.submit(t).wait()  # the ring is usable again
    assert torch.equal(t, x * 3)
    staged.close()


def test_a_failure_mid_tensor_with_a_fallback_finishes_over_gloo():
    """Both ranks lose the aggregator at chunk 2 of 5: they agree, redo chunk 2 over the
    fallback group and send chunks 3 and 4 there; the sum is exact."""
    n = 2
    comms, groups = ThreadGroup(n), ThreadGroup(n)
    out: dict = {}

    def rank_main(r: int) -> None:
        fake = FakeDevice()

        class Comm:
            rank, world_size, stats = r, n, {"elems": ELEMS}
            calls = 0

            def allreduce(self, src, out, wire_bits=None):
                Comm.calls += 1
                if Comm.calls == 3:
                    raise HostlibError("lost")
                out[...] = comms.exchange(r, torch.from_numpy(src.copy())).sum(0).numpy()

        ch = AllreduceChannel(
            Comm(), fallback=groups.member(r), stage_on=fake, chunk_bytes=CHUNK * 4
        )
        t = torch.arange(5 * CHUNK, dtype=torch.int32) * (r + 1)
        ch.submit(t).wait()
        out[r] = (t, ch.on_fallback, ch.stats["gloo_allreduces"], fake.violations)
        ch.close()
        fake.close()

    comms.run(rank_main)
    want = torch.arange(5 * CHUNK, dtype=torch.int32) * 3
    for r in range(n):
        t, on_fallback, gloo, violations = out[r]
        assert torch.equal(t, want) and on_fallback and gloo == 3 and not violations


def test_staged_equals_the_cpu_path_through_hostlib_on_loopback():
    """The same comparison through hostlib's communicator and the soft aggregator (2 ranks,
    256 int32 per packet): every chunk a real all-reduce of its own."""
    from harness.ranks import ok, run_ranks, soft_cluster

    def body(comm):
        fake = FakeDevice()
        staged = AllreduceChannel(CheckingComm(comm, fake), stage_on=fake, chunk_bytes=CHUNK * 4)
        cpu = AllreduceChannel(comm, stage_on=lambda t: None)
        wrong = staged_mismatches(staged, cpu, DTYPES, (300, CHUNK + 1, 4 * CHUNK - 5), comm.rank)
        staged.close()
        cpu.close()
        fake.close()
        return wrong, fake.violations, fake.overlapped("down"), staged._packet_elems

    with soft_cluster() as cl:
        for wrong, violations, overlapped, elems in ok(run_ranks(cl, 2, body)):
            assert not wrong and not violations and overlapped > 0 and elems == ELEMS


def test_the_bench_sweep_cuts_as_the_staging_does(monkeypatch):
    """bench/cuda_staging.py's host sweep all-reduces the tensor whole, then in the chunks the
    staging would make (whole packets), each size once per repetition."""
    import bench.cuda_staging as bench

    monkeypatch.setattr(bench.dist, "barrier", lambda: None)
    comm = ScalingComm(elems=768)
    rows = bench.chunk_sweep(comm, 1, [0.25, 1.0], reps=2)
    assert [r["chunks"] for r in rows] == [1, 5, 2]  # 1 MiB is not whole packets of 768
    n, quarter, whole = (1 << 20) // 4, chunk_elems(1 << 18, 768), chunk_elems(1 << 20, 768)
    assert (quarter, whole) == (85 * 768, 341 * 768)
    assert rows[1]["chunk_mib"] == quarter * 4 / (1 << 20)
    assert set(comm.lengths) == {n, quarter, n - 4 * quarter, whole, n - whole}
    assert all(len(r["all_s"]) == 2 for r in rows) and rows[0]["vs_whole"] == 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
def test_cuda_tensors_equal_the_cpu_path_bit_for_bit():
    """torch.cuda's streams and events (staging.CudaDevice, the channel's default) against the
    CPU path, every wire dtype, SUM and AVG, non-contiguous too."""
    staged = AllreduceChannel(ScalingComm(elems=ELEMS), chunk_bytes=CHUNK * 4)
    cpu = AllreduceChannel(ScalingComm(elems=ELEMS), stage_on=lambda t: None)
    for dtype in DTYPES:
        for n in SIZES + (0,):
            for avg in _ops(dtype):
                x = varied_input(dtype, n, seed=n) if n else torch.empty(0, dtype=dtype)
                a, b = x.cuda(), x.clone()
                staged.submit(a, average=avg).wait()
                cpu.submit(b, average=avg).wait()
                assert same_bytes(a.cpu(), b), (dtype, n, avg)
    base = varied_input(torch.bfloat16, 4 * CHUNK, seed=9).reshape(4, CHUNK)
    a, b = base.cuda().t(), base.clone().t()
    staged.submit(a).wait()
    cpu.submit(b).wait()
    assert same_bytes(a.cpu(), b)
    assert len(staged._rings) == 1
    staged.close()
    cpu.close()
