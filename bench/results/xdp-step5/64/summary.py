"""The table of results-64.md from ab.py's JSON files: per file and tree, the median ns/packet
and, against the file's first tree, the median of the paired (same round) differences with a
bootstrap 95% interval, their interquartile range, and how many passes were slower."""

import json
import random
import statistics
import sys

random.seed(1)
print(
    "| build | elems | passes | tree | median ns/packet "
    "| paired diff vs first tree: median [95% CI] | IQR | passes slower |"
)
print("|---|---|---|---|---|---|---|---|")
for path in sys.argv[1:]:
    d = json.load(open(path))
    names = list(d["passes"])
    base = [p for p, _ in d["passes"][names[0]]]
    head = f"| {d['variant']} | {d['elems']} | {len(base)}"
    print(f"{head} | {names[0]} | {statistics.median(base):.0f} | | | |")
    for n in names[1:]:
        x = [p for p, _ in d["passes"][n]]
        diff = [a - b for a, b in zip(x, base)]
        boot = sorted(statistics.median(random.choices(diff, k=len(diff))) for _ in range(2000))
        q = statistics.quantiles(diff, n=4)
        ci = f"{statistics.median(diff):+.1f} [{boot[50]:+.1f}, {boot[1949]:+.1f}]"
        slower = sum(v > 0 for v in diff)
        print(
            f"{head} | {n} | {statistics.median(x):.0f} | {ci} | {q[0]:+.0f} .. {q[2]:+.0f} "
            f"| {slower}/{len(x)} |"
        )
