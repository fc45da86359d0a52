/* udp_sender.p4 (TNA): address a multicast copy of a result to its worker (egress). */
#ifndef _XDP_AGG_TNA_UDP_SENDER_P4_
#define _XDP_AGG_TNA_UDP_SENDER_P4_

control UDPSender(inout header_t hdr, inout egress_metadata_t eg_md,
                  in egress_intrinsic_metadata_t eg_intr_md,
                  inout egress_intrinsic_metadata_for_deparser_t eg_dprsr_md) {

    action to_worker(bit<48> mac, bit<32> ip, bit<16> port, bit<48> agg_mac, bit<32> agg_ip) {
        hdr.ethernet.dst_addr = mac;
        hdr.ethernet.src_addr = agg_mac;
        hdr.ipv4.src_addr = agg_ip;
        hdr.ipv4.dst_addr = ip;
        hdr.udp.dst_port = port;
        hdr.udp.checksum = 0;
        eg_md.update_ipv4_checksum = true;
        eg_md.reason = AGG_EGRESS_SENT;
    }

    action no_worker() {
        eg_md.reason = AGG_EGRESS_NO_WORKER;
        eg_dprsr_md.drop_ctl = 1;
    }

    table worker_addr {
        key = {
            eg_md.bridged.job_id: exact;
            eg_intr_md.egress_rid: exact;
        }
        actions = {
            to_worker;
            @defaultonly no_worker;
        }
        const default_action = no_worker();
        size = WORKERS_TABLE_SIZE;
    }

    apply {
        worker_addr.apply();
    }
}

#endif
