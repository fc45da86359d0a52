/* switchml.p4 (TNA): the Tofino variant of p4/switchml.p4, same structure, file for file.
 *
 * Compiled by p4c's open Tofino back end (bf-p4c, p4c's backends/tofino) where it is installed
 * (tests/unit/test_p4_tna.py; p4/README.md has the result), but not run: there is no Tofino model
 * here. It is kept parallel to the v1model program, which is compiled and tested against the
 * packet table in bmv2; when changing one, change the other. Differences, forced by the
 * hardware:
 * - 64 elements a pass, in 32 register pairs (one stateful ALU each, as p4app-switchML's
 *   Processor), which read back one half a pass: a 64-element result takes a second pass, a
 *   256-element packet four consume passes and eight harvest passes through the pipe's
 *   recirculation port (next_step_selector.p4; p4app-switchML's folded pipe on one pipe);
 * - a pool of 4096 slots (the accumulators hold four quarters of each; configuration.p4);
 * - at most 32 workers per job (a worker bitmap of one version is one 32-bit half of a
 *   register pair, so that one stateful ALU updates both versions at once);
 * - the worker bit comes from the workers table (1 << index, written by the control plane)
 *   instead of a shift by a run-time amount;
 * - the workers counter counts down (p4app-switchML's encoding), which is the reference
 *   model's count/complete pair in one register;
 * - reason counters are indexed row * 32 + reason (no multiplication by AGG_NUM_REASONS);
 * - one table, `workers`, carries the job's parameters in each worker's entry (no `jobs`
 *   table): the control plane keeps them in step, and gives a worker whose job is gone or whose
 *   index is not below the job's worker count the action `stale_worker` (drop_no_job), which
 *   the v1model program finds with its jobs lookup and a comparison (udp_receiver.p4);
 * - tests a Tofino gateway cannot make (an if compares a field with a constant, or two fields
 *   for equality) are table keys or ALU work: the worker-bit test is the key of the counter's
 *   table (one ternary entry per worker), the slot range saturating subtractions in
 *   set_worker; the accumulators' choice (overwrite, add, read) is a table keyed on the
 *   counter's output and the pass, as p4app-switchML's `sum`; the lengths of the job's size code
 *   come with the worker's entry, compared as differences. This keeps the chain in front of
 *   the accumulators at three stages (worker; checks and bitmap; counter), so that the 34
 *   stateful ALUs of the accumulators and exponents (4 a stage) fit into the 9 stages Tofino
 *   has left; p4/README.md has bf-p4c's placement and resources;
 * - sparse jobs on Tofino 2 only (sparse_round.p4: TNA_SPARSE), with the round key's check in a
 *   stage of its own in front of the bitmap and the bitmap in the next.
 */
#include <core.p4>
#if __TARGET_TOFINO__ >= 2
#include <t2na.p4> // Tofino 2's externs: a RegisterAction returns up to four words
#else
#include <tna.p4>
#endif

#include "../include/abi.p4"
#include "configuration.p4"
#include "types.p4"
#include "headers.p4"
#include "parsers.p4"
#include "bitmap_checker.p4"
#include "udp_receiver.p4"
#include "workers_counter.p4"
#include "exponents.p4"
#include "sparse_round.p4"
#include "elements.p4"
#include "next_step_selector.p4"
#include "forwarder.p4"
#include "udp_sender.p4"

// Reason counters: index row * 32 + reason (a shift and an OR; a Tofino ALU does not multiply by
// AGG_NUM_REASONS as the bmv2 program's row * AGG_NUM_REASONS does). The control plane reads them
// so. Reasons 16-19 are rack jobs', which this variant has not, and 20-22 sparse jobs' (Tofino 2);
// drop_bad_width (23) makes the row 32 wide in both builds.
const bit<32> TNA_REASON_STRIDE = 32;
#define REASON_COLUMN(reason) reason[4:0]

control Ingress(inout header_t hdr, inout ingress_metadata_t ig_md,
                in ingress_intrinsic_metadata_t ig_intr_md,
                in ingress_intrinsic_metadata_from_parser_t ig_prsr_md,
                inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    Counter<bit<32>, bit<32>>(AGG_COUNTER_ROWS * TNA_REASON_STRIDE, CounterType_t.PACKETS) reasons;

    UDPReceiver() udp_receiver; // applies BitmapChecker to an accepted packet (not TNA_SPARSE)
    WorkersCounter() workers_counter;
    Exponents() exponents;
#ifdef TNA_SPARSE
    SparseRound() sparse_round;
    BitmapChecker() bitmap_checker;
    SparseState() sparse_state;
    SparseResult() sparse_result;
#endif
    Elements() elements;
    NextStepSelector() next_step_selector;
    Forwarder() forwarder;

    apply {
        if (!hdr.fold.isValid()) {
            // Here, not in the parser's first_pass state: a Tofino parser state writes constants
            // or bytes it extracts itself (ig_intr_md is extracted in start).
            ig_md.sml.ingress_port = ig_intr_md.ingress_port;
            udp_receiver.apply(hdr, ig_md.sml, ig_prsr_md);
#ifndef TNA_SPARSE
            if (ig_md.sml.accepted == 1) {
                workers_counter.apply(ig_md.sml);
            }
#endif
        } else if (hdr.fold.step[3:3] == 0 && !hdr.d1.isValid()) {
            // A later consume pass of a 256-element packet shorter than its UDP length says
            // (TNA's ingress has no frame length: its first pass could not tell; p4/README.md).
            ig_md.sml.accepted = 0;
            ig_md.sml.reason = AGG_DROP_TRUNCATED;
#ifdef TNA_SPARSE
        } else {
            // a close pass's round key: the other version's (sparse_round.p4)
            ig_md.sml.pool_entry = (pool_entry_t)(ig_md.sml.slot ++ ~ig_md.sml.version);
#endif
        }
#ifdef TNA_SPARSE
        // Row 13 before the bitmap: a packet of another round than the open one changes nothing.
        sparse_round.apply(ig_md.sml);
        if (ig_md.sml.rk == RK_OTHER) {
            ig_md.sml.accepted = 0;
            ig_md.sml.reason = AGG_DROP_SPARSE_MISMATCH;
        } else if (!hdr.fold.isValid() && ig_md.sml.accepted == 1) {
            bitmap_checker.apply(ig_md.sml);
            workers_counter.apply(ig_md.sml);
        }
        sparse_state.apply(hdr, ig_md.sml);
#endif
        // Not under `if (accepted == 1)`: their tables match on accepted (a gateway in front
        // of them put the first accumulators a stage later, the exponents into a 13th stage).
        exponents.apply(hdr, ig_md.sml);
        elements.apply(hdr, ig_md.sml);
#ifdef TNA_SPARSE
        sparse_result.apply(hdr, ig_md.sml); // after both: it writes e0 and the payload's validity
#endif
        if (ig_md.sml.ours == 1) {
            next_step_selector.apply(hdr, ig_md, ig_intr_md, ig_dprsr_md, ig_tm_md);
        } else {
            forwarder.apply(hdr, ig_md, ig_intr_md, ig_dprsr_md, ig_tm_md);
        }
        if (ig_md.sml.folds == 0) { // a packet is counted once, in its last pass
            reasons.count((bit<32>)(ig_md.sml.counter_row ++ REASON_COLUMN(ig_md.sml.reason)));
        }
    }
}

control Egress(inout header_t hdr, inout egress_metadata_t eg_md,
               in egress_intrinsic_metadata_t eg_intr_md,
               in egress_intrinsic_metadata_from_parser_t eg_prsr_md,
               inout egress_intrinsic_metadata_for_deparser_t eg_dprsr_md,
               inout egress_intrinsic_metadata_for_output_port_t eg_oport_md) {
    Counter<bit<32>, bit<32>>(AGG_COUNTER_ROWS * TNA_REASON_STRIDE, CounterType_t.PACKETS) reasons;

    UDPSender() udp_sender;

    apply {
        if (eg_md.bridged.kind == KIND_RESULT) {
            udp_sender.apply(hdr, eg_md, eg_intr_md, eg_dprsr_md);
            reasons.count((bit<32>)(eg_md.bridged.counter_row ++ REASON_COLUMN(eg_md.reason)));
        } else if (eg_md.bridged.kind == KIND_FLOOD
                   && eg_intr_md.egress_port == eg_md.bridged.ingress_port) {
            eg_dprsr_md.drop_ctl = 1;
        }
    }
}

Pipeline(IngressParser(), Ingress(), IngressDeparser(),
         EgressParser(), Egress(), EgressDeparser()) pipe;

Switch(pipe) main;
