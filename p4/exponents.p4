/* exponents.p4: the maximum of e0 and e1 (signed) over the workers of (slot, version). */
#ifndef _XDP_AGG_EXPONENTS_P4_
#define _XDP_AGG_EXPONENTS_P4_

control ExponentMax(inout bit<8> e, in sml_metadata_t md) {
    register<bit<8>>(POOL_ENTRIES) stored;

    apply {
        if (md.add == 1) {
            bit<8> m = e;
            if (md.first == 0) {
                bit<8> old;
                stored.read(old, md.pool_entry);
                if ((int<8>)old > (int<8>)e) {
                    m = old;
                }
            }
            stored.write(md.pool_entry, m);
            e = m; // what a completing packet carries
        } else if (md.read == 1) {
            stored.read(e, md.pool_entry);
        }
    }
}

control Exponents(inout headers_t hdr, in sml_metadata_t md) {
    ExponentMax() e0;
    ExponentMax() e1;

    apply {
        e0.apply(hdr.exponents.e0, md);
        e1.apply(hdr.exponents.e1, md);
    }
}

#endif
