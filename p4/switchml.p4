/* switchml.p4: the xdp-agg aggregator for bmv2 (v1model), the P4 twin of bpf/xdp_agg.c.
 *
 * Implements docs/protocol.md sections 1-3 packet for packet like the reference state machine
 * (xdp_agg/proto/model.py): workers are found by (IPv4 source, UDP destination port); per slot and
 * version, registers hold the workers seen, the contributions counted, the maximum exponents and
 * one accumulator array per payload element of a pass (32 or 64 elements per packet, 256 in four
 * recirculated passes of 64); the first
 * contribution of a round overwrites, the last one carries the sum to every worker of the job
 * through the job's multicast group, a retransmission for a completed slot gets the stored
 * result back alone, everything else of ours is dropped. Every packet is counted by reason in
 * the same rows and columns as the XDP program (include/abi.p4). Traffic that is not ours is
 * switched by a static MAC table.
 *
 * Serial semantics: simple_switch runs ingress in one thread, so the read-modify-write of the
 * registers of one packet never interleaves with another's, as on Tofino.
 *
 * The file layout follows p4app-switchML (one file per control); p4/tna/ is the Tofino variant.
 */
#include <core.p4>
#include <v1model.p4>

#include "include/abi.p4"
#include "configuration.p4"
#include "types.p4"
#include "headers.p4"
#include "parsers.p4"
#include "udp_receiver.p4"
#include "bitmap_checker.p4"
#include "workers_counter.p4"
#include "tree_link.p4"
#include "sparse_round.p4"
#include "exponents.p4"
#include "elements.p4"
#include "next_step_selector.p4"
#include "forwarder.p4"
#include "udp_sender.p4"

control SmlIngress(inout headers_t hdr, inout sml_metadata_t md, inout standard_metadata_t sm) {
    // Packets by (row, reason): index row * AGG_NUM_REASONS + reason, row = job or AGG_NO_JOB.
    @name(".ingress_reasons")
    counter(AGG_COUNTER_ROWS * AGG_NUM_REASONS, CounterType.packets) reasons;

    UDPReceiver() udp_receiver;
    BitmapChecker() bitmap_checker;
    WorkersCounter() workers_counter;
    TreeLink() tree_link;
    SparseCheck() sparse_check;
    SparseCommit() sparse_commit;
    SparseResult() sparse_result;
    Exponents() exponents;
    Elements() elements;
    NextStepSelector() next_step_selector;
    Forwarder() forwarder;

    apply {
        md.kind = KIND_NONE;
        md.rewrite_ipv4 = 0;
        if (sm.instance_type == INSTANCE_TYPE_RECIRC) {
            // A later pass of a folded (256-element) packet: its first pass made every check
            // and ran the state machine (FOLD_FIELDS keep what it decided); this pass sums or
            // reads the next 64 elements.
            md.pass = md.pass + 1;
            elements.apply(hdr, md);
        } else {
            md.pass = 0;
            md.add = 0;
            md.read = 0;
            md.ingress_port = sm.ingress_port;
            udp_receiver.apply(hdr, md, sm.packet_length);
            if (md.accepted == 1 && md.job_sparse == 1) {
                // a contribution to a round in progress of another kind or block: refused
                // before it changes anything (docs/protocol.md 8.3 row 13)
                sparse_check.apply(hdr, md);
            }
            if (md.accepted == 1) {
                md.is_new = 0;
                if (md.from_parent == 0) {
                    bitmap_checker.apply(md); // the parent has no bit: its results are keyed
                }
                workers_counter.apply(md);
                if (md.job_sparse == 1) {
                    sparse_commit.apply(hdr, md);
                }
                if (md.tree == 1) {
                    tree_link.apply(hdr, md); // a rack job: up, down, or re-sent up
                }
                exponents.apply(hdr, md);
                elements.apply(hdr, md);
            }
        }
        if (md.ours == 1 && md.size_code == SML_SIZE_256 && (md.add == 1 || md.read == 1)
            && md.pass != SML_LAST_PASS) {
            // p4app-switchML's folded pipe: 64 elements a pass. Out through egress to be
            // recirculated (egress does not send it); counted once, in its last pass.
            sm.egress_spec = FOLD_PORT;
            md.kind = KIND_FOLD;
        } else {
            if (md.ours == 1) {
                if (md.sparse_pkt == 1) {
                    sparse_result.apply(hdr, md); // a sparse round's result
                }
                next_step_selector.apply(hdr, md, sm);
            } else {
                forwarder.apply(hdr, md, sm);
            }
            reasons.count((bit<32>)md.counter_row * AGG_NUM_REASONS + (bit<32>)md.reason);
        }
    }
}

control SmlEgress(inout headers_t hdr, inout sml_metadata_t md, inout standard_metadata_t sm) {
    // Result copies by (job, reason): EGRESS_SENT or EGRESS_NO_WORKER, same layout as ingress.
    @name(".egress_reasons")
    counter(AGG_COUNTER_ROWS * AGG_NUM_REASONS, CounterType.packets) reasons;

    UDPSender() udp_sender;

    apply {
        if (md.kind == KIND_RESULT) {
            udp_sender.apply(hdr, md, sm);
            reasons.count((bit<32>)md.counter_row * AGG_NUM_REASONS + (bit<32>)md.reason);
        } else if (md.kind == KIND_FLOOD && sm.egress_port == md.ingress_port) {
            mark_to_drop(sm);
        } else if (md.kind == KIND_FOLD) {
            recirculate_preserving_field_list(FOLD_FIELDS); // back to the parser, next pass
        }
    }
}

V1Switch(
    SmlParser(),
    SmlVerifyChecksum(),
    SmlIngress(),
    SmlEgress(),
    SmlComputeChecksum(),
    SmlDeparser()
) main;
