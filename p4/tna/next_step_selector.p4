/* next_step_selector.p4 (TNA): what happens to a packet of ours after this pass.
 *
 * A pass sums 64 elements and reads 32 back (processor.p4), so bigger results take more passes,
 * through the recirculation port of the packet's pipe, egress bypassed (p4app-switchML's folded
 * pipe, b5c74a0 dev_root/p4/next_step_selector.p4 and dev_root/controller/next_step_selector.py
 * lines 73-123, on one pipe: the quarter of the registers takes the place of p4app's pipe):
 *
 * | size | passes                                                       | result          |
 * |------|--------------------------------------------------------------|-----------------|
 * | 32   | consume 0 (d1 summed and read)                               | d1              |
 * | 64   | consume 0 (d1 read), harvest 7 (d0 read)                     | d0 d1           |
 * | 256  | consume 0..3 (64 each, dropped once summed), harvest 0..7    | 32 a pass, put  |
 * |      | (quarter 3 - h/2: h even d1's half, h odd d0's)              | in front: 0..255|
 *
 * Only what the first pass found COMPLETED or RETX_ANSWERED goes on to harvest; AGGREGATED stops
 * after its last consume pass, everything else after the first. A packet is counted once, by its
 * first pass's reason, in its last pass (the reasons counter skips a pass that folds).
 *
 * Sparse jobs (Tofino 2, sparse_round.p4): a 32-element completion takes a second pass, harvest
 * 7 (which reads nothing it keeps), whose stage of SparseRound closes the other version's round
 * key before the result leaves; a 64-element one closes in its own harvest 7. */
#ifndef _XDP_AGG_TNA_NEXT_STEP_SELECTOR_P4_
#define _XDP_AGG_TNA_NEXT_STEP_SELECTOR_P4_

control NextStepSelector(inout header_t hdr, inout ingress_metadata_t ig_md,
                         in ingress_intrinsic_metadata_t ig_intr_md,
                         inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                         inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {

    // Into the next pass: what this one decided in front of the packet, out of the pipe's
    // recirculation port, egress bypassed.
    action fold(step_t step, bit<2> quarter) {
        hdr.fold.setValid();
        hdr.fold.step = step;
        hdr.fold.quarter = quarter;
        hdr.fold.is_new = ig_md.sml.is_new;
        hdr.fold.pad0 = 0;
#ifdef TNA_SPARSE
        hdr.fold.sparse_job = ig_md.sml.sparse_job;
#else
        hdr.fold.sparse_job = 0;
#endif
        hdr.fold.pad2 = 0;
        hdr.fold.count_before = ig_md.sml.count_before;
        hdr.fold.reason = ig_md.sml.reason;
        hdr.fold.counter_row = ig_md.sml.counter_row;
        hdr.fold.job_id = ig_md.sml.job_id;
        hdr.fold.pad1 = 0;
        hdr.fold.ingress_port = ig_md.sml.ingress_port;
        hdr.fold.mgid = ig_md.sml.mgid;
        ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port[8:7] ++ RECIRC_PORT_IN_PIPE;
        ig_tm_md.bypass_egress = 1;
        ig_md.sml.folds = 1;
    }

    action consume_next(step_t step, bit<2> quarter) { // these 64 are summed: off the packet
        fold(step, quarter);
        hdr.d0.setInvalid();
        hdr.d1.setInvalid();
    }

    action harvest_next(step_t step, bit<2> quarter) { // 64 elements: d1 read, d0 next
        fold(step, quarter);
    }

    action harvest_d1_next(step_t step, bit<2> quarter) { // h even: 32 in d1, in front
        fold(step, quarter);
        hdr.d1.setValid();
    }

    action harvest_d0_next(step_t step, bit<2> quarter) { // h odd: 32 in d0, in front
        fold(step, quarter);
        hdr.d0.setValid();
    }

    // What every result leaves with, as p4app-switchML's sender writes it; bridged to egress.
    action leave(bit<8> kind) {
        hdr.fold.setInvalid();
        hdr.ipv4.diffserv = SML_RESULT_TOS;
        hdr.ipv4.identification = SML_RESULT_IP_ID;
        hdr.ipv4.flags = SML_RESULT_IP_FLAGS;
        hdr.ipv4.ttl = SML_RESULT_TTL;
        // the width bit (p4app-switchML's unused bit) stays the request's (protocol.md 5.6)
        hdr.udp.checksum = 0;
        ig_md.bridged.setValid();
        ig_md.bridged.kind = kind;
        ig_md.bridged.job_id = ig_md.sml.job_id;
        ig_md.bridged.counter_row = ig_md.sml.counter_row;
        ig_md.bridged.pad = 0;
        ig_md.bridged.ingress_port = ig_md.sml.ingress_port;
    }

    // COMPLETED: one copy per worker (rid = worker index) through the job's group; egress
    // addresses each.
    action result() {
        leave(KIND_RESULT);
        ig_tm_md.mcast_grp_a = ig_md.sml.mgid;
        hdr.udp.src_port = hdr.udp.dst_port;
    }

    // RETX_ANSWERED: the stored result back to the sender alone, addresses swapped.
    action answer() {
        leave(KIND_ANSWER);
        ig_tm_md.ucast_egress_port = ig_md.sml.ingress_port;
        bit<48> mac = hdr.ethernet.dst_addr;
        hdr.ethernet.dst_addr = hdr.ethernet.src_addr;
        hdr.ethernet.src_addr = mac;
        bit<32> ip = hdr.ipv4.dst_addr;
        hdr.ipv4.dst_addr = hdr.ipv4.src_addr;
        hdr.ipv4.src_addr = ip;
        bit<16> port = hdr.udp.dst_port;
        hdr.udp.dst_port = hdr.udp.src_port;
        hdr.udp.src_port = port;
        ig_md.update_ipv4_checksum = true;
    }

    action result_harvested() { // the last harvest: 32 in d0, in front of the other 224
        result();
        hdr.d0.setValid();
    }

    action answer_harvested() {
        answer();
        hdr.d0.setValid();
    }

    action drop() {
        hdr.fold.setInvalid();
        ig_dprsr_md.drop_ctl = 1;
    }

    table next_step {
        key = {
            // The packet's size, not the job's: the two are equal in every packet that gets
            // this far (bad sizes are dropped), and a copy of it in the fold header would be
            // aligned differently from the one the check compares (a PHV conflict).
            hdr.switchml.size: exact;
            ig_md.sml.step: exact;
            ig_md.sml.reason: exact;
        }
        actions = {
            consume_next;
            harvest_next;
            harvest_d1_next;
            harvest_d0_next;
            result;
            answer;
            result_harvested;
            answer_harvested;
            @defaultonly drop;
        }
        const entries = {
#include "next_step_entries.p4"
        }
        const default_action = drop(); // every drop reason, DUP_PENDING, a finished AGGREGATED
        size = 64;
    }

    apply {
#ifdef TNA_SPARSE
        if (ig_md.sml.sparse_job == 1 && ig_md.sml.step == STEP_CONSUME0
            && ig_md.sml.reason == AGG_COMPLETED && hdr.switchml.size == SML_SIZE_32) {
            harvest_next(STEP_HARVEST7, 0); // the close pass
        } else {
            next_step.apply();
        }
#else
        next_step.apply();
#endif
    }
}

#endif
