"""Hostile traffic during live all-reduces through the XDP aggregator (the live half;
test_xdp_fuzz.py is the PROG_TEST_RUN one).

A job of 3 workers (bench.soak_worker: mixed sizes, int32 and float32, every result checked)
all-reduces in a 4-worker testbed until the test is done; meanwhile (a) the fourth namespace, which
is no worker of the job, sends well-formed contributions for the job's slots to its port and to the
other aggregator ports, and junk to both, and (b) worker 0's address sends malformed frames of many
kinds (tests/harness/junk.py: bad size codes, other message types, truncated headers and values,
lying lengths, slots outside the job's range and the reserved bit, another port, IPv4 options,
fragments, IP version 6, random payloads). Every result must stay exact, and the aggregator's
counters by reason must rise by the numbers sent of each kind, as the serial reference model
(xdp_agg.proto.model) classifies each frame.

Exactness of the counts: every drop reason, in the job's row and in the row of packets without
a job, rises by exactly what was sent of it, give or take the frames the path itself dropped
in that window (D: every drop counter of the testbed's namespaces, and the machine's softnet
backlog drops, netns_testbed.counters); the bound is reported. D is 0 in a quiet run, so the
check is exact then. PASS (not ours: the kernel's) is checked as "at least": ARP and the control
connections to xdp-agg serve pass through the same program.
"""

import collections
import json
import subprocess
import sys
import time

import pytest
from harness import junk
from harness.workers import finish_soak_workers, start_soak_workers

from netns_testbed import counters
from xdp_agg.cluster.cluster import Cluster
from xdp_agg.proto.model import Action, ReferenceAggregator
from xdp_agg.proto.reasons import Reason, is_drop

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.slow]

ROUNDS = 8  # each sender sends its frames this many times over, during the all-reduces
UNATTRIBUTED = "unattributed"


def _wait_for_job(cl, name_workers: int, timeout: float = 60.0) -> dict:
    """The job the workers made, once all of them are registered."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        jobs = json.loads(cl.cli("job", "list", "--json").stdout)
        if jobs and len(jobs[0]["workers"]) == name_workers:
            return jobs[0]
        time.sleep(0.2)
    raise AssertionError(f"no job with {name_workers} workers within {timeout:g} s: {jobs}")


def _row_deltas(before: dict, after: dict, job_id: int) -> dict[str, dict[str, int]]:
    """Counters by reason that moved, for the job's row and the row without a job."""
    out = {}
    for row, get in (
        (UNATTRIBUTED, lambda s: s["unattributed"]),
        (job_id, lambda s: s["jobs"][str(job_id)]["reasons"]),
    ):
        a, b = get(before), get(after)
        out[row] = {r: b[r] - a.get(r, 0) for r in b}
    return out


def test_junk_from_an_intruder_and_a_worker_changes_no_sum_and_is_counted(
    testbed_factory, tmp_path
):
    tb = testbed_factory(workers=4, topology="one-arm")
    w0, intruder, agg = tb.workers[0], tb.workers[3], tb.aggregator
    stop = tmp_path / "stop"
    with Cluster(tb) as cl:
        # workers that all-reduce (mixed sizes up to 4 MiB, int32 and float32, every result
        # checked) until told to stop, so the job outlives the junk and its counting
        ranks = start_soak_workers(
            tb, cl, world=3, job="junked", stop=stop, args=("--max-bytes", str(4 << 20))
        )
        try:
            job = _wait_for_job(cl, 3)
            jid = job["job_id"]
            model = ReferenceAggregator()
            model.create_job(
                jid, job["num_workers"], job["elems"], job["slot_base"], job["slot_count"]
            )
            for w in job["workers"]:
                model.add_worker(jid, w["index"], w["ip"], w["agg_port"], w["mac"])
            other_port = next(p for p in range(0xBEE0, 0xBEF0) if p != job["agg_port"])
            kinds = {
                "worker": junk.malformed_frames(
                    w0.ip, w0.mac, agg.ips[0], agg.macs[0], job, other_port, mtu=tb.mtu
                ),
                "intruder": junk.intruder_frames(
                    intruder.ip, intruder.mac, agg.ips[0], agg.macs[0], job
                ),
            }
            # What the aggregator must do with each frame, and that none may touch a slot.
            want: collections.Counter = collections.Counter()
            by_kind = {}
            for who, ks in kinds.items():
                for kind, frames in ks.items():
                    verdicts = [model.process_frame(f) for f in frames]
                    assert all(
                        v.action in (Action.DROP, Action.PASS)
                        and v.reason.name[:4] in ("DROP", "PASS")
                        for v in verdicts
                    ), f"{who}/{kind}: a frame the model would aggregate"
                    c = collections.Counter(
                        (UNATTRIBUTED if v.job_id is None else v.job_id, v.reason.name.lower())
                        for v in verdicts
                    )
                    by_kind[f"{who}/{kind}"] = dict(c)
                    for key, n in c.items():
                        want[key] += n * ROUNDS
            files = {}
            for who, ks in kinds.items():
                files[who] = tmp_path / f"{who}.hex"
                junk.write_frames(files[who], [f for frames in ks.values() for f in frames])
            layout = counters.Layout.from_testbed(tb)
            before = counters.snapshot(layout, cl.stats)
            before_t = time.time()
            senders = {
                who: tb.popen(
                    host,
                    [sys.executable, "-c", junk.SENDER, str(files[who]), str(ROUNDS), "32"],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for who, host in (("worker", w0), ("intruder", intruder))
            }
            sent = {}
            for who, p in senders.items():
                out = p.communicate(timeout=120)[0].split()
                assert p.returncode == 0 and len(out) == 2, f"{who} sender: {out}"
                sent[who] = (int(out[0]), int(out[1]))
            time.sleep(0.3)  # the last frames through the path
            after_t = time.time()
            after = counters.snapshot(layout, cl.stats)
        finally:
            stop.touch()
        reports = finish_soak_workers(ranks, deadline=300)

    # Every all-reduce exact (each rank checks its own), the same number on every rank, and
    # some of them ran while the junk arrived.
    for rank, reps in enumerate(reports):
        assert reps[-1].get("done") and reps[-1]["wrong"] == 0, f"rank {rank}: {reps[-1]}"
        for r in reps[:-1]:
            assert r["ok"], f"rank {rank}: wrong result for {r['dtype']} x {r['bytes']} B: {r}"
    assert len({reps[-1]["allreduces"] for reps in reports}) == 1
    t_junk = (before_t, after_t)
    during = [r for r in reports[0][:-1] if t_junk[0] <= r["at"] <= t_junk[1] + 5]
    assert during, f"no all-reduce finished while the junk was sent: {t_junk}"
    for who, (read, n) in sent.items():
        assert n == read * ROUNDS, f"{who}: sent {n} of {read} x {ROUNDS} frames"

    delta = counters.diff(before, after)
    path_drops = {
        k: v for k, v in counters.drop_counters(delta).items() if not k.startswith("aggregator")
    }
    slack = sum(path_drops.values())
    got = _row_deltas(before["aggregator"], after["aggregator"], jid)
    detail = f"sent by kind (per round): {by_kind}; path drops {path_drops}"
    for row, reasons in got.items():
        for reason, n in reasons.items():
            expected = want.get((row, reason), 0)
            if reason == Reason.PASS.name.lower():
                assert n >= expected - slack, f"{row}/{reason}: {n} < {expected}; {detail}"
            elif is_drop(reason):
                assert expected - slack <= n <= expected, (
                    f"{row}/{reason}: counted {n}, sent {expected} (path drops {slack}); {detail}"
                )
    # and per worker: worker 0's frames that reached the job are its drops; the others have none
    ws_a = before["aggregator"]["jobs"][str(jid)]["workers"]
    ws_b = after["aggregator"]["jobs"][str(jid)]["workers"]
    mine = sum(n for (row, r), n in want.items() if row == jid and is_drop(r))
    w0_index = next(w["index"] for w in job["workers"] if w["ip"] == w0.ip)
    for idx in ws_b:
        d = ws_b[idx]["dropped"] - ws_a.get(idx, {}).get("dropped", 0)
        if int(idx) == w0_index:
            assert mine - slack <= d <= mine, f"worker {idx}: dropped {d}, sent {mine}"
        else:
            assert d == 0, f"worker {idx} sent no junk but has {d} drops"
    assert mine > 0 and want[(UNATTRIBUTED, "drop_unknown_source")] > 0
    # what was sent and counted, for the record (pytest -s shows it)
    counted = {
        f"{row}/{r}": n for row, rs in got.items() for r, n in rs.items() if (row, r) in want
    }
    print(
        json.dumps(
            {
                "sent": {f"{row}/{r}": n for (row, r), n in sorted(want.items(), key=str)},
                "counted": counted,
                "path_drops": slack,
            }
        )
    )
