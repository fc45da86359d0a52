/* workers_counter.p4 (TNA): contributions still missing in the round of (slot, version).
 *
 * Counts down as p4app-switchML does: 0 means "fresh or complete", either way the next new
 * contribution starts a round (overwrites) and sets n - 1; the one that finds 1 completes it
 * (or the one that finds 0 when n = 1). This is the reference model's (count, complete) pair:
 * count == 0 or count == n <=> remaining == 0. */
#ifndef _XDP_AGG_TNA_WORKERS_COUNTER_P4_
#define _XDP_AGG_TNA_WORKERS_COUNTER_P4_

control WorkersCounter(inout switchml_md_t md) {
    Register<bit<8>, pool_entry_t>(POOL_ENTRIES) remaining;

    RegisterAction<bit<8>, pool_entry_t, bit<8>>(remaining) count_new = {
        void apply(inout bit<8> value, out bit<8> before) {
            before = value;
            if (value == 0) {
                value = md.num_workers - 1;
            } else {
                value = value - 1;
            }
        }
    };

    RegisterAction<bit<8>, pool_entry_t, bit<8>>(remaining) read = {
        void apply(inout bit<8> value, out bit<8> before) {
            before = value;
        }
    };

    action count_contribution() {
        md.is_new = 1;
        md.count_before = count_new.execute(md.pool_entry);
    }

    action count_retransmission() {
        md.is_new = 0;
        md.count_before = read.execute(md.pool_entry);
    }

    // New contribution or retransmission: is the worker's bit set in bitmap_before? A table
    // key (the bitmap ternary, one entry per worker index) instead of an AND and a compare,
    // which would take a stage of their own; p4app-switchML keys its count_workers table on
    // its bitmap test the same way (b5c74a0, dev_root/p4/workers_counter.p4 lines 71-111).
    table count {
        key = {
            md.worker_id: ternary;
            md.bitmap_before: ternary;
        }
        actions = {
            count_contribution;
            count_retransmission;
            @defaultonly NoAction;
        }
        const entries = {
#include "worker_seen_entries.p4"
            // Last (lowest priority): every other packet is a new contribution. An entry, not
            // the default action: a default action cannot use the hash unit that computes
            // the register index (bf-p4c: "requires the hash distribution unit").
            (_, _): count_contribution();
        }
        const default_action = NoAction();
        size = TNA_MAX_WORKERS + 1;
    }

    apply {
        count.apply();
        if (md.is_new == 1) {
            if (md.count_before == 1 || (md.count_before == 0 && md.num_workers == 1)) {
                md.reason = AGG_COMPLETED;
            } else {
                md.reason = AGG_AGGREGATED;
            }
        } else if (md.count_before == 0) {
            md.reason = AGG_RETX_ANSWERED;
        } else {
            md.reason = AGG_DUP_PENDING;
        }
    }
}

#endif
