/* parsers.p4: parser, checksum controls and deparser (v1model). */
#ifndef _XDP_AGG_PARSERS_P4_
#define _XDP_AGG_PARSERS_P4_

/* Ethernet, IPv4, UDP; then, for UDP to 0xBEE0..0xBEEF, our headers and as many payload headers
 * as the packet's size code says. A packet too short for them stops with a parser error; bmv2
 * still runs ingress then, with the headers extracted so far valid and the missing ones invalid,
 * which is how UDPReceiver recognises a truncated packet (the XDP program compares lengths). */
parser SmlParser(packet_in pkt, out headers_t hdr, inout sml_metadata_t md,
                 inout standard_metadata_t sm) {
    state start {
        pkt.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }

    state parse_ipv4 {
        pkt.extract(hdr.ipv4);
        transition select(hdr.ipv4.protocol, hdr.ipv4.ihl, hdr.ipv4.frag_offset) {
            (IP_PROTO_UDP, 4w5, 13w0): parse_udp;
            // ihl 6..15: options; the UDP header follows them
            (IP_PROTO_UDP, 4w6 &&& 4w0xe, 13w0): parse_ipv4_options;
            (IP_PROTO_UDP, 4w8 &&& 4w0x8, 13w0): parse_ipv4_options;
            default: accept; // a later fragment has no UDP header; ihl < 5 is no IPv4 header
        }
    }

    state parse_ipv4_options {
        pkt.extract(hdr.ipv4_options, (bit<32>)(((bit<16>)hdr.ipv4.ihl - 5) * 32));
        transition parse_udp;
    }

    state parse_udp {
        pkt.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            SML_UDP_PORT &&& SML_UDP_PORT_MASK: parse_switchml;
            default: accept;
        }
    }

    // p4app-switchML's order (b5c74a0, dev_root/p4/parsers.p4 lines 187-195): the SwitchML
    // header, the exponent header, then the payload.
    state parse_switchml {
        pkt.extract(hdr.switchml);
        pkt.extract(hdr.exponents);
        transition select(hdr.switchml.msg_type) {
            SML_MSG_TYPE_SPARSE: parse_sparse;
            SML_MSG_TYPE_SPARSE_EMPTY: parse_sparse;
            default: parse_payload;
        }
    }

    // A sparse packet's header, then its payload: always for data (msg_type 2); for an empty
    // one (3) only when padded, else the payload's extract fails at the end of the packet and
    // the payload headers stay invalid (UDPReceiver tells the two apart by the UDP length).
    state parse_sparse {
        pkt.extract(hdr.sparse);
        transition parse_payload;
    }

    state parse_payload {
        transition select(hdr.switchml.size) {
            SML_SIZE_32: parse_d0;
            SML_SIZE_64: parse_d0;
            SML_SIZE_256: parse_d0;
            default: accept; // sizes this program does not aggregate: dropped as a bad size
        }
    }

    state parse_d0 {
        pkt.extract(hdr.d0);
        transition select(hdr.switchml.size) {
            SML_SIZE_32: accept;
            default: parse_d1;
        }
    }

    state parse_d1 {
        pkt.extract(hdr.d1);
        transition select(hdr.switchml.size) {
            SML_SIZE_256: parse_d2;
            default: accept;
        }
    }

    // 256 elements: six more payload headers (a recirculated pass parses them again, rotated).
    state parse_d2 {
        pkt.extract(hdr.d2);
        transition parse_d3;
    }

    state parse_d3 {
        pkt.extract(hdr.d3);
        transition parse_d4;
    }

    state parse_d4 {
        pkt.extract(hdr.d4);
        transition parse_d5;
    }

    state parse_d5 {
        pkt.extract(hdr.d5);
        transition parse_d6;
    }

    state parse_d6 {
        pkt.extract(hdr.d6);
        transition parse_d7;
    }

    state parse_d7 {
        pkt.extract(hdr.d7);
        transition accept;
    }
}

control SmlVerifyChecksum(inout headers_t hdr, inout sml_metadata_t md) {
    apply {
        // Nothing: like the XDP program, the aggregator does not check checksums.
    }
}

control SmlComputeChecksum(inout headers_t hdr, inout sml_metadata_t md) {
    apply {
        // Only packets whose addresses we rewrote (results): plain traffic keeps its bytes even
        // when its checksum is wrong. Results have no IPv4 options (those are dropped).
        update_checksum(
            hdr.ipv4.isValid() && md.rewrite_ipv4 == 1,
            { hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.total_len,
              hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl,
              hdr.ipv4.protocol, hdr.ipv4.src_addr, hdr.ipv4.dst_addr },
            hdr.ipv4.hdr_checksum,
            HashAlgorithm.csum16);
    }
}

control SmlDeparser(packet_out pkt, in headers_t hdr) {
    apply {
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.ipv4_options);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.switchml);
        pkt.emit(hdr.exponents);
        pkt.emit(hdr.sparse);
        pkt.emit(hdr.d0);
        pkt.emit(hdr.d1);
        pkt.emit(hdr.d2);
        pkt.emit(hdr.d3);
        pkt.emit(hdr.d4);
        pkt.emit(hdr.d5);
        pkt.emit(hdr.d6);
        pkt.emit(hdr.d7);
    }
}

#endif
