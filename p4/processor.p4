/* processor.p4: one payload element, summed in its own register array (as in p4app-switchML:
 * one Processor instance per element, see the generated elements.p4). */
#ifndef _XDP_AGG_PROCESSOR_P4_
#define _XDP_AGG_PROCESSOR_P4_

control Processor(inout bit<32> value, in sml_metadata_t md) {
    // Per (slot, version): the running sum. bit<32> addition wraps modulo 2^32, which is the
    // protocol's int32 sum; the packet's big-endian bytes are the field's value as is.
    register<bit<32>>(POOL_ENTRIES) acc;

    apply {
        if (md.add == 1) {
            bit<32> sum = value;
            if (md.first == 0) {
                bit<32> old;
                acc.read(old, md.pool_entry);
                sum = old + value;
            }
            acc.write(md.pool_entry, sum);
            value = sum; // the packet leaves with the sum only if it completed the slot
        } else if (md.read == 1) {
            acc.read(value, md.pool_entry);
        }
    }
}

#endif
