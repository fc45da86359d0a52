/* processor.p4 (TNA): one payload element in its own register (one stateful ALU). */
#ifndef _XDP_AGG_TNA_PROCESSOR_P4_
#define _XDP_AGG_TNA_PROCESSOR_P4_

control Processor(inout bit<32> value, in switchml_md_t md) {
    Register<bit<32>, pool_entry_t>(POOL_ENTRIES) acc;

    // First contribution of a round: overwrite (no separate reset).
    RegisterAction<bit<32>, pool_entry_t, bit<32>>(acc) write = {
        void apply(inout bit<32> stored, out bit<32> result) {
            stored = value;
            result = stored;
        }
    };

    // Later contributions: add (wraps modulo 2^32) and return the running sum.
    RegisterAction<bit<32>, pool_entry_t, bit<32>>(acc) add = {
        void apply(inout bit<32> stored, out bit<32> result) {
            stored = stored + value;
            result = stored;
        }
    };

    // A retransmission for a completed slot: the stored result.
    RegisterAction<bit<32>, pool_entry_t, bit<32>>(acc) read = {
        void apply(inout bit<32> stored, out bit<32> result) {
            result = stored;
        }
    };

    action write_action() {
        value = write.execute(md.pool_entry);
    }

    action add_action() {
        value = add.execute(md.pool_entry);
    }

    action read_action() {
        value = read.execute(md.pool_entry);
    }

    // Keyed on the counter's outputs directly (not on flags computed from them, which would
    // take a stage): p4app-switchML's table `sum`, the same way (b5c74a0,
    // dev_root/p4/processor.p4 lines 82-127).
    table sum {
        key = {
            md.is_new: exact;
            md.count_before: ternary;
        }
        actions = {
            write_action;
            add_action;
            read_action;
            @defaultonly NoAction;
        }
        const entries = {
            (1, 0): write_action(); // a new round's first contribution
            (1, _): add_action();
            (0, 0): read_action(); // a retransmission for a completed slot
        }
        const default_action = NoAction(); // a retransmission for a pending slot
        size = 3;
    }

    apply {
        sum.apply();
    }
}

#endif
