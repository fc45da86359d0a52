/* bitmap_checker.p4 (TNA): both versions' worker bitmaps of a slot in one register pair, so one
 * stateful ALU sets the worker's bit in this version and clears it in the other atomically (as
 * p4app-switchML's UpdateAndCheckWorkerBitmap, b5c74a0 dev_root/p4/bitmap_checker.p4
 * lines 75-98). */
#ifndef _XDP_AGG_TNA_BITMAP_CHECKER_P4_
#define _XDP_AGG_TNA_BITMAP_CHECKER_P4_

control BitmapChecker(inout switchml_md_t md) {
    Register<worker_bitmap_pair_t, pool_slot_t>(POOL_SLOTS) seen;

    RegisterAction<worker_bitmap_pair_t, pool_slot_t, worker_bitmap_t>(seen) update_v0 = {
        void apply(inout worker_bitmap_pair_t value, out worker_bitmap_t before) {
            before = value.first;
            value.first = value.first | md.worker_bit;
            value.second = value.second & ~md.worker_bit;
        }
    };

    RegisterAction<worker_bitmap_pair_t, pool_slot_t, worker_bitmap_t>(seen) update_v1 = {
        void apply(inout worker_bitmap_pair_t value, out worker_bitmap_t before) {
            before = value.second;
            value.first = value.first & ~md.worker_bit;
            value.second = value.second | md.worker_bit;
        }
    };

    // Whether the worker's bit was set is not tested here (an AND of two run-time fields, then
    // a compare, would take a stage): WorkersCounter matches bitmap_before in its table key.
    apply {
        if (md.version == 0) {
            md.bitmap_before = update_v0.execute(md.slot);
        } else {
            md.bitmap_before = update_v1.execute(md.slot);
        }
    }
}

#endif
