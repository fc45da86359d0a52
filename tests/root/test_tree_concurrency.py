"""A rack job's two-level paths on both CPUs at once (docs/protocol.md section 3.7).

Two processes pinned to CPU 0 and CPU 1 drive the same slots with BPF_PROG_TEST_RUN, in step
round by round (as tests/root/test_xdp_concurrency.py does), with one worker per CPU. Each slot
round has two phases: both workers' contributions (one of them completes the slot locally and must
go up, exactly once, with the serial model's partial sum), then on both CPUs at once the same
parent result (as when the broadcast and the answer to a re-send arrive together: exactly one
copy may be taken) and, for some slots, a retransmission of each CPU's worker racing it. A
retransmission goes up again with the partial (`resent_up`; its payload may mix the partial and
the parent's sum, element by element, when it races the parent result's store, which the parent
ignores since it already has our contribution) or is answered with the parent's sum
(`retx_answered`). Checked against the serial model, and the counters add up.
"""

import numpy as np
import pytest
from harness.packet_cases import PARENT_SLOT_BASE, frame, job, parent_frame, workers

from xdp_agg import bpfsys
from xdp_agg.proto import wire
from xdp_agg.proto.model import Action, ReferenceAggregator

pytestmark = [pytest.mark.root, pytest.mark.bpf]

K, SLOTS, ROUNDS, RETX_P = 64, 8, 40, 0.5


def _plan(seed):
    """Per CPU, the phases' frames; per (round, slot), the model's partial sent up, the parent's
    result sent down and the answer to a retransmission after it."""
    rng = np.random.default_rng(seed)
    spec = job(n=2, elems=K, base=0, count=SLOTS, tree=True)
    model = ReferenceAggregator()
    model.create_job_spec(spec)
    for w in workers(0, 2):
        model.add_worker(0, w.index, w.ip, w.agg_port, w.mac)
    per_cpu, want, retx = ([], []), {}, 0
    for r in range(ROUNDS):
        v = r % 2
        contrib, down = ([], []), ([], [])
        for s in range(SLOTS):
            tsi = r * SLOTS + s
            vals = [rng.integers(-(2**30), 2**30, size=K, dtype=np.int64) for _ in range(2)]
            fr = [frame(w, vals[w], slot=s, version=v, tsi=tsi, e0=int(w)) for w in range(2)]
            for w in range(2):
                contrib[w].append(((r, s, w, "new"), fr[w]))
                verdict = model.process_frame(fr[w])
            assert verdict.action == Action.TO_PARENT
            up = verdict.payload
            total = vals[0] + vals[1] + rng.integers(-(2**28), 2**28, size=K, dtype=np.int64)
            pf = parent_frame(total, slot=s + PARENT_SLOT_BASE, version=v, tsi=tsi, e0=5)
            verdict = model.process_frame(pf)
            assert verdict.action == Action.TO_ALL
            answer = model.process_frame(fr[0]).payload  # a retransmission after it, on w0
            want[(r, s)] = (up, verdict.payload, answer)
            for w in range(2):
                items = [((r, s, w, "parent"), pf)]
                if rng.random() < RETX_P:
                    items.insert(int(rng.integers(0, 2)), ((r, s, w, "retx"), fr[w]))
                    retx += 1
                down[w].extend(items)
        for c in (0, 1):
            per_cpu[c].extend([contrib[c], down[c]])
    return spec, per_cpu, want, retx


def _values(payload: bytes) -> np.ndarray:
    return np.frombuffer(payload[wire.VALUES_AT : wire.udp_payload_len(K)], ">i4")


def _check(results, want):
    problems, ups, downs, resent, answered = [], {}, {}, 0, 0
    for res in results:
        for (r, s, w, kind), act, payload, _ in res:
            up, down, answer = want[(r, s)]
            if kind in ("new", "parent"):
                if act == bpfsys.XDP_DROP:
                    continue
                seen = ups if kind == "new" else downs
                if (r, s) in seen:
                    problems.append(f"slot {s} round {r}: {kind} sent twice")
                seen[(r, s)] = payload
                if payload != (up if kind == "new" else down):
                    problems.append(f"slot {s} round {r}: {kind} bytes differ from the model")
            elif act != bpfsys.XDP_TX:
                problems.append(f"slot {s} round {r}: retransmission of w{w} dropped")
            elif payload[6:8] == up[6:8]:  # the parent's pool index: a re-send up
                resent += 1
                got, a, b = _values(payload), _values(up), _values(down)
                if payload[:6] != up[:6] or not np.all((got == a) | (got == b)):
                    problems.append(f"slot {s} round {r}: re-send carries neither sum")
            else:
                answered += 1
                if payload[wire.SWITCHML_HLEN :] != answer[wire.SWITCHML_HLEN :]:
                    problems.append(f"slot {s} round {r}: answer is not the parent's sum")
    for r, s in want:
        for kind, seen in (("forwarded up", ups), ("sent down", downs)):
            if (r, s) not in seen:
                problems.append(f"slot {s} round {r} never {kind}")
    return problems, resent, answered


def test_tree_paths_on_two_cpus(two_cpus, agg):
    prog, maps = agg
    for j in list(maps.jobs()):
        maps.delete_job(j)
    spec, per_cpu, want, retx = _plan(5)
    maps.create_job(spec)
    for w in workers(0, 2):
        maps.add_worker(w)
    results = two_cpus(prog.progs["xdp_agg_ingress"], per_cpu)
    problems, resent, answered = _check(results, want)
    assert not problems, "\n".join(problems[:20])
    n = ROUNDS * SLOTS
    c = maps.counters(0)
    assert (c["forwarded_up"], c["parent_result"], c["stale_parent_result"]) == (n, n, n), c
    assert (c["resent_up"], c["retx_answered"]) == (resent, answered), c
    assert resent + answered == retx and c["aggregated"] == n
