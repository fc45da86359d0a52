"""Shared test configuration: root-only tests skip (with the reason) when not root; the harness
(tests/harness) and the testbed's fixtures come in as plugins."""

import os
import shutil

import pytest
from harness.builds import AGG_BUILDS, load_agg_build

# The harness as plugins, so that a test asks for a fixture by name (soft, two_cpus, xdp_agg,
# p4_json, testbed) instead of importing it under a noqa; its functions are imported from
# harness.* like any module.
pytest_plugins = [
    "harness.ranks",
    "harness.cpus",
    "harness.cli",
    "harness.p4",
    "netns_testbed.fixtures",
]


@pytest.fixture(scope="session", autouse=True)
def _state_dir(tmp_path_factory):
    """xdp-agg's state directory (XDP_AGG_STATE_DIR: serve's lock and job table, secrets) in a
    directory of this session, removed with it, for the test process and every command it
    starts: each test serves under a fresh aggregator name, and the lock files that must
    outlive a serve would otherwise pile up in /run/xdp-agg, one per test and run."""
    if "XDP_AGG_STATE_DIR" in os.environ:  # the caller chose one
        yield
        return
    path = tmp_path_factory.mktemp("xdp-agg-state")
    os.environ["XDP_AGG_STATE_DIR"] = str(path)
    try:
        yield
    finally:
        del os.environ["XDP_AGG_STATE_DIR"]
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(
        reason="needs root (BPF, namespaces): run the tests with sudo, as .ci/run does"
    )
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fake():
    """A FakeDevice (tests/harness/fake_device.py: needs torch) for hostlib.pt.staging's
    copies, closed after the test, which fails if the staging broke one of its rules."""
    from harness.fake_device import FakeDevice

    device = FakeDevice()
    yield device
    device.close()
    assert not device.violations, device.violations


@pytest.fixture(scope="session", params=AGG_BUILDS)
def agg_prog(request):
    """The XDP aggregator compiled and loaded once per variant (not attached), with typed map
    access. Every test using it runs against the per-CPU design, the spin-lock baseline and the
    per-CPU design loaded as a multi-buffer (frags) program, the one jumbo frames need; a test
    of jumbo frames skips the others (prog.options["frags"] says which it has)."""
    yield from load_agg_build(request.param)


@pytest.fixture
def agg(agg_prog):
    """The loaded aggregator with every job and worker removed before the test."""
    from xdp_agg import bpfsys

    prog, maps = agg_prog
    for j in list(maps.jobs()):
        maps.delete_job(j)
    for key, _ in maps.workers():
        bpfsys.map_delete(maps.fds["workers"], key)
    return prog, maps
