/* workers_counter.p4: contributions in the current round of (slot, version); completion. */
#ifndef _XDP_AGG_WORKERS_COUNTER_P4_
#define _XDP_AGG_WORKERS_COUNTER_P4_

control WorkersCounter(inout sml_metadata_t md) {
    // Per (slot, version): contributions so far in the round, 0..n. n means complete: the
    // stored sum is the result, retransmissions get it back, and the next new contribution
    // starts a new round (the reference model's count / complete pair in one number).
    @name(".slot_count")
    register<bit<8>>(POOL_ENTRIES) count;

    apply {
        bit<8> c;
        count.read(c, md.pool_entry);
        md.add = 0;
        md.read = 0;
        md.first = 0;
        md.complete = 0;
        if (md.from_parent == 1) {
            // The parent's result counts no contribution: TreeLink takes it only when this
            // round is complete here.
            if (c == md.num_workers) {
                md.complete = 1;
            }
        } else if (md.is_new == 1) {
            md.add = 1;
            if (c == 0 || c == md.num_workers) {
                md.first = 1; // overwrite the accumulators: no separate reset
                c = 1;
            } else {
                c = c + 1;
            }
            count.write(md.pool_entry, c);
            md.reason = (c == md.num_workers) ? AGG_COMPLETED : AGG_AGGREGATED;
        } else if (c == md.num_workers) {
            md.read = 1;
            md.reason = AGG_RETX_ANSWERED;
        } else {
            md.reason = AGG_DUP_PENDING;
        }
    }
}

#endif
