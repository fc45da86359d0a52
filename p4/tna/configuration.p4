/* configuration.p4 (TNA): sizes of the Tofino variant. */
#ifndef _XDP_AGG_TNA_CONFIGURATION_P4_
#define _XDP_AGG_TNA_CONFIGURATION_P4_

// Slots in the pool shared by all jobs. Per-slot state is kept per (slot, version): registers
// of 2 * POOL_SLOTS entries indexed slot * 2 + version, except the worker bitmaps, which keep
// both versions of a slot in one register pair (one stateful ALU updates both atomically). The
// accumulators keep four quarters of a 256-element packet (one per consume pass) in one register:
// 4 * 2 * 2048 = 16384 pairs of 32 bits, p4app-switchML's register_size (b5c74a0,
// dev_root/p4/configuration.p4 line 23): 8 SRAM blocks and as many map RAMs (+1 each), so 4
// fit in a stage (48 map RAMs). With 4096 slots (17 each) bf-p4c placed 2 a stage: 20 stages.
#ifndef POOL_SLOTS
#define POOL_SLOTS 2048
#endif
#define POOL_SLOT_BITS 11
const bit<32> POOL_ENTRIES = 2 * POOL_SLOTS;
const bit<32> TNA_QUARTERS = 4; // consume passes of a 256-element packet, 64 elements each
const bit<32> ACC_ENTRIES = TNA_QUARTERS * POOL_ENTRIES;

// A register pair holds 2 x 32 bits: a worker bitmap of one version is 32 bits wide, so a job
// has at most 32 workers on Tofino (64 in the XDP and bmv2 programs).
const bit<32> TNA_MAX_WORKERS = 32;

const MulticastGroupId_t FLOOD_MGID = 1;
const bit<32> WORKERS_TABLE_SIZE = 4096;
const bit<32> L2_TABLE_SIZE = 1024;

// The port a pass recirculates through: the recirculation port of the pipe the packet came in on
// (port number bits 6..0; bits 8..7 are the pipe), so every pass of a packet runs in the pipe
// whose registers hold its slot. Tofino: 68 (+ 128 * pipe); Tofino 2: 6.
#if __TARGET_TOFINO__ == 2
const bit<7> RECIRC_PORT_IN_PIPE = 6;
#else
const bit<7> RECIRC_PORT_IN_PIPE = 68;
#endif

// Sparse jobs (docs/protocol.md section 8; sparse_round.p4) on Tofino 2 only: a round key's
// check takes a stateful ALU with three comparisons, which Tofino 2's has (four) and Tofino's
// has not (two), and the stage the check adds in front of the bitmap is one Tofino's 12 do not
// have (the dense pipe uses all of them; p4/README.md). Tofino drops sparse packets as
// drop_bad_type, as a dense job does.
#if __TARGET_TOFINO__ >= 2
#define TNA_SPARSE 1
#endif

#endif
