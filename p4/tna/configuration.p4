/* configuration.p4 (TNA): sizes of the Tofino variant. */
#ifndef _XDP_AGG_TNA_CONFIGURATION_P4_
#define _XDP_AGG_TNA_CONFIGURATION_P4_

// Slots in the pool shared by all jobs. Per-slot state is kept per (slot, version): registers
// of 2 * POOL_SLOTS entries indexed slot * 2 + version, except the worker bitmaps, which keep
// both versions of a slot in one register pair (one stateful ALU updates both atomically).
#ifndef POOL_SLOTS
#define POOL_SLOTS 16384
#endif
const bit<32> POOL_ENTRIES = 2 * POOL_SLOTS;

// A register pair holds 2 x 32 bits: a worker bitmap of one version is 32 bits wide, so a job
// has at most 32 workers on Tofino (64 in the XDP and bmv2 programs).
const bit<32> TNA_MAX_WORKERS = 32;

const MulticastGroupId_t FLOOD_MGID = 1;
const bit<32> WORKERS_TABLE_SIZE = 4096;
const bit<32> L2_TABLE_SIZE = 1024;

#endif
