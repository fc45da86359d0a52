"""Lockstep A/B of one `xdp-agg bench` case: `python3 ab.py CASE K PASSES name=tree ...` starts
ab_worker.py in each tree (its .venv) and has them run one pass each in turn (the order
reversed every round), so that every tree's passes see the same load; JSON of every pass on
stdout, medians and the paired differences against the first tree on stderr."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("ab_worker.py")
case, k, passes = sys.argv[1], sys.argv[2], int(sys.argv[3])
trees = [a.split("=", 1) for a in sys.argv[4:]]
names = [n for n, _ in trees]
procs = {}
for name, d in trees:
    procs[name] = subprocess.Popen(
        [f"{d}/.venv/bin/python", str(WORKER), case, k],
        cwd=d,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert procs[name].stdout.readline().strip() == "ready", name
res = {n: [] for n in names}
for r in range(passes):
    for n in names if r % 2 == 0 else names[::-1]:
        procs[n].stdin.write("p\n")
        procs[n].stdin.flush()
        res[n].append(tuple(map(float, procs[n].stdout.readline().split())))
for p in procs.values():
    p.stdin.close()
    p.wait()
json.dump({"variant": case, "elems": int(k), "trees": dict(trees), "passes": res}, sys.stdout)
for n in names:
    pr = [p for p, _ in res[n]]
    line = f"# {case} k={k} {n}: median {statistics.median(pr):.1f} min {min(pr):.1f}"
    if n != names[0]:
        d = [a[0] - b[0] for a, b in zip(res[n], res[names[0]])]
        line += f" | paired diff vs {names[0]}: median {statistics.median(d):+.1f}"
    print(line, file=sys.stderr)
