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
}

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
