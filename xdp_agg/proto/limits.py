"""Limits of an aggregator, the same for every target (XDP, bmv2, the software model)."""

from __future__ import annotations

from . import wire

MAX_JOBS = 64  # job ids 0..63
MAX_WORKERS = 64  # workers per job: one bit each in a u64 bitmap
MAX_PORTS = 64  # switch-mode ports
MAX_ELEMS = wire.MAX_ELEMS  # int32 per packet, upper bound over size codes
DEFAULT_POOL_SLOTS = 1024  # slots in the pool (all jobs); each has two versions
NO_JOB = MAX_JOBS  # counter row for packets that belong to no job
# Worker index of a job's parent aggregator in the `workers` table (tree jobs): the parent's
# results are recognised by (its address, the job's uplink port) like any worker's packets.
PARENT_INDEX = 0xFFFFFFFF
# A tree job's parent takes the top bit of the slot's `seen` bitmap: at most 63 workers.
MAX_TREE_WORKERS = MAX_WORKERS - 1
