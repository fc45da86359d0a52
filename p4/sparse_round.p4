/* sparse_round.p4: what a sparse job (docs/protocol.md section 8) adds to the state machine: per
 * (slot, version) the round's kind and block, the smallest next and its exponent, and whether
 * any contribution carried data; the checks against them (row 13 of section 8.3) and the result
 * written from them. The reference is xdp_agg/proto/model.py (_sparse, _sparse_check,
 * _sparse_result); the XDP program's is bpf/sparse.h.
 *
 * A contribution to a round in progress, or a duplicate, must be of that round's kind, block and
 * tensor size, else it is dropped as drop_sparse_mismatch having changed nothing. The round's
 * open flag (set by its first contribution, cleared by its last) lets SparseCheck refuse a new
 * contribution before BitmapChecker marks its worker seen; a duplicate changes no state, so it
 * is refused in SparseCommit, once BitmapChecker has told it apart (and before a stored sum is
 * read into it). SparseCommit also updates the round for a new contribution, and makes an empty
 * one's payload headers valid: the Processors add zeros (md.zero), or read a stored sum into
 * them. SparseResult, for a completion or an answered retransmission of a sparse round (in the
 * last pass of a folded packet), writes the result's kind, sparse header, e0, payload and
 * lengths. Of these registers only the open flags need clearing when a job is created (the
 * control plane does it with seen and count): a round's first contribution writes the rest. */
#ifndef _XDP_AGG_SPARSE_ROUND_P4_
#define _XDP_AGG_SPARSE_ROUND_P4_

// A round's key: its kind (ROUND_DENSE, ROUND_SPARSE), then block and blocks (0 when dense).
typedef bit<72> round_key_t;
const bit<8> ROUND_DENSE = 1;
const bit<8> ROUND_SPARSE = 2;

// The registers, per (slot, version), at top level: three controls share them, each applied
// once per pass (a control applied more than once makes p4c copy the metadata struct, which
// bmv2 cannot load with recirculate's field list).
// the key of the round in the registers (set by its first contribution, dense or sparse)
register<round_key_t>(POOL_ENTRIES) slot_round_key;
// a round is in progress (some contributions counted, not all)
register<bit<1>>(POOL_ENTRIES) slot_round_open;
// the smallest next of the round's sparse contributions so far
register<bit<32>>(POOL_ENTRIES) slot_next;
// the maximum e0 of the contributions that named that next (8.4)
register<bit<8>>(POOL_ENTRIES) slot_next_e0;
// some contribution carried data (the result is msg_type 2, else 3)
register<bit<1>>(POOL_ENTRIES) slot_has_data;

// This packet's round key.
control RoundKey(in headers_t hdr, in sml_metadata_t md, out round_key_t key) {
    apply {
        key = ROUND_DENSE ++ 32w0 ++ 32w0;
        if (md.sparse_pkt == 1) {
            key = ROUND_SPARSE ++ hdr.sparse.block ++ hdr.sparse.blocks;
        }
    }
}

// The payload headers of the job's size made valid; valid ones keep what they hold (a padded
// empty packet's bytes, which md.zero keeps out of the sums).
control PayloadValid(inout headers_t hdr, in sml_metadata_t md) {
    apply {
        hdr.d0.setValid();
        if (md.size_code != SML_SIZE_32) {
            hdr.d1.setValid();
        }
        if (md.size_code == SML_SIZE_256) {
            hdr.d2.setValid();
            hdr.d3.setValid();
            hdr.d4.setValid();
            hdr.d5.setValid();
            hdr.d6.setValid();
            hdr.d7.setValid();
        }
    }
}

// Before the state machine: a new contribution to an open round of another kind or block is
// refused (a duplicate is SparseCommit's to refuse: it changes nothing on its way).
control SparseCheck(in headers_t hdr, inout sml_metadata_t md) {
    RoundKey() round_key;

    apply {
        round_key_t key;
        round_key.apply(hdr, md, key);
        round_key_t have;
        bit<1> open;
        slot_round_key.read(have, md.pool_entry);
        slot_round_open.read(open, md.pool_entry);
        if (open == 1 && have != key) {
            md.reason = AGG_DROP_SPARSE_MISMATCH;
            md.accepted = 0;
        }
    }
}

// After the counter: the round's state moved for a new contribution, a duplicate of another
// round refused, and an empty packet given payload headers (zeros to add, or room for a
// stored sum to be read into).
control SparseCommit(inout headers_t hdr, inout sml_metadata_t md) {
    RoundKey() round_key;
    PayloadValid() payload_valid;

    apply {
        round_key_t key;
        round_key.apply(hdr, md, key);
        round_key_t have;
        slot_round_key.read(have, md.pool_entry);
        if (md.add == 1) {
            if (md.first == 1) {
                slot_round_key.write(md.pool_entry, key);
            }
            slot_round_open.write(md.pool_entry, md.reason == AGG_AGGREGATED ? 1w1 : 1w0);
        } else if (md.is_new == 0 && have != key) {
            // a duplicate of another round's kind or block: never its sum
            md.reason = AGG_DROP_SPARSE_MISMATCH;
            md.read = 0;
        }
        if (md.sparse_pkt == 1 && md.add == 1) {
            // the smallest next so far with its exponent (8.4), and whether any had data
            bit<32> nm = hdr.sparse.next;
            bit<8> e = hdr.exponents.e0;
            bit<1> any = ~md.zero;
            if (md.first == 0) {
                bit<32> old_next;
                bit<8> old_e0;
                bit<1> old_data;
                slot_next.read(old_next, md.pool_entry);
                slot_next_e0.read(old_e0, md.pool_entry);
                slot_has_data.read(old_data, md.pool_entry);
                any = any | old_data;
                if (old_next < nm) {
                    nm = old_next;
                    e = old_e0;
                } else if (old_next == nm && (int<8>)old_e0 > (int<8>)e) {
                    e = old_e0;
                }
            }
            slot_next.write(md.pool_entry, nm);
            slot_next_e0.write(md.pool_entry, e);
            slot_has_data.write(md.pool_entry, any);
        }
        if (md.sparse_pkt == 1 && md.zero == 1 && (md.add == 1 || md.read == 1)) {
            payload_valid.apply(hdr, md);
        }
    }
}

// A sparse round's completion or answered retransmission (in the last pass of a folded
// packet): the result written from the stored state, whatever the request carried.
control SparseResult(inout headers_t hdr, in sml_metadata_t md) {
    PayloadValid() payload_valid;

    apply {
        if (md.reason == AGG_COMPLETED || md.reason == AGG_RETX_ANSWERED) {
            bit<1> data;
            slot_has_data.read(data, md.pool_entry);
            slot_next.read(hdr.sparse.next, md.pool_entry);
            slot_next_e0.read(hdr.exponents.e0, md.pool_entry);
            bit<16> udp_len = SML_UDP_LEN_SPARSE_EMPTY;
            if (data == 1) {
                hdr.switchml.msg_type = SML_MSG_TYPE_SPARSE;
                payload_valid.apply(hdr, md);
                udp_len = SML_SPARSE_HLEN + SML_UDP_LEN_32;
                if (md.size_code == SML_SIZE_64) {
                    udp_len = SML_SPARSE_HLEN + SML_UDP_LEN_64;
                } else if (md.size_code == SML_SIZE_256) {
                    udp_len = SML_SPARSE_HLEN + SML_UDP_LEN_256;
                }
            } else {
                hdr.switchml.msg_type = SML_MSG_TYPE_SPARSE_EMPTY;
                hdr.d0.setInvalid();
                hdr.d1.setInvalid();
                hdr.d2.setInvalid();
                hdr.d3.setInvalid();
                hdr.d4.setInvalid();
                hdr.d5.setInvalid();
                hdr.d6.setInvalid();
                hdr.d7.setInvalid();
            }
            hdr.udp.length = udp_len;
            hdr.ipv4.total_len = SML_IPV4_HLEN + udp_len;
        }
    }
}

#endif
