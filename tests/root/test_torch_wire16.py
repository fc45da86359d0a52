"""16-bit elements on the wire from PyTorch (docs/pytorch.md, "Element width"; docs/protocol.md
5.6): which width each tensor of hostlib.pt travels at, and what it gets.

Without root, in one process (harness/fake_device.ScalingComm sums as the aggregator would,
16-bit packets carrying twice the elements):
- XDP_AGG_WIRE_BITS / HostOptions.wire_bits, and the channel's policy: by default bfloat16 and
  float16 at 16 bits, float32 and int32 at 32; 32 forces every tensor to 32 bits, 16 every
  float; an explicit width wins; int32 at 16 bits is refused;
- CPU and staged (fake device) tensors at either width give the same bytes, the staged ones in
  chunks of whole 16-bit packets; bfloat16 without ml_dtypes (a float32 host copy) too;
- the backend's coalesced streams per (wire dtype, width, device), path_stats' width column;
- wire16_hook: a float32 bucket averaged at 16 bits, within hostlib.scaling.error_bound(E, n,
  16) of the float64 average, with no bfloat16 copy;
- the fallback (gloo) sums a 16-bit tensor in float32 and broadcasts its bytes.
Loopback (the soft aggregator, processes of tests/torch_worker.py; hostlib's 16-bit path): DDP
with wire16_hook against a float64 reference (also in the netns testbed through the XDP
aggregator, root), bf16/f16/f32 tensors through the backend at the widths XDP_AGG_WIRE_BITS
gives, and HSDP with a bfloat16 reduce_dtype (4 ranks, tests/torch_fsdp_worker.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not importable: pip install 'xdp-agg[torch]' (make test does)"
)

from harness.fake_device import FakeDevice, ScalingComm  # noqa: E402
from harness.pt_checks import ThreadGroup, same_bytes, staged_mismatches, varied_input  # noqa: E402
from harness.torch_procs import in_testbed, one_arm_cluster  # noqa: E402

from hostlib import scaling  # noqa: E402
from hostlib.options import HostOptions  # noqa: E402
from hostlib.pt import staging  # noqa: E402
from hostlib.pt.channel import AllreduceChannel, _Fallback, wire_bits_for  # noqa: E402

ELEMS = 256  # int32 per packet of the test communicators: 512 elements at 16 bits
CHUNK = 3 * ELEMS  # a slot: 3 KiB of 4-byte elements
F32, F16, BF16, I32 = torch.float32, torch.float16, torch.bfloat16, torch.int32


# --- the width each tensor travels at -----------------------------------------------------------
def test_wire16_options_from_the_environment():
    assert HostOptions().wire_bits == "auto"
    for text, want in (("auto", "auto"), (" AUTO ", "auto"), ("16", 16), ("32", 32)):
        assert HostOptions.from_env({"XDP_AGG_WIRE_BITS": text}).wire_bits == want
    for bad in ("8", "bf16", "64"):
        with pytest.raises(ValueError, match="XDP_AGG_WIRE_BITS must be auto, 16 or 32"):
            HostOptions.from_env({"XDP_AGG_WIRE_BITS": bad})
    with pytest.raises(ValueError, match="wire_bits must be"):
        HostOptions(wire_bits=24)
    with pytest.raises(ValueError, match="wire_bits must be"):
        HostOptions(wire_bits=True)  # a bool is no width
    from hostlib.options import env_var

    assert env_var("wire_bits") == "XDP_AGG_WIRE_BITS"


def test_wire16_policy_by_dtype():
    want = {
        "auto": {F32: 32, F16: 16, BF16: 16, I32: 32},
        32: {F32: 32, F16: 32, BF16: 32, I32: 32},
        16: {F32: 16, F16: 16, BF16: 16, I32: 32},  # int32 is exact at 32 bits only
    }
    for policy, widths in want.items():
        for dtype, bits in widths.items():
            assert wire_bits_for(dtype, policy) == bits, (policy, dtype)
    with pytest.raises(ValueError):
        wire_bits_for(F32, 8)
    with pytest.raises(ValueError):
        AllreduceChannel(ScalingComm(), wire_bits="16")  # a string that is no policy


@pytest.mark.parametrize("policy", ["auto", 32, 16])
def test_wire16_channel_sends_each_dtype_at_its_width(policy):
    """The width reaches hostlib (the communicator's wire_bits), explicit ones win, int32 at 16
    bits is refused at submit, and stats count the 16-bit all-reduces."""
    comm = ScalingComm(elems=ELEMS)
    ch = AllreduceChannel(comm, stage_on=lambda t: None, wire_bits=policy)
    dtypes = (F32, F16, BF16, I32)
    for d in dtypes:
        ch.submit(varied_input(d, 1000, seed=1)).wait()
    want = [wire_bits_for(d, policy) for d in dtypes]
    assert comm.bits == want
    ch.submit(varied_input(F32, 1000, seed=2), wire_bits=16).wait()
    ch.submit(varied_input(BF16, 1000, seed=2), wire_bits=32).wait()
    assert comm.bits[-2:] == [16, 32]
    with pytest.raises(ValueError, match="int32"):
        ch.submit(varied_input(I32, 10, seed=3), wire_bits=16)
    with pytest.raises(ValueError, match="16 or 32"):
        ch.submit(varied_input(F32, 10, seed=3), wire_bits=8)
    assert ch.stats["wire16"] == want.count(16) + 1
    ch.close()


def test_wire16_float32_at_16_bits_is_within_the_bound():
    """A float32 tensor sent at 16 bits: within error_bound(E, n, 16) + float32's rounding of
    the exact sum, per packet of 2 x ELEMS elements, and further from it than at 32 bits."""
    comm = ScalingComm(world=3, elems=ELEMS)
    ch = AllreduceChannel(comm, stage_on=lambda t: None)
    x = varied_input(F32, 5 * 2 * ELEMS - 77, seed=4)
    exact = x.double() * 3
    at16, at32 = x.clone(), x.clone()
    ch.submit(at16, wire_bits=16).wait()
    ch.submit(at32).wait()
    assert comm.bits == [16, 32]
    err16 = (at16.double() - exact).abs()
    err32 = (at32.double() - exact).abs()
    bound = _bound(x.numpy(), 3, 2 * ELEMS, 16) + 2.0**-24 * at16.double().abs().numpy()
    assert (err16.numpy() <= bound).all()
    assert err16.max() > 100 * err32.max()  # 16 bits are coarser, as they should be
    ch.close()


def _bound(x: np.ndarray, n: int, per_packet: int, bits: int) -> np.ndarray:
    """hostlib.scaling.error_bound per element of `x` (every rank's input the same: its chunks'
    exponents are the world's), chunks of `per_packet` elements."""
    k = per_packet
    padded = np.zeros(-(-x.size // k) * k, np.float32)
    padded[: x.size] = x
    e = scaling.chunk_exponents(padded.reshape(-1, k))
    return np.repeat(scaling.error_bound(e, n, bits), k)[: x.size]


# --- staged (device) tensors at both widths -----------------------------------------------------
@pytest.mark.parametrize("policy", ["auto", 32, 16])
def test_wire16_staged_equals_the_cpu_path_at_either_width(fake, policy):
    """Staged tensors give the CPU path's bytes at the width the policy gives them, in chunks
    of whole packets of that width that fill a slot."""
    staged = AllreduceChannel(
        ScalingComm(elems=ELEMS, device=fake), stage_on=fake, chunk_bytes=CHUNK * 4,
        wire_bits=policy,
    )  # fmt: skip
    cpu = AllreduceChannel(ScalingComm(elems=ELEMS), stage_on=lambda t: None, wire_bits=policy)
    sizes = (1, 700, 2 * CHUNK, 5 * CHUNK + 3)
    assert not staged_mismatches(staged, cpu, (F32, F16, BF16), sizes), policy
    comm = staged.comm
    assert set(comm.bits) == set(cpu.comm.bits) == {wire_bits_for(d, policy) for d in (F32, BF16)}
    # chunks: the most whole packets of their width whose elements fill the slot
    for dtype in (F32, F16, BF16):
        bits = wire_bits_for(dtype, policy)
        step = staging.tensor_chunk(CHUNK, ELEMS, dtype.itemsize, bits)
        assert step % (ELEMS * 32 // bits) == 0 and step * dtype.itemsize <= CHUNK * 4
        before = len(comm.lengths)
        staged.submit(varied_input(dtype, 3 * step + 1, seed=9)).wait()
        assert comm.lengths[before:] == [step, step, step, 1], (policy, dtype)
        assert comm.bits[before:] == [bits] * 4
    staged.close()
    cpu.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
@pytest.mark.parametrize("policy", ["auto", 16])
def test_wire16_cuda_tensors_equal_the_cpu_path(policy):
    """torch.cuda's streams (staging.CudaDevice) at 16 bits: bfloat16 through ml_dtypes' view of
    the pinned slot, float32 in chunks of whole 16-bit packets; the CPU path's bytes."""
    staged = AllreduceChannel(ScalingComm(elems=ELEMS), chunk_bytes=CHUNK * 4, wire_bits=policy)
    cpu = AllreduceChannel(ScalingComm(elems=ELEMS), stage_on=lambda t: None, wire_bits=policy)
    for dtype in (F32, F16, BF16):
        for n in (1, 700, 5 * CHUNK + 3):
            for avg in (False, True):
                x = varied_input(dtype, n, seed=n)
                a, b = x.cuda(), x.clone()
                staged.submit(a, average=avg).wait()
                cpu.submit(b, average=avg).wait()
                assert same_bytes(a.cpu(), b), (policy, dtype, n, avg)
    assert 16 in staged.comm.bits
    staged.close()
    cpu.close()


def test_wire16_staged_chunks_are_whole_16_bit_packets():
    """tensor_chunk: the most whole packets of the width whose elements fill the slot."""
    slot = staging.chunk_elems(CHUNK * 4, ELEMS)
    assert slot == CHUNK
    assert staging.tensor_chunk(slot, ELEMS, 4, 32) == CHUNK  # float32 at 32: the slot
    assert staging.tensor_chunk(slot, ELEMS, 2, 16) == 2 * CHUNK  # 3 packets of 512
    assert staging.tensor_chunk(slot, ELEMS, 4, 16) == 2 * ELEMS  # 1 packet of 512 fits
    assert staging.tensor_chunk(slot, ELEMS, 2, 32) == 2 * CHUNK  # 6 packets of 256
    # a slot never smaller than a 16-bit packet of float32 (2 x ELEMS 4-byte elements)
    assert staging.chunk_elems(100, ELEMS) == 2 * ELEMS
    assert staging.tensor_chunk(2 * ELEMS, ELEMS, 4, 16) == 2 * ELEMS
    # the default: 16 MiB slots hold 4 Mi float32 or 8 Mi bfloat16 elements, whole packets
    slot = staging.chunk_elems(staging.CHUNK_BYTES, 768)
    assert staging.tensor_chunk(slot, 768, 2, 16) == 2 * slot
    assert staging.tensor_chunk(slot, 768, 4, 16) % 1536 == 0


def test_wire16_staged_bfloat16_without_ml_dtypes(fake, monkeypatch):
    """Without ml_dtypes bfloat16 goes through a float32 host copy on both paths (the ring's
    host arrays grow to hold a chunk of twice the elements), and the two still agree."""
    monkeypatch.setattr(staging, "np_bfloat16", lambda: None)
    staged = AllreduceChannel(
        ScalingComm(elems=ELEMS, device=fake), stage_on=fake, chunk_bytes=CHUNK * 4
    )
    cpu = AllreduceChannel(ScalingComm(elems=ELEMS), stage_on=lambda t: None)
    x = varied_input(BF16, 4 * CHUNK + 5, seed=8)
    a, b = x.clone(), x.clone()
    staged.submit(a, average=True).wait()
    cpu.submit(b, average=True).wait()
    assert same_bytes(a, b)
    assert set(staged.comm.bits) == set(cpu.comm.bits) == {16}
    assert max(staged.comm.lengths) == 2 * CHUNK
    staged.close()
    cpu.close()


# --- the backend's coalesced streams ------------------------------------------------------------
@pytest.mark.parametrize(
    "policy,streams",
    [
        ("auto", [(F32, 32), (I32, 32), (F16, 16), (BF16, 16)]),
        (32, [(F32, 32), (I32, 32)]),  # every float in one float32 stream
        (16, [(F32, 16), (I32, 32), (F16, 16), (BF16, 16)]),
    ],
)
def test_wire16_coalesced_streams_per_dtype_and_width(policy, streams):
    from hostlib.pt.backend import ProcessGroupXdpAgg, _wire_groups

    comm = ScalingComm(elems=ELEMS)
    ch = AllreduceChannel(comm, stage_on=lambda t: None, wire_bits=policy)
    dtypes = (F32, I32, F16, BF16, F32, BF16)
    xs = [varied_input(d, 300 + i, seed=i) for i, d in enumerate(dtypes)]
    keys = list(_wire_groups(xs, ch))
    assert [(d, b) for d, b, _ in keys] == streams
    got, want = [x.clone() for x in xs], xs
    ProcessGroupXdpAgg._aggregate(SimpleNamespace(channel=ch), got, False).wait()
    assert comm.bits == [b for _, b in streams]
    # each within the bound of its width, the packet's largest magnitude at most the list's
    gmax = max(float(x.double().abs().max()) for x in xs)
    eps = {F32: 2.0**-24, F16: 2.0**-11, BF16: 2.0**-8, I32: 0.0}
    for g, w in zip(got, want):
        exact = w.double() * 3
        if w.dtype == I32:
            assert torch.equal(g.double(), exact)
            continue
        bits = wire_bits_for(w.dtype, policy)
        bound = 3 * gmax / scaling.int_range(3, bits) + 2 * eps[w.dtype] * exact.abs()
        assert ((g.double() - exact).abs() <= bound).all(), (policy, w.dtype)
    ch.close()


def test_wire16_path_stats_say_the_width():
    from hostlib.pt.paths import AGGREGATOR, GLOO, FallbackWarning, PathStats

    ps = PathStats("xdpagg (job t)")
    ps.record("all_reduce", None, [torch.zeros(2, dtype=BF16)], AGGREGATOR, wire_bits={16})
    ps.record("all_reduce", None, [torch.zeros(2)], AGGREGATOR, wire_bits=[32])
    ps.record("all_reduce_coalesced", None, [torch.zeros(2)], AGGREGATOR, wire_bits=[32, 16])
    with pytest.warns(FallbackWarning, match="float64"):
        ps.record("all_reduce", None, [torch.zeros(2, dtype=torch.float64)], GLOO, "float64")
    widths = {(r["collective"], r["dtype"], r["path"]): r["wire_bits"] for r in ps.rows()}
    assert widths == {
        ("all_reduce", "bfloat16", AGGREGATOR): "16",
        ("all_reduce", "float32", AGGREGATOR): "32",
        ("all_reduce_coalesced", "float32", AGGREGATOR): "16+32",
        ("all_reduce", "float64", GLOO): "-",
    }


# --- the DDP hook -------------------------------------------------------------------------------
def test_wire16_hook_averages_float32_buckets_at_16_bits():
    """wire16_hook: the float32 bucket goes to hostlib as itself (no bfloat16 copy) at 16
    bits; its average is within error_bound(E, n, 16) / n of the exact one, plus float32's
    rounding of the sum and of the division; allreduce_hook keeps float32 at 32 bits."""
    import hostlib.pt

    n = 3
    comm = ScalingComm(world=n, elems=ELEMS)
    seen = []
    allreduce = comm.allreduce

    def spy(src, out=None, *, wire_bits=None):
        seen.append((src.dtype, src.ctypes.data))
        return allreduce(src, out, wire_bits=wire_bits)

    comm.allreduce = spy
    state = SimpleNamespace(channel=AllreduceChannel(comm, stage_on=lambda t: None))
    grad = varied_input(F32, 3 * 2 * ELEMS + 100, seed=11)
    buf = grad.clone()
    got = hostlib.pt.wire16_hook(state, SimpleNamespace(buffer=lambda: buf)).wait()
    assert got is buf and buf.dtype == F32
    assert comm.bits == [16] and seen == [(np.float32, buf.data_ptr())]
    exact = grad.double()  # (n copies of grad) / n
    bound = _bound(grad.numpy(), n, 2 * ELEMS, 16) / n + 2 * 2.0**-24 * exact.abs().numpy()
    assert ((buf.double() - exact).abs().numpy() <= bound).all()
    assert (buf.double() - exact).abs().max() > 0  # it did travel at 16 bits
    b32 = grad.clone()
    hostlib.pt.allreduce_hook(state, SimpleNamespace(buffer=lambda: b32)).wait()
    assert comm.bits == [16, 32]
    state.channel.close()


def test_wire16_hook_state_takes_the_width_from_the_environment(monkeypatch):
    import hostlib.pt

    monkeypatch.setenv("XDP_AGG_WIRE_BITS", "32")
    comm = SimpleNamespace(rank=0, world_size=2, timeout=5.0)
    state = hostlib.pt.HookState(comm)
    assert state.channel.wire_bits == 32
    assert hostlib.pt.HookState(comm, wire_bits=16).channel.wire_bits == 16
    monkeypatch.delenv("XDP_AGG_WIRE_BITS")
    assert hostlib.pt.HookState(comm).channel.wire_bits == "auto"
    assert "wire16_hook" in hostlib.pt.__all__


# --- the fallback -------------------------------------------------------------------------------
def test_wire16_fallback_sums_16_bit_tensors_in_float32_and_broadcasts_bytes():
    """Rank 0 holds all-reduce #5's bfloat16 result and failed at #6, rank 1 failed at #5: rank
    1 gets #5's bytes, then both redo #6 over gloo, summed in float32 (not in bfloat16)."""
    n = 2
    group = ThreadGroup(n)
    x5 = [staging.host_array(torch.full((4,), 1.0 + r, dtype=BF16)) for r in range(n)]
    result5 = staging.host_array(torch.tensor([3.0, 3.0, 3.0, 3.01], dtype=BF16))
    # 256 + 1: 257 in float32; bfloat16 (8 significant bits) would round it to 256
    x6 = [staging.host_array(torch.tensor(v, dtype=BF16)) for v in ([256.0, 1.0], [1.0, 256.0])]
    out: dict = {}

    def rank_main(r: int) -> None:
        fb = _Fallback(group.member(r), r, n)
        if r == 0:
            fb.completed(5, result5.copy())
            out[r] = (result5, fb.recover(6, x6[0], RuntimeError("lost"), "test"))
        else:
            got5 = fb.recover(5, x5[1], RuntimeError("lost"), "test")
            out[r] = (got5, fb.gloo_sum(x6[1]))

    group.run(rank_main)
    for r in range(n):
        got5, got6 = out[r]
        assert got5.dtype == result5.dtype and got5.tobytes() == result5.tobytes()
        assert got6.dtype == np.float32 and got6.tolist() == [257.0, 257.0]


# --- loopback: hostlib's 16-bit path and the soft aggregator ------------------------------------
def test_ddp_wire16_hook_on_loopback():
    """DDP with wire16_hook (2 ranks, float32 model, 3 steps): every bucket travelled at 16
    bits, and each averaged bucket is within the bound of the float64 average of every rank's
    bucket (ratio <= 1); the parameters stay close to DDP on gloo's."""
    from harness.ranks import soft_cluster
    from harness.torch_procs import collect_reports as _reports
    from harness.torch_procs import start_loopback as _start_loopback

    with soft_cluster() as cl:
        reports = _reports(_start_loopback(cl, 2, "ddp-wire16", "--steps", "3"))
    check_ddp_wire16(reports, 3)


def check_ddp_wire16(reports: list[dict], steps: int) -> None:
    for rep in reports:
        assert rep["wire16"] == rep["allreduces"] == len(rep["ratio"]) >= steps, rep
        assert rep["widths"] == [16] * steps, rep
        assert max(rep["ratio"]) <= 1.0, rep["ratio"]
        assert rep["exact_zero"] < len(rep["ratio"]), rep  # the 16 bits did round
        assert rep["param_diff"] < 1e-3, rep


@pytest.mark.parametrize("n", [2, 4])
@in_testbed
def test_ddp_wire16_hook_in_testbed(testbed_factory, n):
    """The same through the XDP aggregator, n worker namespaces (one-arm)."""
    from harness.torch_procs import collect_reports as _reports
    from harness.torch_procs import start_testbed as _start_testbed

    with one_arm_cluster(testbed_factory, n) as (tb, cl):
        procs = _start_testbed(tb, cl, "ddp-wire16", "--job", f"w16-{n}", "--steps", "3")
        check_ddp_wire16(_reports(procs), 3)


@pytest.mark.parametrize("policy,coalesced16", [("auto", 2), ("32", 0), ("16", 3)])
def test_backend_wire16_on_loopback(policy, coalesced16):
    """bfloat16, float16 and float32 through the backend (2 ranks) at the widths
    XDP_AGG_WIRE_BITS gives: the communicator's width, path_stats', the packets (a 16-bit
    all-reduce takes half) and the bound of the width."""
    from harness.ranks import soft_cluster
    from harness.torch_procs import collect_reports as _reports
    from harness.torch_procs import start_loopback as _start_loopback

    with soft_cluster() as cl:
        procs = _start_loopback(cl, 2, "backend-wire16", XDP_AGG_WIRE_BITS=policy)
        reports = _reports(procs)
    pol: int | str = policy if policy == "auto" else int(policy)
    for rep in reports:
        assert not rep["failures"], rep["failures"]
        assert len(rep["checks"]) == 13, rep["checks"]
        assert rep["coalesced_wire16"] == coalesced16
        # the same tensor at 16 bits: half the packets of 32 (the same count at the same width)
        sent = rep["packets"]
        if wire_bits_for(BF16, pol) == wire_bits_for(F32, pol):
            assert sent["bfloat16"] == sent["float32"], sent
        else:
            assert sent["bfloat16"] <= 0.55 * sent["float32"], sent
        rows = {(r["collective"], r["op"], r["dtype"]): r for r in rep["path_stats"]}
        for dtype in (F32, F16, BF16):
            row = rows[("all_reduce", "SUM", str(dtype)[6:])]
            assert row["path"] == "aggregator"
            assert row["wire_bits"] == str(wire_bits_for(dtype, pol)), row


def test_wire16_staged_equals_the_cpu_path_through_hostlib_on_loopback():
    """Staged (fake device) and CPU tensors through hostlib and the soft aggregator (2 ranks,
    256 int32 per packet) with every float at 16 bits (policy 16): the same bytes, chunk by
    chunk a 16-bit all-reduce of its own on the companion job."""
    from harness.fake_device import CheckingComm
    from harness.ranks import ok, run_ranks, soft_cluster

    def body(comm):
        fake = FakeDevice()
        staged = AllreduceChannel(
            CheckingComm(comm, fake), stage_on=fake, chunk_bytes=CHUNK * 4, wire_bits=16
        )
        cpu = AllreduceChannel(comm, stage_on=lambda t: None, wire_bits=16)
        sizes = (300, 2 * CHUNK + 1, 5 * CHUNK - 5)
        wrong = staged_mismatches(staged, cpu, (F32, BF16, F16), sizes, comm.rank)
        width = comm.stats["wire_bits"]
        staged.close()
        cpu.close()
        fake.close()
        return wrong, fake.violations, width, staged.stats["wire16"]

    with soft_cluster() as cl:
        for wrong, violations, width, wire16 in ok(run_ranks(cl, 2, body)):
            assert not wrong and not violations and width == 16 and wire16 == 18


# --- FSDP2/HSDP with a bfloat16 reduce_dtype --------------------------------------------------
HSDP_LOSS_TOL = 2e-3  # bfloat16 gradients (8 significant bits) against float32 DDP, 3 steps


def check_hsdp_wire16(reports: list[dict], n: int) -> None:
    """HSDP with reduce_dtype=bfloat16: the replicate groups' all-reduces were bfloat16, went
    through the aggregator at 16 bits, none through gloo; training stays close to float32 DDP."""
    for rep in reports:
        h = rep["hsdp"]
        assert h["loss_err"] <= HSDP_LOSS_TOL, (rep["rank"], h["losses"], h["ref_losses"])
        assert rep["replicate_allreduces"] > 0
        assert rep["replicate_wire16"] == rep["replicate_allreduces"], rep
        assert rep["replicate_wire_bits"] == 16
        rows = [r for r in rep["path_stats"] if r["collective"] == "all_reduce"]
        assert rows and all(r["path"] == "aggregator" for r in rows), rows
        bf16 = [r for r in rows if r["dtype"] == "bfloat16"]
        assert bf16 and all(r["wire_bits"] == "16" for r in bf16), rows
        # the shard groups' reduce-scatters are bfloat16 too, on gloo (one-way data)
        rs = [r for r in rep["shard_path_stats"] if r["collective"] == "reduce_scatter_tensor"]
        assert any(r["dtype"] == "bfloat16" and r["path"] == "gloo" for r in rs), rs


def test_hsdp_wire16_bf16_reduce_dtype_on_loopback():
    """tests/torch_fsdp_worker.py hsdp-wire16 on 4 ranks (env:// rendezvous, the soft
    aggregator): HSDP 2 x 2 with MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)."""
    import json
    import os
    from pathlib import Path

    from harness.ranks import soft_cluster
    from harness.torch_procs import start_loopback

    worker = str(Path(__file__).resolve().parents[1] / "torch_fsdp_worker.py")
    n = 4
    with soft_cluster() as cl:
        procs = start_loopback(
            cl,
            n,
            "hsdp-wire16",
            "--steps",
            "3",
            worker=worker,
            XDP_AGG_WINDOW=32,
            XDP_AGG_TIMEOUT=20,
            TORCHELASTIC_RUN_ID=f"w16-{os.getpid()}",
        )
        outs = []
        try:
            for p in procs:
                out, err = p.communicate(timeout=240)
                assert p.returncode == 0, err[-3000:]
                outs.append(out)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    reports = []
    for out in outs:
        lines = [ln for ln in out.splitlines() if ln.startswith("REPORT ")]
        assert lines, out[-2000:]
        reports.append(json.loads(lines[-1][len("REPORT ") :]))
    check_hsdp_wire16(reports, n)
