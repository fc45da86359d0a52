/* types.p4: types and the per-packet metadata of the v1model aggregator. */
#ifndef _XDP_AGG_TYPES_P4_
#define _XDP_AGG_TYPES_P4_

typedef bit<9> port_t;
typedef bit<8> job_id_t; // 0..AGG_MAX_JOBS-1; AGG_NO_JOB as a counter row
typedef bit<8> worker_id_t; // 0..AGG_MAX_WORKERS-1
typedef bit<64> worker_bitmap_t; // one bit per worker of a job
typedef bit<32> pool_entry_t; // register index: slot * 2 + version

// What egress does with a packet (sml_metadata_t.kind).
const bit<3> KIND_NONE = 0; // forwarded unchanged (or dropped)
const bit<3> KIND_RESULT = 1; // a multicast copy of a result: address it to the worker (egress_rid)
const bit<3> KIND_ANSWER = 2; // a stored result back to its sender (addresses already swapped)
const bit<3> KIND_FLOOD = 3; // a flooded copy of plain traffic: not back out of its ingress port
const bit<3> KIND_FOLD = 4; // a 256-element packet between passes: recirculate it (FOLD_FIELDS)
const bit<3> KIND_UP = 5; // a rack job's partial sum to its parent (addressed in ingress)

// bmv2's standard_metadata.instance_type of a recirculated packet (PKT_INSTANCE_TYPE_RECIRC).
const bit<32> INSTANCE_TYPE_RECIRC = 4;

// The field list a folded packet keeps across recirculation (@field_list below): what its first
// pass decided. Every other field starts at 0 in the next pass.
const bit<8> FOLD_FIELDS = 1;

/* Everything ingress learns about a packet. bmv2 copies it with each multicast replica, so
 * egress sees the job and kind of every result copy. */
struct sml_metadata_t {
    @field_list(FOLD_FIELDS) bit<1> ours; // IPv4 UDP to 0xBEE0..0xBEEF: never plain traffic
    bit<1> accepted; // passed every check: runs the state machine
    @field_list(FOLD_FIELDS) bit<8> reason; // AGG_* of abi.p4: the counter column
    @field_list(FOLD_FIELDS) bit<8> counter_row; // the job, or AGG_NO_JOB before the job is known
    @field_list(FOLD_FIELDS) job_id_t job_id;
    worker_id_t worker_id;
    bit<1> from_parent; // tree: the parent's result (its address and our uplink port)
    // the job's parameters (jobs table)
    bit<8> num_workers;
    @field_list(FOLD_FIELDS) bit<3> size_code;
    bit<16> slot_base;
    bit<16> slot_end; // exclusive
    bit<1> tree; // a rack job of a two-level tree (docs/protocol.md section 3.7)
    bit<16> parent_slot_base; // tree: the parent job's first slot (ours slot_base maps to it)
    bit<1> job_sparse; // the job takes sparse contributions too (docs/protocol.md section 8)
    bit<1> job_wire16; // the job's packets carry 16-bit elements, width bit set (section 5.6)
    @field_list(FOLD_FIELDS) bit<16> mgid; // the job's multicast group
    // the slot this packet addresses
    @field_list(FOLD_FIELDS) pool_entry_t pool_entry; // slot * 2 + version
    pool_entry_t other_entry; // slot * 2 + (1 - version)
    // a sparse packet (msg_type 2 or 3) of a sparse job: its result is written from the round's
    // stored state (sparse_round.p4), in the last pass of a folded packet
    @field_list(FOLD_FIELDS) bit<1> sparse_pkt;
    // an empty contribution (msg_type 3): adds zeros, whatever a padded one carries
    @field_list(FOLD_FIELDS) bit<1> zero;
    // state machine outcome
    bit<1> is_new; // the worker's bit was not yet set in this version's bitmap
    bit<1> complete; // from the parent: this round is complete here (all n contributions)
    @field_list(FOLD_FIELDS) bit<1> first; // first contribution of a round: overwrite, not add
    @field_list(FOLD_FIELDS) bit<1> add; // a new contribution: accumulate into the registers
    @field_list(FOLD_FIELDS) bit<1> read; // read the stored result into the packet (retransmission)
    @field_list(FOLD_FIELDS) bit<2> pass; // pass of a folded packet: elements 64 * pass ..
    bit<3> kind; // KIND_*
    bit<1> rewrite_ipv4; // addresses changed: recompute the IPv4 checksum
    @field_list(FOLD_FIELDS) port_t ingress_port; // the port of its first pass
}

#endif
