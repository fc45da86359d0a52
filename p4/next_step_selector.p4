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
        // the width bit (p4app-switchML's unused bit) stays the request's (protocol.md 5.6)
        hdr.udp.checksum = 0;
        md.rewrite_ipv4 = 1;
    }

    // A rack job's link to its parent (docs/protocol.md section 3.7), set by the table below.
    bit<48> parent_mac;
    bit<32> parent_ip;
    bit<16> parent_port;
    bit<16> uplink_port;
    port_t up_port;
    bit<48> up_mac;
    bit<32> up_ip;
    bit<16> slot_base;
    bit<16> parent_slot_base;
    bit<16> agg_port;

    // up_port: the switch port toward the parent; up_mac/up_ip: our address there, the source
    // of our contributions; agg_port: the rack job's own port, the source of what goes down.
    @name(".set_parent_link")
    action set_parent_link(bit<48> p_mac, bit<32> p_ip, bit<16> p_port, bit<16> uplink,
                           port_t port, bit<48> mac, bit<32> ip, bit<16> base, bit<16> p_base,
                           bit<16> job_port) {
        parent_mac = p_mac;
        parent_ip = p_ip;
        parent_port = p_port;
        uplink_port = uplink;
        up_port = port;
        up_mac = mac;
        up_ip = ip;
        slot_base = base;
        parent_slot_base = p_base;
        agg_port = job_port;
    }

    @name(".parent_link")
    table parent_link {
        key = {
            md.job_id: exact;
        }
        actions = {
            set_parent_link;
            @defaultonly NoAction;
        }
        const default_action = NoAction();
        size = 64; // AGG_MAX_JOBS
    }

    apply {
        bool up = md.reason == AGG_FORWARDED_UP || md.reason == AGG_RESENT_UP;
        bool down = md.reason == AGG_PARENT_RESULT;
        bool linked = false;
        if (up || down) {
            linked = parent_link.apply().hit;
        }
        if (md.reason == AGG_COMPLETED || md.reason == AGG_RETX_ANSWERED || up || down) {
            result_fields();
        }
        // The slot this packet's state is kept in (pool_entry = slot * 2 + version; the version
        // stays the request's at both levels).
        bit<16> g = (bit<16>)(md.pool_entry >> 1);
        bit<16> version = (bit<16>)md.pool_entry[0:0] << 15;
        if (up && linked) {
            // Our partial sum as our contribution to the parent's round: from our address on
            // the port toward it and our uplink port, to its job, in its slot.
            sm.egress_spec = up_port;
            md.kind = KIND_UP;
            hdr.ethernet.dst_addr = parent_mac;
            hdr.ethernet.src_addr = up_mac;
            hdr.ipv4.src_addr = up_ip;
            hdr.ipv4.dst_addr = parent_ip;
            hdr.udp.src_port = uplink_port;
            hdr.udp.dst_port = parent_port;
            hdr.switchml.pool_index = (g - slot_base + parent_slot_base) | version;
        } else if (down && linked) {
            // The parent's result to every worker of the job, as a completion goes, from the
            // job's own port and in our slot.
            sm.mcast_grp = md.mgid;
            md.kind = KIND_RESULT;
            hdr.udp.src_port = agg_port;
            hdr.switchml.pool_index = g | version;
        } else if (md.reason == AGG_COMPLETED) {
            // The result to every worker of the job: one multicast copy per worker (rid = worker
            // index); UDPSender addresses each copy in egress. Results come from the port the
            // workers sent to and go to the port the completing request came from, as
            // p4app-switchML's switch answers (its udp_receiver.p4 lines 70-71): a host's
            // thread t sends from worker_port + t, each thread its own slots.
            sm.mcast_grp = md.mgid;
            md.kind = KIND_RESULT;
            bit<16> request_port = hdr.udp.src_port;
            hdr.udp.src_port = hdr.udp.dst_port;
            hdr.udp.dst_port = request_port;
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
