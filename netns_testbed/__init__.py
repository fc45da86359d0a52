"""Build and remove network-namespace testbeds for in-network aggregation.

N workers (1..32) and one aggregator, either on a bridge (``one-arm``) or
with one veth per worker into the aggregator (``switch``); optional tbf rate
limits, nftables loss/duplication, a JSON state file per testbed under
/run/netns-testbed, pytest fixtures (:mod:`netns_testbed.fixtures`) and the
``netns-testbed`` CLI. Needs root.
"""

from .errors import NotRootError, TestbedError
from .hosts import AggregatorHost, ObserverHost, WorkerHost
from .plan import MAX_TESTBED_WORKERS, TOPOLOGIES, new_prefix
from .registry import STATE_DIR, list_states
from .testbed import Testbed, require_root

__all__ = [
    "AggregatorHost",
    "MAX_TESTBED_WORKERS",
    "NotRootError",
    "ObserverHost",
    "STATE_DIR",
    "TOPOLOGIES",
    "Testbed",
    "TestbedError",
    "WorkerHost",
    "list_states",
    "new_prefix",
    "require_root",
]
