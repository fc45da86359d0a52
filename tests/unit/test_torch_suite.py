"""PyTorch's own distributed tests against the xdpagg backend, beside gloo (tests/torch_suite.py).

torch ships its conformance tests for a process-group backend in the wheel
(torch/testing/_internal/distributed/distributed_test.py, `DistributedTest._DistTestBase`, the
body of torch's test/distributed/test_distributed_spawn.py). This driver runs that class twice
at one world size, ranks forked by torch's harness: on gloo, and on xdpagg with the soft
aggregator on loopback, both with gloo's selection of tests (BACKEND=gloo at import). Every test
gloo passes must pass on xdpagg, but for those in DIFFERENT, each failing with its stated reason;
one that fails on xdpagg is run once more alone, and printed (_rerun_once); one that passes
then is flaky, named in the output and in the run's summary.json, and not counted as passed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from harness.suite_outcomes import count, settle, summary

pytest.importorskip("torch", reason="torch is not importable: make test installs it")
pytest.importorskip("expecttest", reason="torch's test harness needs expecttest (test extra)")

ROOT = Path(__file__).resolve().parents[2]
SUITE = str(ROOT / "tests" / "torch_suite.py")

# Tests whose outcome legitimately differs on xdpagg: name -> (why, text its failure contains).
DIFFERENT = {
    name: (
        "torch's dist.monitored_barrier refuses every backend but gloo by name, before it calls "
        "the group (distributed_c10d.py, monitored_barrier: `if get_backend(group) != "
        "Backend.GLOO`); the group's own monitored_barrier method is delegated to gloo and works",
        "monitored_barrier is only implemented for GLOO backend",
    )
    for name in ("test_monitored_barrier_gloo", "test_monitored_barrier_gloo_subgroup")
}
DIFFERENT["test_get_backend"] = (
    "the test compares dist.get_backend() with the BACKEND it was selected under (gloo); the "
    "group is an xdpagg group and says so",
    "'xdpagg' != 'gloo'",
)


class _Suite:
    """One run of the suite in the background (`only`: the tests named so); `outcomes()` waits
    for it and gives {test: {outcome, detail, log}}. The gloo and xdpagg runs go side by side:
    each spends most of its time waiting (torch's tests sleep and time out), and the ranks
    rendezvous through files in their own temporary folders, so they do not meet."""

    def __init__(self, backend: str, world: int, tmp: Path, env: dict, only: str | None = None):
        tag = f"{backend}-{world}" + (f"-{only}" if only else "")
        self.backend, self.world = backend, world
        self.out, self.log = tmp / f"{tag}.json", tmp / f"{tag}.log"
        env = dict(
            os.environ,
            **env,
            BACKEND="gloo",
            WORLD_SIZE=str(world),
            PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            OMP_NUM_THREADS="1",
        )
        with open(self.log, "w") as f:  # the ranks' own stderr too (a rank's traceback)
            self.proc = subprocess.Popen(
                [sys.executable, SUITE, "--backend", backend, "--json", str(self.out)]
                + (["-k", only] if only else []),
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,  # its own process group: the ranks it forks too
            )

    def stop(self) -> None:
        """End the run if it still goes: its process group, the ranks torch forked with it."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def outcomes(self) -> dict:
        try:
            self.proc.wait(timeout=1800)
        finally:
            self.stop()
        text = self.log.read_text()
        assert self.out.exists(), f"the suite did not finish on {self.backend}:\n{text[-3000:]}"
        print(f"{self.backend} world {self.world}: {text.strip().splitlines()[-1]} ({self.log})")
        outcomes = json.loads(self.out.read_text())
        for v in outcomes.values():
            v["log"] = text  # for the failure message: what the ranks printed
        return outcomes


def _ranks_said(outcome: dict, name: str) -> str:
    """What the run printed while the test ran (the suite names each test as it starts; the
    ranks' own tracebacks follow), for a failure message."""
    lines = outcome["log"].splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(name + " ")), None)
    if start is None:
        return ""
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i].startswith("test_")), len(lines)
    )
    return "\nwhat the run printed meanwhile:\n" + "\n".join(lines[start:end][-80:])


def _rerun_once(gloo: dict, xdp: dict, world: int, tmp: Path, env: dict) -> None:
    """Run each test that gloo passed and xdpagg did not (DIFFERENT's aside) once more, alone,
    and keep the second outcome, with the first failure kept in its detail and printed. On a
    loaded 2-core machine a rank process has been seen to exit with code 1 and no traceback
    reaching the harness (once in about ten runs of the suite; not reproduced alone, nor in
    three more full runs): a second failure still fails here."""
    for name, g in sorted(gloo.items()):
        x = xdp[name]
        if name in DIFFERENT or g["outcome"] != "passed" or x["outcome"] == "passed":
            continue
        again = _Suite("xdpagg", world, tmp, env, only=name).outcomes().get(name)
        first = {**x, "detail": f"{x['detail']}{_ranks_said(x, name)}"}
        xdp[name] = settle(first, again)
        print(f"{name}: {x['outcome']} on xdpagg, {xdp[name]['outcome']} after a rerun; first:")
        print(first["detail"])


@pytest.mark.parametrize(
    "world", [2, pytest.param(4, marks=pytest.mark.slow)], ids=["world2", "world4"]
)
def test_pytorch_distributed_suite_on_xdpagg_as_on_gloo(world, tmp_path):
    """Every test of torch's suite that gloo passes passes on xdpagg (but DIFFERENT's)."""
    from harness.ranks import soft_cluster

    gloo_run = _Suite("gloo", world, tmp_path, {})
    try:
        with soft_cluster() as cl:
            env = {
                "XDP_AGG_CONTROL": cl.endpoint,
                "XDP_AGG_SECRET_FILE": cl.secret_file,
                "XDP_AGG_SUITE_PREFIX": cl.prefix,
            }
            xdp = _Suite("xdpagg", world, tmp_path, env).outcomes()
            gloo = gloo_run.outcomes()
            print(f"gloo {count(gloo)}, xdpagg {count(xdp)}")
            _rerun_once(gloo, xdp, world, tmp_path, env)
    finally:
        gloo_run.stop()  # when the xdpagg run failed first
    report = {"gloo": summary(gloo), "xdpagg": summary(xdp)}
    (tmp_path / "summary.json").write_text(json.dumps(report, indent=1))
    print(f"summary ({tmp_path / 'summary.json'}): {json.dumps(report)}")
    if report["xdpagg"]["flaky"]:
        print(f"FLAKY on xdpagg (failed, then passed alone): {report['xdpagg']['flaky']}")
    assert set(gloo) == set(xdp), "the two runs selected different tests"
    wrong = []
    for name, g in sorted(gloo.items()):
        x = xdp[name]
        if name in DIFFERENT:
            if g["outcome"] == "passed" and DIFFERENT[name][1] not in x["detail"]:
                wrong.append(
                    f"{name}: expected to fail with {DIFFERENT[name][1]!r}: {x['outcome']}, "
                    f"{x['detail']}"
                )
        elif g["outcome"] == "passed" and x["outcome"] not in ("passed", "flaky"):
            wrong.append(f"{name}: {x['outcome']} on xdpagg:\n{x['detail']}{_ranks_said(x, name)}")
        elif g["outcome"] == "skipped" and x["outcome"] == "failed":
            wrong.append(f"{name}: failed on xdpagg, skipped on gloo:\n{x['detail']}")
    assert not wrong, "\n\n".join(wrong)
    assert count(gloo)["passed"] > 50, f"gloo itself passed too few tests: {count(gloo)}"
