/* parsers.p4 (TNA): parsers and deparsers of the Tofino variant. */
#ifndef _XDP_AGG_TNA_PARSERS_P4_
#define _XDP_AGG_TNA_PARSERS_P4_

/* As the v1model parser: Ethernet, IPv4, UDP, and for UDP to 0xBEE0..0xBEEF our headers and the
 * payload header. A packet too short for them ends with a parser error that UDPReceiver reads
 * (reading ig_prsr_md.parser_err is what keeps Tofino from dropping it unseen); the headers
 * extracted before the error stay valid, which tells the two truncation cases apart. IPv4
 * options are skipped word by word (a Tofino parser advances by constants) so that a packet of
 * ours with options is recognised and dropped as malformed. */
parser IngressParser(packet_in pkt, out header_t hdr, out ingress_metadata_t ig_md,
                     out ingress_intrinsic_metadata_t ig_intr_md) {
    state start {
        pkt.extract(ig_intr_md);
        pkt.advance(PORT_METADATA_SIZE);
        ig_md.update_ipv4_checksum = false;
        ig_md.sml.folds = 0;
#ifdef TNA_SPARSE
        // sparse_round.p4's defaults: a dense job's packet (a later pass: parse_fold says)
        ig_md.sml.sparse_job = 0;
        ig_md.sml.sparse = 0;
        ig_md.sml.empty = 0;
        ig_md.sml.rk = RK_NONE;
#endif
        transition select(ig_intr_md.ingress_port[6:0]) {
            RECIRC_PORT_IN_PIPE: parse_fold; // a later pass of a packet of ours
            default: first_pass;
        }
    }

    state first_pass {
        // UDPReceiver's defaults, set here rather than in its first stage: there the workers
        // table writes reason and counter_row too, and the two writes would take two stages.
        ig_md.sml.ours = 0;
        ig_md.sml.accepted = 0;
        ig_md.sml.reason = AGG_PASS;
        ig_md.sml.counter_row = AGG_NO_JOB;
        ig_md.sml.step = STEP_CONSUME0;
        ig_md.sml.quarter = 0;
        transition parse_ethernet;
    }

    // What the first pass decided (it made every check: the headers are as it parsed them, with
    // no IPv4 options), then the pass's payload: the next 64 elements of a consume pass, the
    // 64 a 64-element packet carries in its harvest pass, none in a 256-element harvest (the
    // elements read so far stay behind as payload; this pass puts 32 more in front).
    state parse_fold {
        pkt.extract(hdr.fold);
        ig_md.sml.ours = 1;
        ig_md.sml.accepted = 1;
        ig_md.sml.step = hdr.fold.step;
        ig_md.sml.quarter = hdr.fold.quarter;
        ig_md.sml.is_new = hdr.fold.is_new;
        ig_md.sml.count_before = hdr.fold.count_before;
        ig_md.sml.reason = hdr.fold.reason;
        ig_md.sml.counter_row = hdr.fold.counter_row;
        ig_md.sml.job_id = hdr.fold.job_id;
        ig_md.sml.ingress_port = hdr.fold.ingress_port;
        ig_md.sml.mgid = hdr.fold.mgid;
#ifdef TNA_SPARSE
        ig_md.sml.sparse_job = hdr.fold.sparse_job;
#endif
        pkt.extract(hdr.ethernet);
        pkt.extract(hdr.ipv4);
        pkt.extract(hdr.udp);
        transition parse_fold_switchml;
    }

    state parse_fold_switchml {
        pkt.extract(hdr.switchml);
        ig_md.sml.slot = hdr.switchml.pool_index[14:0];
        ig_md.sml.version = hdr.switchml.pool_index[15:15];
        pkt.extract(hdr.exponents);
#ifdef TNA_SPARSE
        transition select(hdr.switchml.msg_type) {
            SML_MSG_TYPE_SPARSE: parse_fold_sparse; // a sparse result with data
            SML_MSG_TYPE_SPARSE_EMPTY: parse_fold_sparse_empty; // one without: no payload
            default: parse_fold_payload;
        }
    }

    state parse_fold_sparse {
        pkt.extract(hdr.sparse);
        transition parse_fold_payload;
    }

    state parse_fold_sparse_empty {
        pkt.extract(hdr.sparse);
        transition accept;
    }

    state parse_fold_payload {
#endif
        transition select(hdr.fold.step[3:3], hdr.switchml.size) {
            (1w1, SML_SIZE_256): accept;
            (_, SML_SIZE_32): parse_d1; // a sparse round's close pass (sparse_round.p4)
            default: parse_d0;
        }
    }

    state parse_ethernet {
        pkt.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }

    state parse_ipv4 {
        pkt.extract(hdr.ipv4);
        // Only a first (or whole) datagram has a UDP header: later fragments are not ours.
        transition select(hdr.ipv4.protocol, hdr.ipv4.ihl, hdr.ipv4.frag_offset) {
            (IP_PROTO_UDP, 4w5, 13w0): parse_udp;
            (IP_PROTO_UDP, 4w6, 13w0): skip_options_1;
            (IP_PROTO_UDP, 4w7, 13w0): skip_options_2;
            (IP_PROTO_UDP, 4w8, 13w0): skip_options_3;
            (IP_PROTO_UDP, 4w9, 13w0): skip_options_4;
            (IP_PROTO_UDP, 4w10, 13w0): skip_options_5;
            (IP_PROTO_UDP, 4w11, 13w0): skip_options_6;
            (IP_PROTO_UDP, 4w12, 13w0): skip_options_7;
            (IP_PROTO_UDP, 4w13, 13w0): skip_options_8;
            (IP_PROTO_UDP, 4w14, 13w0): skip_options_9;
            (IP_PROTO_UDP, 4w15, 13w0): skip_options_10;
            default: accept;
        }
    }

    state skip_options_10 { pkt.advance(32); transition skip_options_9; }
    state skip_options_9 { pkt.advance(32); transition skip_options_8; }
    state skip_options_8 { pkt.advance(32); transition skip_options_7; }
    state skip_options_7 { pkt.advance(32); transition skip_options_6; }
    state skip_options_6 { pkt.advance(32); transition skip_options_5; }
    state skip_options_5 { pkt.advance(32); transition skip_options_4; }
    state skip_options_4 { pkt.advance(32); transition skip_options_3; }
    state skip_options_3 { pkt.advance(32); transition skip_options_2; }
    state skip_options_2 { pkt.advance(32); transition skip_options_1; }
    state skip_options_1 { pkt.advance(32); transition parse_udp; }

    state parse_udp {
        pkt.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            SML_UDP_PORT &&& SML_UDP_PORT_MASK: parse_switchml;
            default: accept;
        }
    }

    // p4app-switchML's order (b5c74a0, dev_root/p4/parsers.p4 lines 187-195): the SwitchML
    // header, the exponent header, then the payload; a sparse packet (msg_type 2 or 3,
    // docs/protocol.md section 8.1; Tofino 2 only) has its sparse header in between.
    state parse_switchml {
        pkt.extract(hdr.switchml);
        // The slot and version for set_worker's range check in stage 0 (an action there
        // cannot use a field that another action of the same stage computes).
        ig_md.sml.slot = hdr.switchml.pool_index[14:0];
        ig_md.sml.version = hdr.switchml.pool_index[15:15];
        pkt.extract(hdr.exponents);
#ifdef TNA_SPARSE
        ig_md.sml.key_lo = DENSE_KEY; // a dense packet's round key (sparse_round.p4)
        ig_md.sml.key_hi = DENSE_KEY;
        transition select(hdr.switchml.msg_type) {
            SML_MSG_TYPE_SPARSE: parse_sparse;
            SML_MSG_TYPE_SPARSE_EMPTY: parse_sparse_empty;
            default: parse_payload;
        }
    }

    // The round key copied from the sparse header (a parser state writes what it extracts).
    state parse_sparse {
        pkt.extract(hdr.sparse);
        ig_md.sml.key_lo = hdr.sparse.block;
        ig_md.sml.key_hi = hdr.sparse.blocks;
        transition parse_payload;
    }

    // An empty packet has no payload (its UDP length says: the parser does not run past the
    // frame, which would be a parser error) or padding, parsed as a data packet's payload.
    state parse_sparse_empty {
        pkt.extract(hdr.sparse);
        ig_md.sml.key_lo = hdr.sparse.block;
        ig_md.sml.key_hi = hdr.sparse.blocks;
        ig_md.sml.empty = 1;
        transition select(hdr.udp.length) {
            SML_UDP_LEN_SPARSE_EMPTY: accept;
            default: parse_payload;
        }
    }

    state parse_payload {
#endif
        transition select(hdr.switchml.size) {
            SML_SIZE_32: parse_d1; // in d1: a pass sums d1 and reads d1 back
            SML_SIZE_64: parse_d0;
            SML_SIZE_256: parse_d0; // its first 64; the rest stays payload for the next passes
            default: accept; // not aggregated by this variant: dropped as a bad size
        }
    }

    state parse_d0 {
        pkt.extract(hdr.d0);
        transition parse_d1;
    }

    state parse_d1 {
        pkt.extract(hdr.d1);
        transition accept;
    }
}

control IngressDeparser(packet_out pkt, inout header_t hdr, in ingress_metadata_t ig_md,
                        in ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {
    Checksum() ipv4_checksum;

    apply {
        // Answers to a retransmission: addresses swapped in ingress.
        if (ig_md.update_ipv4_checksum) {
            hdr.ipv4.hdr_checksum = ipv4_checksum.update({
                hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.total_len,
                hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl,
                hdr.ipv4.protocol, hdr.ipv4.src_addr, hdr.ipv4.dst_addr});
        }
        pkt.emit(hdr.fold); // valid only in a packet that recirculates (egress bypassed)
        pkt.emit(ig_md.bridged); // valid in every other packet that is not dropped
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.switchml);
        pkt.emit(hdr.exponents);
#ifdef TNA_SPARSE
        pkt.emit(hdr.sparse);
#endif
        pkt.emit(hdr.d0);
        pkt.emit(hdr.d1);
    }
}

parser EgressParser(packet_in pkt, out header_t hdr, out egress_metadata_t eg_md,
                    out egress_intrinsic_metadata_t eg_intr_md) {
    state start {
        pkt.extract(eg_intr_md);
        pkt.extract(eg_md.bridged);
        eg_md.update_ipv4_checksum = false;
        transition select(eg_md.bridged.kind) {
            KIND_RESULT: parse_result;
            default: accept; // everything else leaves as ingress made it
        }
    }

    // A result has no IPv4 options (those are dropped in ingress): fixed offsets.
    state parse_result {
        pkt.extract(hdr.ethernet);
        pkt.extract(hdr.ipv4);
        pkt.extract(hdr.udp);
        transition accept;
    }
}

control EgressDeparser(packet_out pkt, inout header_t hdr, in egress_metadata_t eg_md,
                       in egress_intrinsic_metadata_for_deparser_t eg_dprsr_md) {
    Checksum() ipv4_checksum;

    apply {
        if (eg_md.update_ipv4_checksum) {
            hdr.ipv4.hdr_checksum = ipv4_checksum.update({
                hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.total_len,
                hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl,
                hdr.ipv4.protocol, hdr.ipv4.src_addr, hdr.ipv4.dst_addr});
        }
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
    }
}

#endif
