/* exponents.p4 (TNA): signed maximum of e0 and e1 per (slot, version), one register each (a
 * register action returns one value, and a completing packet needs both). */
#ifndef _XDP_AGG_TNA_EXPONENTS_P4_
#define _XDP_AGG_TNA_EXPONENTS_P4_

control ExponentMax(inout bit<8> e, in switchml_md_t md) {
    Register<int<8>, pool_entry_t>(POOL_ENTRIES) stored;

    RegisterAction<int<8>, pool_entry_t, int<8>>(stored) write = {
        void apply(inout int<8> value, out int<8> result) {
            value = (int<8>)e;
            result = value;
        }
    };

    RegisterAction<int<8>, pool_entry_t, int<8>>(stored) max_of = {
        void apply(inout int<8> value, out int<8> result) {
            value = max(value, (int<8>)e);
            result = value;
        }
    };

    RegisterAction<int<8>, pool_entry_t, int<8>>(stored) read = {
        void apply(inout int<8> value, out int<8> result) {
            result = value;
        }
    };

    action write_action() {
        e = (bit<8>)write.execute(md.pool_entry);
    }

    action max_action() {
        e = (bit<8>)max_of.execute(md.pool_entry);
    }

    action read_action() {
        e = (bit<8>)read.execute(md.pool_entry);
    }

    // As Processor's table `sum` (processor.p4), in a packet's first pass only: later passes
    // carry the exponents the first one wrote.
    table exponent_max {
        key = {
            md.accepted: exact;
            md.step: exact;
            md.is_new: exact;
            md.count_before: ternary;
        }
        actions = {
            write_action;
            max_action;
            read_action;
            @defaultonly NoAction;
        }
        const entries = {
            (1, STEP_CONSUME0, 1, 0): write_action();
            (1, STEP_CONSUME0, 1, _): max_action();
            (1, STEP_CONSUME0, 0, 0): read_action();
        }
        const default_action = NoAction();
        size = 3;
    }

    apply {
        exponent_max.apply();
    }
}

control Exponents(inout header_t hdr, in switchml_md_t md) {
    ExponentMax() e0;
    ExponentMax() e1;

    apply {
        e0.apply(hdr.exponents.e0, md);
        e1.apply(hdr.exponents.e1, md);
    }
}

#endif
