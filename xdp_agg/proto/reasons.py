"""Why a packet took the path it took: one counter per reason and job, in every target.

The XDP program, the P4 program and the software aggregator count by these reasons, in the rows
and columns given by xdp_agg.proto.keys.counter_key; the reference model returns one per packet.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum


class Reason(IntEnum):
    """Why a packet took the path it took; one counter each, per job."""

    PASS = 0  # not ours: passed to the kernel
    AGGREGATED = 1  # a new contribution, added, packet consumed
    COMPLETED = 2  # a new contribution that completed its slot: result sent to all
    RETX_ANSWERED = 3  # a retransmission for a completed slot: stored result to the sender
    DUP_PENDING = 4  # a duplicate for a slot still incomplete: dropped (sender will retry)
    DROP_TRUNCATED = 5  # frame shorter than its headers or than its size code needs
    DROP_UNKNOWN_SOURCE = 6  # (source address, port) not registered
    DROP_NO_JOB = 7  # registered to a job that is not active
    DROP_BAD_TYPE = 8  # msg_type other than data
    DROP_BAD_SIZE = 9  # size code other than the job's
    DROP_SLOT_RANGE = 10  # slot outside the job's range (or reserved bit set)
    DROP_MALFORMED = 11  # our port but IPv4 options or a fragment
    EGRESS_SENT = 12  # switch mode: a result copy addressed to a worker on its port
    EGRESS_NO_WORKER = 13  # switch mode: a result copy for a port with no worker of that job
    DROP_BAD_LENGTH = 14  # IPv4 total or UDP length disagrees with the frame or the size code
    DROP_BAD_CHECKSUM = 15  # a job that verifies UDP checksums: a nonzero checksum that is wrong
    # Two-level aggregation (a rack job with a parent aggregator, docs/protocol.md section 3.7):
    FORWARDED_UP = 16  # a contribution that completed its slot locally: partial sum to the parent
    RESENT_UP = 17  # a retransmission while the parent has not answered: partial sum re-sent up
    PARENT_RESULT = 18  # the parent's result for a slot waiting on it: stored, sent to the workers
    STALE_PARENT_RESULT = 19  # a parent result for no waiting round (old, duplicate): dropped
    # Sparse jobs (docs/protocol.md section 8): a bad contribution changes no slot state.
    DROP_SPARSE_RANGE = 20  # block not below blocks, or next beyond blocks: outside the tensor
    DROP_SPARSE_BACKWARDS = 21  # next below block (or equal to it, with data): goes backwards
    DROP_SPARSE_MISMATCH = 22  # kind (dense, sparse), block or blocks other than its round's
    DROP_BAD_WIDTH = 23  # the width bit (16- or 32-bit elements) other than the job's


NUM_REASONS = len(Reason)

# A rack job's parent-link counters (docs/protocol.md section 3.7), as every target reports them
# in its parent status: the lower-case names of the tree reasons.
PARENT_REASONS = tuple(
    r.name.lower()
    for r in (
        Reason.FORWARDED_UP,
        Reason.RESENT_UP,
        Reason.PARENT_RESULT,
        Reason.STALE_PARENT_RESULT,
    )
)

# The reasons that drop a packet as bad (the DROP_ ones): what xdpagg_drops_total counts, what
# a test or a benchmark sums as the aggregator's drops. DUP_PENDING and STALE_PARENT_RESULT drop
# a packet too, but as expected traffic (a retry, a late answer), not as bad; EGRESS_NO_WORKER
# is a result copy with nobody to take it, a verdict of switch mode.
DROPS = frozenset(r for r in Reason if r.name.startswith("DROP_"))
DROP_NAMES = frozenset(r.name.lower() for r in DROPS)


def is_drop(name: str) -> bool:
    """Whether the reason called `name` (lower case, as counters name it) is one of DROPS."""
    return name in DROP_NAMES


def drop_total(counted: Mapping[str, int]) -> int:
    """The packets of `counted` ({reason name: packets}) dropped as bad (DROPS)."""
    return sum(n for name, n in counted.items() if name in DROP_NAMES)
