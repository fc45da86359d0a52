/* udp_receiver.p4 (TNA): the checks of docs/protocol.md section 2.2, in the reference model's order. */
#ifndef _XDP_AGG_TNA_UDP_RECEIVER_P4_
#define _XDP_AGG_TNA_UDP_RECEIVER_P4_

control UDPReceiver(inout header_t hdr, inout switchml_md_t md,
                    in ingress_intrinsic_metadata_from_parser_t ig_prsr_md) {

    action set_worker(job_id_t job_id, worker_id_t worker_id, worker_bitmap_t worker_bit) {
        md.job_id = job_id;
        md.worker_id = worker_id;
        md.worker_bit = worker_bit; // 1 << worker_id, computed by the control plane
        md.counter_row = job_id;
    }

    action unknown_source() {
        md.reason = AGG_DROP_UNKNOWN_SOURCE;
    }

    // As p4app-switchML's receive_udp: the source MAC too (ternary: mask 0 where not known).
    table workers {
        key = {
            hdr.ipv4.src_addr: exact;
            hdr.udp.dst_port: exact;
            hdr.ethernet.src_addr: ternary;
        }
        actions = {
            set_worker;
            @defaultonly unknown_source;
        }
        const default_action = unknown_source();
        size = WORKERS_TABLE_SIZE;
    }

    action set_job(bit<8> num_workers, bit<3> size_code, bit<16> slot_base, bit<16> slot_end,
                   MulticastGroupId_t mgid) {
        md.num_workers = num_workers;
        md.size_code = size_code;
        md.slot_base = slot_base;
        md.slot_end = slot_end;
        md.mgid = mgid;
        md.workers_above = num_workers |-| md.worker_id;
        md.slots_below = slot_base |-| md.slot;
        md.slots_left = slot_end |-| md.slot;
    }

    action no_job() {
        md.reason = AGG_DROP_NO_JOB;
    }

    table jobs {
        key = {
            md.job_id: exact;
        }
        actions = {
            set_job;
            @defaultonly no_job;
        }
        const default_action = no_job();
        size = 64;
    }

    apply {
        md.ours = 0;
        md.accepted = 0;
        md.counter_row = AGG_NO_JOB;
        md.reason = AGG_PASS;
        if (hdr.udp.isValid() && (hdr.udp.dst_port & SML_UDP_PORT_MASK) == SML_UDP_PORT) {
            md.ours = 1;
            md.slot = hdr.switchml.pool_index & 0x7fff; // reserved bit 14 set: out of range
            md.version = hdr.switchml.pool_index[15:15];
            if (hdr.ipv4.ihl != 5 || hdr.ipv4.flags[0:0] == 1) {
                md.reason = AGG_DROP_MALFORMED;
            } else if (!hdr.exponents.isValid()) {
                md.reason = AGG_DROP_TRUNCATED;
            } else if (!workers.apply().hit) {
            } else if (!jobs.apply().hit) {
            } else if (md.workers_above == 0) { // worker_id >= num_workers
                md.reason = AGG_DROP_NO_JOB;
            } else if (hdr.switchml.msg_type != SML_MSG_TYPE_DATA) {
                md.reason = AGG_DROP_BAD_TYPE;
            } else if (hdr.switchml.size != md.size_code) {
                md.reason = AGG_DROP_BAD_SIZE;
            } else if (!hdr.d0.isValid()) {
                md.reason = AGG_DROP_TRUNCATED;
            } else if (hdr.udp.length != SML_UDP_LEN_32
                       || hdr.ipv4.total_len != SML_IPV4_HLEN + SML_UDP_LEN_32) {
                // Lengths that disagree with the size code: a lying length would be summed and
                // echoed. (TNA's ingress has no frame length to compare; bytes after the UDP
                // length ride along in the result, whose lengths stay right.)
                md.reason = AGG_DROP_BAD_LENGTH;
            } else if (md.slots_below != 0 || md.slots_left == 0) { // outside [base, end)
                md.reason = AGG_DROP_SLOT_RANGE;
            } else {
                md.accepted = 1;
                md.pool_entry = (pool_entry_t)(md.slot ++ md.version); // slot * 2 + version
            }
        }
    }
}

#endif
