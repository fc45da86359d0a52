/* processor.p4: one payload element of a pass, summed in its own register array (as in
 * p4app-switchML: one Processor instance per element, see the generated elements.p4). */
#ifndef _XDP_AGG_PROCESSOR_P4_
#define _XDP_AGG_PROCESSOR_P4_

control Processor(inout bit<32> value, in sml_metadata_t md) {
    // Per (pass, slot, version): the running sum, at pass * POOL_ENTRIES + slot * 2 + version
    // (pass 0 unless the packet is folded). bit<32> addition wraps modulo 2^32, which is the
    // protocol's int32 sum; the packet's big-endian bytes are the field's value as is.
    register<bit<32>>(POOL_ENTRIES * SML_PASSES) acc;

    apply {
        bit<32> i = (bit<32>)md.pass * POOL_ENTRIES + md.pool_entry;
        if (md.add == 1) {
            // an empty sparse contribution adds zeros, whatever its padding holds
            bit<32> sum = md.zero == 1 ? 32w0 : value;
            if (md.first == 0) {
                bit<32> old;
                acc.read(old, i);
                sum = old + sum;
            }
            acc.write(i, sum);
            value = sum; // the packet leaves with the sum only if it completed the slot
        } else if (md.read == 1) {
            acc.read(value, i);
        }
    }
}

#endif
