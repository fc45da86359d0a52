/* headers.p4 (TNA): same headers as the v1model program; ours from the generated wire.p4. */
#ifndef _XDP_AGG_TNA_HEADERS_P4_
#define _XDP_AGG_TNA_HEADERS_P4_

#include "../include/wire.p4"
#include "../include/payload.p4"

const bit<16> ETHERTYPE_IPV4 = 0x0800;
const bit<8> IP_PROTO_UDP = 17;

header ethernet_h {
    bit<48> dst_addr;
    bit<48> src_addr;
    bit<16> ether_type;
}

header ipv4_h {
    bit<4> version;
    bit<4> ihl;
    bit<8> diffserv;
    bit<16> total_len;
    bit<16> identification;
    bit<3> flags;
    bit<13> frag_offset;
    bit<8> ttl;
    bit<8> protocol;
    bit<16> hdr_checksum;
    bit<32> src_addr;
    bit<32> dst_addr;
}

header udp_h {
    bit<16> src_port;
    bit<16> dst_port;
    bit<16> length;
    bit<16> checksum;
}

struct header_t {
    fold_h fold; // between the passes of a packet of ours (types.p4)
    ethernet_h ethernet;
    ipv4_h ipv4;
    udp_h udp;
    switchml_h switchml;
    exponents_h exponents;
    sparse_h sparse; // sparse jobs' msg_type 2 and 3 (docs/protocol.md 8.1; Tofino 2 only)
    payload_h d0; // elements 0..31 of the pass (a 32-element packet has none: d1 only)
    payload_h d1; // elements 32..63 of the pass, or a 32-element packet's 32
}

#endif
