/* udp_receiver.p4: is this packet ours, from whom, for which job and slot; every check of
 * docs/protocol.md section 2.2, in the order of the reference model (xdp_agg/proto/model.py). */
#ifndef _XDP_AGG_UDP_RECEIVER_P4_
#define _XDP_AGG_UDP_RECEIVER_P4_

control UDPReceiver(inout headers_t hdr, inout sml_metadata_t md, in bit<32> packet_length) {

    @name(".set_worker")
    action set_worker(job_id_t job_id, worker_id_t worker_id) {
        md.job_id = job_id;
        md.worker_id = worker_id;
        md.counter_row = job_id;
    }

    // A rack job's parent, registered under (its address, our uplink port): its results are
    // found by addressing like a worker's contributions (docs/protocol.md section 3.7).
    @name(".set_parent")
    action set_parent(job_id_t job_id) {
        md.job_id = job_id;
        md.from_parent = 1;
        md.counter_row = job_id;
    }

    action unknown_source() {
        md.reason = AGG_DROP_UNKNOWN_SOURCE;
    }

    // The job and worker index of a packet come from its addressing, never from a header field:
    // source address, aggregator port and, where the control plane knows it (mask all ones),
    // the source MAC, as p4app-switchML's receive_udp matches them (udp_receiver.p4 lines
    // 94-123 at b5c74a0); a worker whose MAC is not known has mask 0 there.
    @name(".workers")
    table workers {
        key = {
            hdr.ipv4.src_addr: exact;
            hdr.udp.dst_port: exact;
            hdr.ethernet.src_addr: ternary;
        }
        actions = {
            set_worker;
            set_parent;
            @defaultonly unknown_source;
        }
        const default_action = unknown_source();
        size = WORKERS_TABLE_SIZE;
    }

    // wire16: the job's element width (1: 16-bit elements, two a word; docs/protocol.md 5.6)
    @name(".set_job")
    action set_job(bit<8> num_workers, bit<3> size_code, bit<16> slot_base, bit<16> slot_end,
                   bit<16> mgid, bit<1> tree, bit<16> parent_slot_base, bit<1> sparse,
                   bit<1> wire16) {
        md.num_workers = num_workers;
        md.size_code = size_code;
        md.slot_base = slot_base;
        md.slot_end = slot_end;
        md.mgid = mgid;
        md.tree = tree;
        md.parent_slot_base = parent_slot_base;
        md.job_sparse = sparse;
        md.job_wire16 = wire16;
    }

    action no_job() {
        md.reason = AGG_DROP_NO_JOB;
    }

    @name(".jobs")
    table jobs {
        key = {
            md.job_id: exact;
        }
        actions = {
            set_job;
            @defaultonly no_job;
        }
        const default_action = no_job();
        size = 64; // AGG_MAX_JOBS
    }

    apply {
        md.ours = 0;
        md.accepted = 0;
        md.from_parent = 0;
        md.sparse_pkt = 0;
        md.zero = 0;
        md.counter_row = AGG_NO_JOB;
        md.reason = AGG_PASS;
        if (hdr.udp.isValid() && (hdr.udp.dst_port & SML_UDP_PORT_MASK) == SML_UDP_PORT) {
            md.ours = 1;
            bit<16> g = hdr.switchml.pool_index & 0x7fff; // reserved bit 14 set: out of every range
            // The UDP length a packet of this size code has: the IPv4 total length and the
            // frame must agree with it exactly, or a lying length would be summed and echoed.
            bit<16> udp_len = SML_UDP_LEN_32;
            if (hdr.switchml.size == SML_SIZE_64) {
                udp_len = SML_UDP_LEN_64;
            } else if (hdr.switchml.size == SML_SIZE_256) {
                udp_len = SML_UDP_LEN_256;
            }
            // A sparse packet (section 8.1): 12 bytes of sparse header more; an empty one ends
            // after it unless padded to a data packet's length.
            bool sparse = hdr.switchml.msg_type == SML_MSG_TYPE_SPARSE
                          || hdr.switchml.msg_type == SML_MSG_TYPE_SPARSE_EMPTY;
            bool empty = hdr.switchml.msg_type == SML_MSG_TYPE_SPARSE_EMPTY;
            bool needs_payload = true;
            if (sparse) {
                udp_len = udp_len + SML_SPARSE_HLEN;
                if (empty && hdr.udp.length != udp_len) {
                    udp_len = SML_UDP_LEN_SPARSE_EMPTY; // not padded: no payload
                    needs_payload = false;
                }
            }
            if (hdr.ipv4_options.isValid() || hdr.ipv4.flags[0:0] == 1) {
                md.reason = AGG_DROP_MALFORMED; // options or a first fragment
            } else if (!hdr.exponents.isValid()) {
                md.reason = AGG_DROP_TRUNCATED; // shorter than our headers
            } else if (!workers.apply().hit) {
                // unknown_source() set the reason
            } else if (!jobs.apply().hit) {
                // no_job() set the reason
            } else if (md.from_parent == 1 && md.tree == 0) {
                md.reason = AGG_DROP_NO_JOB; // a parent entry of a job that has no parent
            } else if (md.from_parent == 0 && md.worker_id >= md.num_workers) {
                md.reason = AGG_DROP_NO_JOB; // a stale worker entry of a job re-created smaller
            } else if (hdr.switchml.msg_type != SML_MSG_TYPE_DATA
                       && !(sparse && md.job_sparse == 1)) {
                md.reason = AGG_DROP_BAD_TYPE;
            } else if (hdr.switchml.size != md.size_code) {
                md.reason = AGG_DROP_BAD_SIZE;
            } else if (hdr.switchml.wire16 != md.job_wire16) {
                md.reason = AGG_DROP_BAD_WIDTH; // the other element width: never summed
            } else if ((sparse && !hdr.sparse.isValid()) || (needs_payload && (!hdr.d0.isValid()
                       || (md.size_code == SML_SIZE_64 && !hdr.d1.isValid())
                       || (md.size_code == SML_SIZE_256 && !hdr.d7.isValid())))) {
                md.reason = AGG_DROP_TRUNCATED; // shorter than the job's payload
            } else if (hdr.udp.length != udp_len || hdr.ipv4.total_len != SML_IPV4_HLEN + udp_len
                       || packet_length != (bit<32>)(SML_ETH_HLEN + SML_IPV4_HLEN + udp_len)) {
                md.reason = AGG_DROP_BAD_LENGTH;
            } else if (md.from_parent == 0 && (g < md.slot_base || g >= md.slot_end)) {
                md.reason = AGG_DROP_SLOT_RANGE;
            } else if (md.from_parent == 1 && (g < md.parent_slot_base
                       || g - md.parent_slot_base >= md.slot_end - md.slot_base)) {
                md.reason = AGG_DROP_SLOT_RANGE; // the parent's results: the parent job's slots
            } else if (sparse && (hdr.sparse.block >= hdr.sparse.blocks
                                  || hdr.sparse.next > hdr.sparse.blocks)) {
                md.reason = AGG_DROP_SPARSE_RANGE; // outside the tensor
            } else if (sparse && (hdr.sparse.next < hdr.sparse.block
                                  || (hdr.sparse.next == hdr.sparse.block && !empty))) {
                md.reason = AGG_DROP_SPARSE_BACKWARDS; // only an empty one may name its own
            } else {
                md.accepted = 1;
                if (sparse) {
                    md.sparse_pkt = 1;
                    md.zero = empty ? 1w1 : 1w0;
                }
                if (md.from_parent == 1) {
                    g = g - md.parent_slot_base + md.slot_base; // the parent's slot -> ours
                }
                md.pool_entry = ((pool_entry_t)g << 1)
                                | (pool_entry_t)hdr.switchml.pool_index[15:15];
                md.other_entry = md.pool_entry ^ 1;
            }
        }
    }
}

#endif
