/* forwarder.p4: plain L2 forwarding for everything that is not ours. */
#ifndef _XDP_AGG_FORWARDER_P4_
#define _XDP_AGG_FORWARDER_P4_

control Forwarder(inout headers_t hdr, inout sml_metadata_t md, inout standard_metadata_t sm) {

    @name(".l2_forward_port")
    action forward(port_t port) {
        sm.egress_spec = port;
    }

    // To every port but the one it came in on (egress drops that copy).
    @name(".l2_flood")
    action flood() {
        sm.mcast_grp = FLOOD_MGID;
        md.kind = KIND_FLOOD;
    }

    @name(".l2_drop")
    action drop() {
        mark_to_drop(sm);
    }

    // A static MAC table filled by the control plane; no learning. Unknown destinations are
    // flooded by default; the control plane may make drop the default instead.
    @name(".l2_forward")
    table l2_forward {
        key = {
            hdr.ethernet.dst_addr: exact;
        }
        actions = {
            forward;
            flood;
            drop;
        }
        default_action = flood();
        size = L2_TABLE_SIZE;
    }

    apply {
        md.ingress_port = sm.ingress_port;
        l2_forward.apply();
    }
}

#endif
