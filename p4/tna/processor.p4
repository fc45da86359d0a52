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

    apply {
        if (md.add == 1 && md.first == 1) {
            value = write.execute(md.pool_entry);
        } else if (md.add == 1) {
            value = add.execute(md.pool_entry);
        } else if (md.read == 1) {
            value = read.execute(md.pool_entry);
        }
    }
}

#endif
