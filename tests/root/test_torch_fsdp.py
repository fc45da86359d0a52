"""FSDP2, DeviceMesh, DTensor, HSDP, PREMUL_SUM and torchrun restarts on the xdpagg backend.

In a 4-worker one-arm netns testbed with the XDP aggregator, each scenario of
tests/torch_fsdp_worker.py runs as a user would run it: a real torchrun per worker namespace
(xdp_agg.cluster.torchrun, c10d rendezvous over the testbed), `init_process_group("xdpagg")`.
- fsdp: init_device_mesh + fully_shard on 4 ranks, 5 steps, losses equal to DDP on gloo
  within 1e-4; functional all_reduce and DTensor Partial->Replicate through the aggregator;
  PREMUL_SUM all_reduce (number and tensor factors) and reduce_scatter_tensor.
- hsdp: a (replicate 2, shard 2) mesh; its sub-groups are xdpagg groups, each with its own
  aggregator job and name; the replicate all-reduces went through the aggregator (its
  per-worker contribution counters), reduce-scatter and all-gather through gloo; with a
  gradient divide factor FSDP2 reduce-scatters with PREMUL_SUM and still matches DDP.
- hsdp-wire16: HSDP 2 x 2 with MixedPrecisionPolicy(reduce_dtype=torch.bfloat16): the
  replicate groups' bfloat16 all-reduces went through the aggregator at 16 bits per element
  (comm.stats, path_stats), each replicate group's 16-bit companion job ended with it.
- restart: --max-restarts 1, rank 2 SIGKILLs itself at step 3 of the first round, its control
  connection silenced first (as if its host vanished); torchrun starts a second round, which
  trains to the end under a new job; the crashed round's job, held open by the silent
  connection, is removed by the endpoint's job lease, and the aggregator's job count is back.
One testbed for the module: its start-up is most of a scenario's cost.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not importable: pip install 'xdp-agg[torch]'")

from xdp_agg.cluster.cluster import Cluster  # noqa: E402
from xdp_agg.cluster.torchrun import start_torchrun, wait_all  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "torch_fsdp_worker.py")
N = 4
STEPS = 5
LOSS_TOL = 1e-4
LEASE = 20  # s: the control endpoint's job lease here (hostlib's control link pings every 10 s)

pytestmark = [
    pytest.mark.root,
    pytest.mark.bpf,
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.timeout(400),
]


@pytest.fixture(scope="module")
def bed():
    """(testbed, cluster): 4 workers, one-arm, the XDP aggregator and its control endpoint."""
    from netns_testbed.fixtures import skip_unless_root
    from netns_testbed.testbed import Testbed

    skip_unless_root()
    serve = ("--job-lease", str(LEASE))
    with Testbed(workers=N, topology="one-arm") as tb, Cluster(tb, serve_args=serve) as cl:
        yield tb, cl


def _jobs(cl) -> int:
    """The aggregator's live jobs (its data plane's table)."""
    return len(cl.stats()["jobs"])


def _wait_jobs(cl, want: int, limit: float = 20.0) -> int:
    end = time.monotonic() + limit
    while (n := _jobs(cl)) != want and time.monotonic() < end:
        time.sleep(0.5)
    return n


def _torchrun(bed, *args: str, max_restarts: int = 0, deadline: float = 300.0):
    """Run the worker under torchrun on every node; (per node's report, stdouts, jobs before)."""
    tb, cl = bed
    before = _jobs(cl)
    procs = start_torchrun(
        tb,
        cl,
        WORKER,
        list(args),
        run_id=f"t-{args[0]}-{uuid.uuid4().hex[:6]}",
        env={"XDP_AGG_WINDOW": "32", "PYTHONPATH": str(ROOT), "XDP_AGG_TIMEOUT": "20"},
        max_restarts=max_restarts,
    )
    results = wait_all(procs, deadline)
    bad = [f"node {i} exited {rc}: {se[-3000:]}" for i, (rc, _, se) in enumerate(results) if rc]
    assert not bad, "\n".join(bad)
    reports = []
    for i, (_, out, _) in enumerate(results):
        lines = [ln for ln in out.splitlines() if ln.startswith("REPORT ")]
        assert lines, f"node {i} printed no report: {out[-2000:]}"
        reports.append(json.loads(lines[-1][len("REPORT ") :]))
    return sorted(reports, key=lambda r: r["rank"]), [o for _, o, _ in results], before


@pytest.fixture(scope="module")
def fsdp_run(bed):
    return _torchrun(bed, "fsdp", "--steps", str(STEPS))


@pytest.fixture(scope="module")
def hsdp_run(bed):
    return _torchrun(bed, "hsdp", "--steps", str(STEPS))


def test_fsdp2_on_4_ranks_matches_ddp_on_gloo(bed, fsdp_run):
    reports, _, before = fsdp_run
    for rep in reports:
        f = rep["fsdp"]
        assert len(f["losses"]) == STEPS
        assert f["loss_err"] <= LOSS_TOL, (rep["rank"], f["losses"], f["ref_losses"])
        assert f["param_err"] <= LOSS_TOL, rep["rank"]
        c = rep["checks"]
        assert c["group_name"] == "0" and c["group_desc"] == "default_pg"
        assert c["job"].startswith("t-fsdp-")  # the torchrun run id names the job
    assert len({r["checks"]["job"] for r in reports}) == 1
    assert _wait_jobs(bed[1], before) == before


def test_functional_all_reduce_and_dtensor_go_through_the_aggregator(fsdp_run):
    reports, _, _ = fsdp_run
    for rep in reports:
        c = rep["checks"]
        for name in (
            "functional all_reduce",
            "functional all_reduce on the wire",
            "DTensor Partial->Replicate",
            "DTensor Partial->Replicate on the wire",
            "DTensor Shard local",
            "DTensor Shard->Replicate",
        ):
            assert c[name] is True, (rep["rank"], name)


def test_premul_sum_scales_then_sums(fsdp_run, hsdp_run):
    for rep in fsdp_run[0]:
        c = rep["checks"]
        for name in (
            "all_reduce PREMUL_SUM(0.25)",
            "all_reduce PREMUL_SUM on the wire",
            "all_reduce PREMUL_SUM(tensor 0.5)",
            "reduce_scatter_tensor PREMUL_SUM(0.5)",
            "reduce_scatter_tensor input unchanged",
        ):
            assert c[name] is True, (rep["rank"], name)
    for rep in hsdp_run[0]:  # FSDP2 with a divide factor of 4 on shard groups of 2
        p = rep["premul"]
        assert p["shard_premul_sums"] > 0 and rep["hsdp"]["shard_premul_sums"] == 0
        assert p["loss_err"] <= LOSS_TOL, (rep["rank"], p["losses"], p["ref_losses"])


def test_hsdp_2x2_replicate_all_reduce_through_the_aggregator(bed, hsdp_run):
    reports, _, before = hsdp_run
    by = {r["rank"]: r for r in reports}
    for rep in reports:
        assert rep["types"] == ["ProcessGroupXdpAgg"] * 2
        h = rep["hsdp"]
        assert h["loss_err"] <= LOSS_TOL, (rep["rank"], h["losses"], h["ref_losses"])
        assert rep["hsdp_allreduces"] > 0 and rep["shard_allreduces"] == 0
        # the aggregator counted at least a packet per all-reduce from both replicate ranks
        counts = rep["replicate_counters"]
        assert sorted(counts) == ["0", "1"], counts
        assert all(c >= rep["replicate_allreduces"] for c in counts.values()), counts
    # replicate groups {0, 2} and {1, 3}; shard groups {0, 1} and {2, 3}
    assert [by[r]["replicate_ranks"] for r in range(N)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    jobs = {(k, r["jobs"][k]) for r in reports for k in ("default", "replicate", "shard")}
    names = [j for _, j in jobs]
    assert len(names) == len(set(names)) == 5  # one default, two replicate, two shard jobs
    assert by[0]["jobs"]["replicate"] == by[2]["jobs"]["replicate"]
    assert by[0]["jobs"]["shard"] == by[1]["jobs"]["shard"]
    assert _wait_jobs(bed[1], before) == before  # every sub-group's job ended with it


def test_hsdp_wire16_bf16_reduce_dtype_in_testbed(bed):
    """FSDP2's bfloat16 reduce_dtype on HSDP: the replicate all-reduces at 16 bits."""
    from test_torch_wire16 import check_hsdp_wire16

    reports, _, before = _torchrun(bed, "hsdp-wire16", "--steps", "3")
    check_hsdp_wire16(reports, N)
    assert _wait_jobs(bed[1], before) == before  # the companion jobs too


def test_torchrun_restart_after_a_rank_is_killed(bed):
    """Rank 2 dies as if its host vanished: its control connection's FIN and RST never arrive
    (iptables in its namespace), so only the job lease can end the crashed round's job."""
    tb, cl = bed
    steps = 8
    try:
        reports, outs, before = _torchrun(
            bed,
            *("restart", "--steps", str(steps), "--kill-rank", "2", "--kill-step", "3"),
            "--vanish",
            max_restarts=1,
        )
        assert any("KILLED rank 2 at step 3" in o for o in outs)
        assert any("VANISHED control connection" in o for o in outs)
        # TORCHELASTIC_RESTART_COUNT counts a node's own failures: rank 2's node failed; another
        # node's worker may fail too before its agent sees the new round (gloo's connections to
        # the killed rank reset at once), so it restarted with 0 or 1; every node trained all
        # steps in its last round
        for rep in reports:
            assert rep["steps"] == steps, rep
            assert rep["attempt"] in ((1,) if rep["rank"] == 2 else (0, 1)), rep
        # each node printed its job's name in both rounds: one job per round, not the same
        rounds = [[ln.split()[2] for ln in o.splitlines() if ln.startswith("JOB ")] for o in outs]
        assert all(len(r) == 2 for r in rounds), rounds
        first, second = {r[0] for r in rounds}, {r[1] for r in rounds}
        assert len(first) == len(second) == 1 and first != second, rounds
        # the crashed round's job outlives its processes until its lease lapses
        assert _wait_jobs(cl, before, limit=LEASE + 30) == before
    finally:
        tb.run(tb.workers[2], ["iptables", "-F", "OUTPUT"], timeout=30)
    # the endpoint says why it went: the lease (a closed connection would need no log line)
    log = cl.stop_server()
    cl.start_server()
    (old,) = first
    assert any(old in ln and "the lease is" in ln for ln in log.splitlines()), log[-2000:]
