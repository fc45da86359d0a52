/* types.p4 (TNA): types, per-packet metadata, and what ingress bridges to egress. */
#ifndef _XDP_AGG_TNA_TYPES_P4_
#define _XDP_AGG_TNA_TYPES_P4_

typedef bit<8> job_id_t;
typedef bit<8> worker_id_t;
typedef bit<32> worker_bitmap_t;
typedef bit<32> pool_entry_t; // slot * 2 + version
typedef bit<15> pool_slot_t; // slot: pool_index bits 14..0 (register pair index of the bitmaps)
typedef bit<14> acc_index_t; // an accumulator pair: quarter ++ version ++ slot (bits 10..0)

// The pass a packet of ours is in (p4app-switchML's packet_type CONSUME0..3, HARVEST0..7):
// consume k sums elements 64k..64k+63 (d0, d1) into quarter k; harvest h reads 32 elements of
// quarter 3 - h / 2 back (h even: d1's half, h odd: d0's). next_step_selector.p4 has the order.
typedef bit<4> step_t;
const step_t STEP_CONSUME0 = 0;
const step_t STEP_CONSUME3 = 3;
const step_t STEP_HARVEST0 = 8;
const step_t STEP_HARVEST7 = 15;

struct worker_bitmap_pair_t {
    worker_bitmap_t first; // version 0
    worker_bitmap_t second; // version 1
}

struct exponent_pair_t {
    bit<8> first; // e0
    bit<8> second; // e1
}

const bit<8> KIND_NONE = 0;
const bit<8> KIND_RESULT = 1;
const bit<8> KIND_ANSWER = 2;
const bit<8> KIND_FLOOD = 3;

/* Ingress -> ingress: what the first pass of a packet decided, in front of it while it
 * recirculates (egress bypassed), as p4app-switchML carries its switchml_md between passes. */
header fold_h {
    step_t step; // the pass it enters
    bit<2> quarter; // the accumulators' quarter that pass uses
    bit<1> is_new;
    bit<1> pad0;
    bit<8> count_before;
    bit<8> reason;
    bit<8> counter_row;
    job_id_t job_id;
    bit<7> pad1;
    PortId_t ingress_port; // of the first pass: where an answer goes
    MulticastGroupId_t mgid;
    // The packet's job takes sparse rounds (the close pass: sparse_round.p4). A byte of its own
    // (bf-p4c: on Tofino 2 an action that writes constants into a container copies from one
    // other container at most; in is_new's byte, beside the constant step and quarter, it was
    // a second).
    bit<7> pad2;
    bit<1> sparse_job;
}

/* Ingress -> egress (bridged in front of the packet, as p4app-switchML bridges switchml_md). */
header bridged_md_h {
    bit<8> kind;
    job_id_t job_id;
    bit<8> counter_row;
    bit<7> pad;
    PortId_t ingress_port;
}

/* Ingress state of a packet of ours. */
struct switchml_md_t {
    bit<1> ours;
    bit<1> accepted;
    bit<8> reason;
    bit<8> counter_row;
    job_id_t job_id;
    worker_id_t worker_id;
    worker_bitmap_t worker_bit; // 1 << worker_id
    bit<8> num_workers;
    bit<3> size_code;
    bit<1> wire16; // set_worker: the job's element width (1: two 16-bit elements a word)
    MulticastGroupId_t mgid;
    pool_slot_t slot; // set by the parser: pool_index bits 14..0 (bit 14 reserved: out of range)
    bit<1> version; // set by the parser: pool_index bit 15
    pool_entry_t pool_entry;
    worker_bitmap_t bitmap_before; // this version's bitmap before this packet
    // The slot range as saturating subtractions in set_worker (a Tofino gateway compares a
    // field with a constant, or two fields for equality only):
    pool_slot_t slots_below; // slot_base |-| slot: not 0 <=> slot < slot_base
    pool_slot_t slots_left; // slot_end |-| slot: 0 <=> slot >= slot_end
    // Lengths the job's size code gives minus the packet's (set_worker: differences, compared
    // with 0 by the gateways of the next stage):
    bit<16> udp_len_diff;
    bit<16> ip_len_diff;
    bit<8> count_before; // remaining contributions before this packet (0: fresh or complete)
    bit<1> is_new; // the worker's bit was clear in this version's bitmap
    step_t step; // this pass (0 in the first)
    bit<2> quarter; // the accumulators' quarter of this pass
    bit<1> folds; // set by next_step: the packet recirculates (counted in its last pass)
    PortId_t ingress_port; // of the first pass
    // Sparse jobs (docs/protocol.md section 8; sparse_round.p4; Tofino 2 only). The parser
    // sets sparse_job, sparse and rk to 0.
    bit<1> sparse_job; // set_worker: the job takes sparse contributions too
    bit<1> sparse; // an accepted sparse contribution (msg_type 2 or 3)
    bit<1> empty; // msg_type 3: no data (header-only or padded)
    bit<32> key_lo; // the round key the packet names: block (DENSE_KEY for a dense packet)
    bit<32> key_hi; // and blocks (DENSE_KEY)
    bit<8> rk; // SparseRound's verdict on the key (RK_*)
    // Rows 11-12 as saturating subtractions in set_worker, compared with 0 by the gateways:
    bit<32> blocks_left; // blocks |-| block: 0 <=> block >= blocks
    bit<32> next_over; // next |-| blocks: not 0 <=> next > blocks
    bit<32> next_back; // block |-| next: not 0 <=> next < block
    bit<16> sparse_udp_len_diff; // a data packet's UDP length (22 + 4k bytes) minus the packet's
    bit<16> sparse_ip_len_diff;
    bit<16> sparse_udp_len; // those lengths themselves: a result with data's
    bit<16> sparse_ip_len;
    bit<32> e0_biased; // e0 ^ 0x80, zero-extended: the signed order as unsigned, for a max
    bit<32> next_min; // the round's smallest next, its e0 (biased), whether it has data
    bit<32> next_e0;
    bit<8> has_data;
}

#ifdef TNA_SPARSE
// Sparse rounds' constants (sparse_round.p4).
const bit<32> DENSE_KEY = 0x7FFFFFFF; // a dense round's block and blocks: block = blocks
const bit<32> ROUND_OPEN = 0x80000000; // in a stored key's hi word: the round is open
const bit<32> BLOCKS_MASK = 0x7FFFFFFF; // a stored key's blocks (row 11: blocks < 2^31)
// SparseRound's verdict, two values (bf-p4c: a stateful ALU outputs one nonzero constant, a
// power of two, from its predicate; mau/stateful_alu.cpp "cannot output constant").
const bit<8> RK_NONE = 0; // not checked, claimed, or the open round's key: on to the bitmap
const bit<8> RK_OTHER = 1; // another round's key is open: drop_sparse_mismatch
#endif

struct ingress_metadata_t {
    switchml_md_t sml;
    bridged_md_h bridged;
    bool update_ipv4_checksum;
}

struct egress_metadata_t {
    bridged_md_h bridged;
    bool update_ipv4_checksum;
    bit<8> reason;
}

#endif
