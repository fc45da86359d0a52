/* next_step_selector.p4 (TNA): what happens to a packet of ours after the state machine. */
#ifndef _XDP_AGG_TNA_NEXT_STEP_SELECTOR_P4_
#define _XDP_AGG_TNA_NEXT_STEP_SELECTOR_P4_

control NextStepSelector(inout header_t hdr, inout ingress_metadata_t ig_md,
                         in ingress_intrinsic_metadata_t ig_intr_md,
                         inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                         inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    apply {
        ig_md.bridged.setValid();
        ig_md.bridged.job_id = ig_md.sml.job_id;
        ig_md.bridged.counter_row = ig_md.sml.counter_row;
        ig_md.bridged.ingress_port = ig_intr_md.ingress_port;
        if (ig_md.sml.reason == AGG_COMPLETED || ig_md.sml.reason == AGG_RETX_ANSWERED) {
            // what every result leaves with, as p4app-switchML's sender writes it
            hdr.ipv4.diffserv = SML_RESULT_TOS;
            hdr.ipv4.identification = SML_RESULT_IP_ID;
            hdr.ipv4.flags = SML_RESULT_IP_FLAGS;
            hdr.ipv4.ttl = SML_RESULT_TTL;
            hdr.switchml.reserved = 0;
        }
        if (ig_md.sml.reason == AGG_COMPLETED) {
            // One copy per worker (rid = worker index) through the job's group; egress
            // addresses each.
            ig_tm_md.mcast_grp_a = ig_md.sml.mgid;
            ig_md.bridged.kind = KIND_RESULT;
            hdr.udp.src_port = hdr.udp.dst_port;
            hdr.udp.checksum = 0;
        } else if (ig_md.sml.reason == AGG_RETX_ANSWERED) {
            ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port;
            ig_md.bridged.kind = KIND_ANSWER;
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
            ig_md.update_ipv4_checksum = true;
        } else {
            ig_dprsr_md.drop_ctl = 1;
        }
    }
}

#endif
