/* udp_sender.p4: address a multicast copy of a result to the worker it is for (egress). */
#ifndef _XDP_AGG_UDP_SENDER_P4_
#define _XDP_AGG_UDP_SENDER_P4_

control UDPSender(inout headers_t hdr, inout sml_metadata_t md, inout standard_metadata_t sm) {

    // As the XDP program's switch mode: the worker's MAC and address as destination (and its
    // registered UDP port for the parent's result; see apply), our MAC and address on the
    // worker's side as source; UDP checksum 0 (legal for IPv4); the
    // IPv4 checksum is recomputed after egress (SmlComputeChecksum).
    @name(".to_worker")
    action to_worker(bit<48> mac, bit<32> ip, bit<16> port, bit<48> agg_mac, bit<32> agg_ip) {
        hdr.ethernet.dst_addr = mac;
        hdr.ethernet.src_addr = agg_mac;
        hdr.ipv4.src_addr = agg_ip;
        hdr.ipv4.dst_addr = ip;
        hdr.udp.dst_port = port;
        hdr.udp.checksum = 0;
        md.reason = AGG_EGRESS_SENT;
    }

    action no_worker() {
        md.reason = AGG_EGRESS_NO_WORKER;
        mark_to_drop(sm);
    }

    // (job, worker index = the replica's rid) -> how to reach that worker.
    @name(".worker_addr")
    table worker_addr {
        key = {
            md.job_id: exact;
            sm.egress_rid: exact;
        }
        actions = {
            to_worker;
            @defaultonly no_worker;
        }
        const default_action = no_worker();
        size = WORKERS_TABLE_SIZE;
    }

    apply {
        // a completion keeps the port its request came from, which ingress made the copy's
        // destination port (p4app-switchML's udp_sender.p4 line 80); the parent's result, which
        // no worker of ours sent, goes to the port each worker registered
        bool from_parent = md.reason == AGG_PARENT_RESULT;
        bit<16> request_port = hdr.udp.dst_port;
        worker_addr.apply();
        if (!from_parent) {
            hdr.udp.dst_port = request_port;
        }
    }
}

#endif
