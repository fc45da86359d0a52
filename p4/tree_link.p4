/* tree_link.p4: what a rack job of a two-level tree adds to the state machine (docs/protocol.md
 * section 3.7; the XDP program's tree code is in bpf/aggregate.h): per (slot, version) the key
 * of the round sent up and whether the parent's result is stored. */
#ifndef _XDP_AGG_TREE_LINK_P4_
#define _XDP_AGG_TREE_LINK_P4_

control TreeLink(in headers_t hdr, inout sml_metadata_t md) {
    // Per (slot, version): the (job_number, tsi) of the partial sum sent up, which the parent's
    // result echoes; it tells the parent's result of this round from a late answer to a re-send
    // of an older one.
    @name(".slot_up_key")
    register<bit<40>>(POOL_ENTRIES) up_key;
    // Per (slot, version): the parent's result of the round is stored (then retransmissions are
    // answered from it; before, they send the partial up again). Written at every local
    // completion, so it needs no clearing when a job is created.
    @name(".slot_parent_done")
    register<bit<1>>(POOL_ENTRIES) parent_done;

    apply {
        bit<40> key = hdr.switchml.job_number ++ hdr.switchml.tsi;
        bit<1> done;
        parent_done.read(done, md.pool_entry);
        if (md.from_parent == 1) {
            bit<40> want;
            up_key.read(want, md.pool_entry);
            if (md.complete == 1 && done == 0 && key == want) {
                // Taken: the parent's sum and exponents overwrite the partial (a round's first
                // contribution's write, in every pass), and go to every worker of the job.
                parent_done.write(md.pool_entry, 1);
                md.add = 1;
                md.first = 1;
                md.reason = AGG_PARENT_RESULT;
            } else {
                // A copy already taken, the other version, an old round, or a round not
                // complete here. simple_switch's ingress is serial, so of two copies one wins.
                md.reason = AGG_STALE_PARENT_RESULT;
            }
        } else if (md.reason == AGG_COMPLETED) {
            // Complete here: not a result yet but our contribution to the parent's round.
            up_key.write(md.pool_entry, key);
            parent_done.write(md.pool_entry, 0);
            md.reason = AGG_FORWARDED_UP;
        } else if (md.reason == AGG_RETX_ANSWERED && done == 0) {
            // The parent has not answered: the partial (or the parent's answer) was lost, and
            // the workers' retransmissions are the only timer there is.
            md.reason = AGG_RESENT_UP;
        }
    }
}

#endif
