/* forwarder.p4 (TNA): plain L2 forwarding for everything that is not ours. */
#ifndef _XDP_AGG_TNA_FORWARDER_P4_
#define _XDP_AGG_TNA_FORWARDER_P4_

control Forwarder(inout header_t hdr, inout ingress_metadata_t ig_md,
                  in ingress_intrinsic_metadata_t ig_intr_md,
                  inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                  inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {

    action forward(PortId_t port) {
        ig_tm_md.ucast_egress_port = port;
    }

    action flood() {
        ig_tm_md.mcast_grp_a = FLOOD_MGID;
        ig_md.bridged.kind = KIND_FLOOD;
    }

    action drop() {
        ig_dprsr_md.drop_ctl = 1;
    }

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
        ig_md.bridged.setValid();
        ig_md.bridged.kind = KIND_NONE;
        ig_md.bridged.ingress_port = ig_intr_md.ingress_port;
        l2_forward.apply();
    }
}

#endif
