/* processor.p4 (TNA): element i of both payload headers of a pass in one register pair (one
 * stateful ALU), as p4app-switchML's Processor (b5c74a0, dev_root/p4/processor.p4 lines 24-130):
 * both halves summed at once, one half read back (a stateful ALU returns 32 bits). */
#ifndef _XDP_AGG_TNA_PROCESSOR_P4_
#define _XDP_AGG_TNA_PROCESSOR_P4_

struct value_pair_t {
    bit<32> first; // element i of d0
    bit<32> second; // element i of d1
}

control Processor(inout bit<32> value0, inout bit<32> value1, in switchml_md_t md) {
    // Per (quarter, version, slot); bit<32> addition wraps modulo 2^32, the protocol's int32 sum.
    Register<value_pair_t, acc_index_t>(ACC_ENTRIES) acc;

    // First contribution of a round: overwrite (no separate reset), read d1's sum.
    RegisterAction<value_pair_t, acc_index_t, bit<32>>(acc) write_read1 = {
        void apply(inout value_pair_t stored, out bit<32> result) {
            stored.first = value0;
            stored.second = value1;
            result = stored.second;
        }
    };

    // Later contributions: add both, read d1's running sum.
    RegisterAction<value_pair_t, acc_index_t, bit<32>>(acc) sum_read1 = {
        void apply(inout value_pair_t stored, out bit<32> result) {
            stored.first = stored.first + value0;
            stored.second = stored.second + value1;
            result = stored.second;
        }
    };

    RegisterAction<value_pair_t, acc_index_t, bit<32>>(acc) read0 = {
        void apply(inout value_pair_t stored, out bit<32> result) {
            result = stored.first;
        }
    };

    RegisterAction<value_pair_t, acc_index_t, bit<32>>(acc) read1 = {
        void apply(inout value_pair_t stored, out bit<32> result) {
            result = stored.second;
        }
    };

    // The index as the hash unit's identity over the three fields (no stage to concatenate).
    action write_read1_action() {
        value1 = write_read1.execute(md.quarter ++ md.version ++ md.slot[POOL_SLOT_BITS - 1:0]);
    }

    action sum_read1_action() {
        value1 = sum_read1.execute(md.quarter ++ md.version ++ md.slot[POOL_SLOT_BITS - 1:0]);
    }

    action read0_action() {
        value0 = read0.execute(md.quarter ++ md.version ++ md.slot[POOL_SLOT_BITS - 1:0]);
    }

    action read1_action() {
        value1 = read1.execute(md.quarter ++ md.version ++ md.slot[POOL_SLOT_BITS - 1:0]);
    }

    // Keyed on the counter's outputs and the pass directly (not on flags computed from them,
    // which would take a stage): p4app-switchML's table `sum` (lines 82-127 there).
    table sum {
        key = {
            md.accepted: exact;
            md.step: ternary;
            md.is_new: ternary;
            md.count_before: ternary;
        }
        actions = {
            write_read1_action;
            sum_read1_action;
            read0_action;
            read1_action;
            @defaultonly NoAction;
        }
        const entries = {
            (1, 0 &&& 8, 1, 0): write_read1_action(); // consume: a new round's first contribution
            (1, 0 &&& 8, 1, _): sum_read1_action();
            (1, 0 &&& 8, 0, 0): read1_action(); // consume: a retransmission for a completed slot
            (1, 8 &&& 9, _, _): read1_action(); // harvest, h even: d1's half
            (1, 9 &&& 9, _, _): read0_action(); // harvest, h odd: d0's half
        }
        const default_action = NoAction(); // not accepted, or a retransmission for a pending slot
        size = 5;
    }

    apply {
        sum.apply();
    }
}

#endif
