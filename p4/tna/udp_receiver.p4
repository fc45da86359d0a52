/* udp_receiver.p4 (TNA): the checks of docs/protocol.md section 2.2, in the reference model's order. */
#ifndef _XDP_AGG_TNA_UDP_RECEIVER_P4_
#define _XDP_AGG_TNA_UDP_RECEIVER_P4_

#include "bitmap_checker.p4"

/* One table, `workers`, says who sent a packet and carries its job's parameters, as
 * p4app-switchML's receive_udp carries num_workers and mgid (b5c74a0,
 * dev_root/p4/udp_receiver.p4 lines 48-73). The v1model program looks the job up in a second
 * table; on Tofino that lookup and the comparisons after it take two stages more in front of the
 * accumulators, which then do not fit into the stages left (p4/README.md). So the control plane
 * writes the job into each of its workers' entries and keeps them in step: re-creating a job
 * rewrites them, and a worker whose job is gone, or whose index is not below the job's worker
 * count, gets `stale_worker` (dropped as drop_no_job in the job's row, as the v1model program's
 * jobs lookup and its worker_id >= num_workers check drop it).
 *
 * The bitmap update is applied here, in the branch that accepts the packet, rather than after
 * this control on a flag: a flag set in this stage could only be tested in the next one. */
control UDPReceiver(inout header_t hdr, inout switchml_md_t md,
                    in ingress_intrinsic_metadata_from_parser_t ig_prsr_md) {
    BitmapChecker() bitmap_checker;

    action set_worker(job_id_t job_id, worker_id_t worker_id, worker_bitmap_t worker_bit,
                      bit<8> num_workers, bit<3> size_code, bit<16> udp_len, bit<16> ip_len,
                      pool_slot_t slot_base, pool_slot_t slot_end, MulticastGroupId_t mgid) {
        md.job_id = job_id;
        md.worker_id = worker_id;
        md.worker_bit = worker_bit; // 1 << worker_id, computed by the control plane
        md.counter_row = job_id;
        md.num_workers = num_workers;
        md.size_code = size_code;
        md.mgid = mgid;
        // Ordered comparisons of two run-time values are ALU work: saturating subtractions,
        // compared with 0 by the gateways of the next stage.
        md.slots_below = slot_base |-| md.slot;
        md.slots_left = slot_end |-| md.slot;
        // The lengths of the job's size code (udp_len: SML_UDP_LEN_*, ip_len: 20 more), written
        // by the control plane with it: a gateway then compares the differences with 0.
        md.udp_len_diff = udp_len - hdr.udp.length;
        md.ip_len_diff = ip_len - hdr.ipv4.total_len;
    }

    action stale_worker(job_id_t job_id) {
        md.job_id = job_id;
        md.counter_row = job_id;
        md.reason = AGG_DROP_NO_JOB;
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
            stale_worker;
            @defaultonly unknown_source;
        }
        const default_action = unknown_source();
        size = WORKERS_TABLE_SIZE;
    }

    apply {
        // ours = 0, accepted = 0, reason = AGG_PASS and counter_row = AGG_NO_JOB: the parser's.
        if (hdr.udp.isValid() && (hdr.udp.dst_port & SML_UDP_PORT_MASK) == SML_UDP_PORT) {
            md.ours = 1;
            md.pool_entry = (pool_entry_t)(md.slot ++ md.version); // slot * 2 + version
            if (hdr.ipv4.ihl != 5 || hdr.ipv4.flags[0:0] == 1) {
                md.reason = AGG_DROP_MALFORMED;
            } else if (!hdr.exponents.isValid()) {
                md.reason = AGG_DROP_TRUNCATED;
            } else {
                // The checks after the worker's, in the model's order: each compares a field
                // with a constant, or two fields for equality, as Tofino's gateways can.
                switch (workers.apply().action_run) {
                    set_worker: {
                        if (hdr.switchml.msg_type != SML_MSG_TYPE_DATA) {
                            md.reason = AGG_DROP_BAD_TYPE;
                        } else if (hdr.switchml.size != md.size_code) {
                            md.reason = AGG_DROP_BAD_SIZE;
                        } else if (!hdr.d1.isValid()) {
                            md.reason = AGG_DROP_TRUNCATED; // every size's first pass ends in d1
                        } else if (md.udp_len_diff != 0 || md.ip_len_diff != 0) {
                            // Lengths that disagree with the size code: a lying length would be
                            // summed and echoed. (TNA's ingress has no frame length to compare;
                            // bytes after the UDP length ride along in the result, whose lengths
                            // stay right; p4/README.md says what that means for 256 elements.)
                            md.reason = AGG_DROP_BAD_LENGTH;
                        } else if (md.slots_below != 0 || md.slots_left == 0) {
                            md.reason = AGG_DROP_SLOT_RANGE; // outside [base, end)
                        } else {
                            md.accepted = 1;
                            bitmap_checker.apply(md);
                        }
                    }
                }
            }
        }
    }
}

#endif
