"""PyTorch's own distributed conformance tests, run against a backend
(tests/unit/test_torch_suite.py).

    BACKEND=gloo WORLD_SIZE=2 python tests/torch_suite.py --backend xdpagg --json out.json [-k PAT]

The tests are the class torch ships in its wheel, `DistributedTest._DistTestBase` of
torch/testing/_internal/distributed/distributed_test.py (the body of torch's own
test/distributed/test_distributed_spawn.py), with the ranks spawned by torch's harness
(`TestDistBackend`, one process per rank). The module decides at import which tests run from
the environment's BACKEND, so BACKEND=gloo selects gloo's tests (require_backend_is_available
({"gloo"}), the skips of a CPU-only machine); each rank then makes the groups the tests ask
gloo for (init_process_group, new_group) on `--backend`: gloo's selection of tests, their
bodies unchanged, run on the backend under test.

For xdpagg every rank needs its own address towards the aggregator: rank r takes
XDP_AGG_IP = <XDP_AGG_SUITE_PREFIX>.<2 + r> (loopback addresses of the soft aggregator's
/24, which the driver gives). Prints unittest's summary and writes each test's outcome to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import unittest

import torch.multiprocessing
from torch.testing._internal.distributed import distributed_test as dt


class TestSuite(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
    """torch's test_distributed_spawn class, with the backend swapped in each rank."""

    def setUp(self):
        super().setUp()
        # forked ranks inherit the imported torch and test module: a test takes about a tenth
        # of the time spawned ranks take to import them again (torch 2.13 has no _fork_processes)
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        _swap_backend(os.environ["SUITE_BACKEND"])
        prefix = os.environ.get("XDP_AGG_SUITE_PREFIX")
        if prefix:
            os.environ["XDP_AGG_IP"] = f"{prefix}.{2 + rank}"  # harness.ranks' addresses
        if dt.BACKEND == "xdpagg":
            import hostlib.pt

            hostlib.pt.register_backend()
        super()._run(rank, test_name, file_name, pipe, **kwargs)


def _swap_backend(backend: str) -> None:
    """Make the groups the tests ask gloo for on `backend` instead, in this rank only: the test
    bodies keep reading BACKEND == "gloo" (several build their model only in a branch per known
    backend), while init_process_group and new_group make `backend` groups."""
    if backend == "gloo":
        return
    real_init, real_new_group = dt.dist.init_process_group, dt.dist.new_group

    def swap(kwargs, args, at):
        if len(args) > at and args[at] == "gloo":
            args = args[:at] + (backend,) + args[at + 1 :]
        if kwargs.get("backend") in ("gloo", dt.dist.Backend.GLOO):
            kwargs["backend"] = backend
        return args, kwargs

    def init_process_group(*args, **kwargs):
        args, kwargs = swap(kwargs, args, 0)
        return real_init(*args, **kwargs)

    def new_group(*args, **kwargs):
        args, kwargs = swap(kwargs, args, 2)
        return real_new_group(*args, **kwargs)

    dt.dist.init_process_group = init_process_group
    dt.dist.new_group = new_group


class _Outcomes(unittest.TextTestResult):
    """unittest's result, keeping each test's outcome for the JSON report."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, dict] = {}
        self.started = 0.0

    def startTest(self, test):  # noqa: N802 - unittest's names
        super().startTest(test)
        self.started = time.monotonic()

    def _set(self, test, outcome, detail=""):
        self.outcomes[test.id().rsplit(".", 1)[-1]] = {
            "outcome": outcome,
            "detail": detail,
            "seconds": round(time.monotonic() - self.started, 3),  # where a slow run's time went
        }

    def addSuccess(self, test):  # noqa: N802 - unittest's names
        super().addSuccess(test)
        self._set(test, "passed")

    def addFailure(self, test, err):  # noqa: N802
        super().addFailure(test, err)
        self._set(test, "failed", self._exc_info_to_string(err, test)[-3000:])

    def addError(self, test, err):  # noqa: N802
        super().addError(test, err)
        self._set(test, "failed", self._exc_info_to_string(err, test)[-3000:])

    def addSkip(self, test, reason):  # noqa: N802
        super().addSkip(test, reason)
        self._set(test, "skipped", reason)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", required=True, help="the backend under test: gloo or xdpagg")
    ap.add_argument("--json", required=True, help="where to write {test: {outcome, detail}}")
    ap.add_argument("-k", action="append", default=[], help="only tests whose name has this")
    args = ap.parse_args()
    if os.environ.get("BACKEND") != "gloo":
        ap.error("run with BACKEND=gloo in the environment (it selects gloo's tests at import)")
    os.environ["SUITE_BACKEND"] = args.backend
    loader = unittest.TestLoader()
    if args.k:
        loader.testNamePatterns = [f"*{k}*" for k in args.k]
    suite = loader.loadTestsFromTestCase(TestSuite)
    # verbosity 2 names each test as it starts: what its ranks print follows the name
    runner = unittest.TextTestRunner(stream=sys.stdout, verbosity=2, resultclass=_Outcomes)
    result = runner.run(suite)
    with open(args.json, "w") as f:
        json.dump(result.outcomes, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
