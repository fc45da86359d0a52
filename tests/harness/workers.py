"""What the testbed tests give aggcluster's worker processes: a plan of mixed all-reduces, and
the check of their reports."""

ODD = 10 * 256 + 3  # not a multiple of the packet size

# every dtype, a one-element tensor, an odd length (a partial last packet), and larger ones
MIXED_PLAN = [
    {"dtype": "int32", "count": 1},
    {"dtype": "int32", "count": ODD},
    {"dtype": "int32", "count": 200_000, "seed": 3},
    {"dtype": "float32", "count": 100_000, "seed": 4},
    {"dtype": "float16", "count": ODD, "seed": 5},
]


def assert_reports_ok(reports) -> None:
    """Every result every rank checked was right (aggcluster.cluster_worker's reports)."""
    for rank, reps in enumerate(reports):
        for r in reps:
            if "ok" in r:
                assert r["ok"], f"rank {rank}: wrong result for {r['dtype']} x {r['count']}: {r}"
