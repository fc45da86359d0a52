/* bitmap_checker.p4: is this a new contribution of its worker for (slot, version)? */
#ifndef _XDP_AGG_BITMAP_CHECKER_P4_
#define _XDP_AGG_BITMAP_CHECKER_P4_

control BitmapChecker(inout sml_metadata_t md) {
    // Per (slot, version): the workers seen in the current round. The control plane clears a
    // job's entries when it creates the job.
    @name(".slot_seen")
    register<worker_bitmap_t>(POOL_ENTRIES) seen;

    apply {
        worker_bitmap_t mine;
        worker_bitmap_t other;
        worker_bitmap_t mask = (worker_bitmap_t)1 << md.worker_id;
        seen.read(mine, md.pool_entry);
        if ((mine & mask) == 0) {
            md.is_new = 1;
            seen.write(md.pool_entry, mine | mask);
            // The worker has moved on from the other version: its next contribution there
            // starts a new round rather than looking like a retransmission.
            seen.read(other, md.other_entry);
            seen.write(md.other_entry, other & ~mask);
        } else {
            md.is_new = 0;
        }
    }
}

#endif
