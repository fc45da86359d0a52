"""The CLI tables of results-64.md: `python3 cli_table.py DIR old main ...` reads
DIR/<tree>-<run>.json (`xdp-agg bench --repeats 5 --json`, runs 1-3) and prints each case's three
runs per tree and the ratio of each later tree's median to the first's."""

import json
import statistics
import sys

d, trees = sys.argv[1], sys.argv[2:]
ORDER = ["percpu", "spinlock", "percpu-frags", "percpu+udp-csum", "percpu-unicast"]
runs = {}
for t in trees:
    for i in (1, 2, 3):
        for r in json.load(open(f"{d}/{t}-{i}.json")):
            key = (r["variant"], r["elems_per_packet"])
            runs.setdefault(key, {}).setdefault(t, []).append(r["ns_per_packet"])
cols = " | ".join(f"{t}: ns/packet (3 runs)" for t in trees)
ratios = " | ".join(f"median {t}/{trees[0]}" for t in trees[1:])
print(f"| build | elems | {cols} | {ratios} |")
print("|---|---|" + "---|" * (2 * len(trees) - 1))
for key in sorted(runs, key=lambda k: (k[1], ORDER.index(k[0]))):
    r = runs[key]
    vals = " | ".join(", ".join(f"{v:.0f}" for v in r[t]) for t in trees)
    m0 = statistics.median(r[trees[0]])
    rat = " | ".join(f"{statistics.median(r[t]) / m0:.2f}" for t in trees[1:])
    print(f"| {key[0]} | {key[1]} | {vals} | {rat} |")
