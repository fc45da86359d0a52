"""pytest fixtures: testbeds that are always torn down, even when a test fails.

Use them from a conftest.py, either with ``pytest_plugins =
["netns_testbed.fixtures"]`` (top-level conftest only) or by importing::

    from netns_testbed.fixtures import testbed, testbed_factory  # noqa: F401

Then::

    def test_x(testbed_factory):
        tb = testbed_factory(workers=3, topology="switch", rate="1gbit")
        ...

    @pytest.mark.parametrize("testbed", [{"topology": "switch"}], indirect=True)
    def test_y(testbed):
        ...

Both skip the test (with the reason) when not running as root.
"""

from __future__ import annotations

import os

import pytest

from .errors import TestbedError
from .testbed import Testbed

SKIP_REASON = "needs root to build network namespaces (run pytest as root, e.g. with sudo)"


def skip_unless_root() -> None:
    """pytest.skip with a clear reason unless running as root."""
    if os.geteuid() != 0:
        pytest.skip(SKIP_REASON)


@pytest.fixture
def testbed_factory():
    """Callable ``make(**Testbed_kwargs) -> Testbed`` returning a testbed that is
    up; every testbed it made is brought down after the test, pass or fail."""
    skip_unless_root()
    made: list[Testbed] = []

    def make(**kwargs) -> Testbed:
        tb = Testbed(**kwargs)
        made.append(tb)  # before up(): a failing up() is cleaned up too
        return tb.up()

    yield make
    errors = []
    for tb in reversed(made):
        try:
            tb.down()
        except TestbedError as e:
            errors.append(f"{tb.prefix}: {e}")
    if errors:
        raise TestbedError("testbed teardown failed: " + "; ".join(errors))


@pytest.fixture
def testbed(request, testbed_factory):
    """A running testbed; default one-arm with 2 workers. Options through
    indirect parametrization: ``parametrize("testbed", [{...}], indirect=True)``."""
    return testbed_factory(**(getattr(request, "param", None) or {}))
