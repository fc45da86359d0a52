/* next_step_selector.p4: what happens to a packet of ours once the state machine has run. */
#ifndef _XDP_AGG_NEXT_STEP_SELECTOR_P4_
#define _XDP_AGG_NEXT_STEP_SELECTOR_P4_

control NextStepSelector(inout headers_t hdr, inout sml_metadata_t md,
                         inout standard_metadata_t sm) {
    // The fields every result leaves with, whatever the request carried (as p4app-switchML's
    // sender writes them, and as the XDP program does).
    action result_fields() {
        hdr.ipv4.diffserv = SML_RESULT_TOS;
        hdr.ipv4.identification = SML_RESULT_IP_ID;
        hdr.ipv4.flags = SML_RESULT_IP_FLAGS; // the fragment offset is 0: fragments are not ours
        hdr.ipv4.ttl = SML_RESULT_TTL;
        hdr.switchml.reserved = 0;
        hdr.udp.checksum = 0;
        md.rewrite_ipv4 = 1;
    }

    apply {
        if (md.reason == AGG_COMPLETED || md.reason == AGG_RETX_ANSWERED) {
            result_fields();
        }
        if (md.reason == AGG_COMPLETED) {
            // The result to every worker of the job: one multicast copy per worker (rid = worker
            // index); UDPSender addresses each copy in egress. Results come from the port the
            // workers sent to.
            sm.mcast_grp = md.mgid;
            md.kind = KIND_RESULT;
            hdr.udp.src_port = hdr.udp.dst_port;
            hdr.udp.checksum = 0;
            md.rewrite_ipv4 = 1;
        } else if (md.reason == AGG_RETX_ANSWERED) {
            // The stored result to the sender alone: back out of its port (the port of the
            // packet's first pass), addresses swapped.
            sm.egress_spec = md.ingress_port;
            md.kind = KIND_ANSWER;
            bit<48> mac = hdr.ethernet.dst_addr;
            hdr.ethernet.dst_addr = hdr.ethernet.src_addr;
            hdr.ethernet.src_addr = mac;
            bit<32> ip = hdr.ipv4.dst_addr;
            hdr.ipv4.dst_addr = hdr.ipv4.src_addr;
            hdr.ipv4.src_addr = ip;
            bit<16> port = hdr.udp.dst_port;
            hdr.udp.dst_port = hdr.udp.src_port;
            hdr.udp.src_port = port;
            hdr.udp.checksum = 0;
            md.rewrite_ipv4 = 1;
        } else {
            // Aggregated, a pending duplicate, or dropped for one of the reasons counted.
            mark_to_drop(sm);
        }
    }
}

#endif
