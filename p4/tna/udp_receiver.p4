/* udp_receiver.p4 (TNA): the checks of docs/protocol.md section 2.2 (and 8.3 for sparse jobs),
 * in the reference model's order. */
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
 * this control on a flag: a flag set in this stage could only be tested in the next one. With
 * sparse jobs (Tofino 2) the round key's check comes first (sparse_round.p4), and the bitmap
 * after it, in Ingress.
 *
 * Sparse jobs (Tofino 2) check a packet that is not msg_type 1 in SparseChecks, below. */

#ifdef TNA_SPARSE
/* Rows 5-12 of docs/protocol.md section 8.3, for a packet of a known worker that is not dense
 * (msg_type 1): bad_type unless the job is sparse and the packet msg_type 2 or 3. A header-only
 * empty packet (22 bytes of UDP payload) has no payload headers (the parser stops after its
 * sparse header) and is told apart from a cut one by its UDP length; a padded one is as long as
 * a data packet. Row 11 drops blocks >= 2^31 too (the round key keeps its open flag in the top
 * bit; sparse_round.p4).
 * A chain of its own (bf-p4c: a gateway tests `!=` only where reordering its rows turns it into
 * `==`, mau/gateway.cpp "gateway condition too complex"; rows 11 and 12 under a `msg_type != 1`
 * conjunct, as in one chain with the dense checks, were refused). */
control SparseChecks(inout header_t hdr, inout switchml_md_t md) {
    apply {
        bool header_only = md.empty == 1 && md.sparse_udp_len_diff != 0;
        if (md.sparse_job == 0 || (hdr.switchml.msg_type != SML_MSG_TYPE_SPARSE
                                   && hdr.switchml.msg_type != SML_MSG_TYPE_SPARSE_EMPTY)) {
            md.reason = AGG_DROP_BAD_TYPE; // a dense job takes msg_type 1 only
        } else if (hdr.switchml.size != md.size_code) {
            md.reason = AGG_DROP_BAD_SIZE;
        } else if (hdr.switchml.wire16 != md.wire16) {
            md.reason = AGG_DROP_BAD_WIDTH; // before the sparse rows, as in the dense chain
        } else if (!hdr.sparse.isValid()) {
            md.reason = AGG_DROP_TRUNCATED; // cut before the sparse header's end
        } else if (header_only && (hdr.udp.length != SML_UDP_LEN_SPARSE_EMPTY
                   || hdr.ipv4.total_len != SML_IPV4_HLEN + SML_UDP_LEN_SPARSE_EMPTY)) {
            md.reason = AGG_DROP_BAD_LENGTH; // neither 22 bytes nor 22 + 4k
        } else if (!header_only && !hdr.d1.isValid()) {
            md.reason = AGG_DROP_TRUNCATED; // data, or padding, cut short
        } else if (!header_only && (md.sparse_udp_len_diff != 0 || md.sparse_ip_len_diff != 0)) {
            md.reason = AGG_DROP_BAD_LENGTH;
        } else if (md.slots_below != 0 || md.slots_left == 0) {
            md.reason = AGG_DROP_SLOT_RANGE; // outside [base, end)
        } else if (md.blocks_left == 0 || md.next_over != 0 || hdr.sparse.blocks[31:31] == 1) {
            md.reason = AGG_DROP_SPARSE_RANGE; // outside the tensor
        } else if (md.next_back != 0 || (md.empty == 0 && hdr.sparse.next == hdr.sparse.block)) {
            md.reason = AGG_DROP_SPARSE_BACKWARDS; // an empty may name its block
        } else {
            md.accepted = 1; // SparseRound, then BitmapChecker (in Ingress)
            md.sparse = 1;
            if (md.empty == 1) {
                // no data: zeros to overwrite or add (a padded one's bytes are never summed),
                // and room for a stored sum to be read into
                hdr.d1 = { ... };
                if (md.size_code == SML_SIZE_64) {
                    hdr.d0 = { ... };
                }
            }
        }
    }
}
#endif

control UDPReceiver(inout header_t hdr, inout switchml_md_t md,
                    in ingress_intrinsic_metadata_from_parser_t ig_prsr_md) {
#ifdef TNA_SPARSE
    SparseChecks() sparse_checks;
#else
    BitmapChecker() bitmap_checker;
#endif

    action set_worker(job_id_t job_id, worker_id_t worker_id, worker_bitmap_t worker_bit,
                      bit<8> num_workers, bit<3> size_code, bit<1> wire16,
                      bit<16> udp_len, bit<16> ip_len,
                      pool_slot_t slot_base, pool_slot_t slot_end, MulticastGroupId_t mgid
#ifdef TNA_SPARSE
                      , bit<1> sparse, bit<16> sparse_udp_len, bit<16> sparse_ip_len
#endif
                      ) {
        md.job_id = job_id;
        md.worker_id = worker_id;
        md.worker_bit = worker_bit; // 1 << worker_id, computed by the control plane
        md.counter_row = job_id;
        md.num_workers = num_workers;
        md.size_code = size_code;
        md.wire16 = wire16; // the job's element width (1: 16-bit; docs/protocol.md 5.6)
        md.mgid = mgid;
        // Ordered comparisons of two run-time values are ALU work: saturating subtractions,
        // compared with 0 by the gateways of the next stage.
        md.slots_below = slot_base |-| md.slot;
        md.slots_left = slot_end |-| md.slot;
        // The lengths of the job's size code (udp_len: SML_UDP_LEN_*, ip_len: 20 more), written
        // by the control plane with it: a gateway then compares the differences with 0.
        md.udp_len_diff = udp_len - hdr.udp.length;
        md.ip_len_diff = ip_len - hdr.ipv4.total_len;
#ifdef TNA_SPARSE
        // A sparse job: the lengths of a packet with data (or an empty one padded to it), 12
        // bytes more, written by the control plane likewise; rows 11-12 as saturating
        // subtractions (meaningless in a dense packet, which never reads them); e0 biased for
        // SparseState's unsigned max.
        md.sparse_job = sparse;
        md.sparse_udp_len_diff = sparse_udp_len - hdr.udp.length;
        md.sparse_ip_len_diff = sparse_ip_len - hdr.ipv4.total_len;
        md.sparse_udp_len = sparse_udp_len;
        md.sparse_ip_len = sparse_ip_len;
        md.blocks_left = hdr.sparse.blocks |-| hdr.sparse.block;
        md.next_over = hdr.sparse.next |-| hdr.sparse.blocks;
        md.next_back = hdr.sparse.block |-| hdr.sparse.next;
        md.e0_biased = (bit<32>)(hdr.exponents.e0 ^ 0x80);
#endif
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
#ifdef TNA_SPARSE
                            sparse_checks.apply(hdr, md); // msg_type 2 and 3, or bad_type
#else
                            md.reason = AGG_DROP_BAD_TYPE;
#endif
                        } else if (hdr.switchml.size != md.size_code) {
                            md.reason = AGG_DROP_BAD_SIZE;
                        } else if (hdr.switchml.wire16 != md.wire16) {
                            // the other element width (as the size check: two fields equal)
                            md.reason = AGG_DROP_BAD_WIDTH;
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
#ifndef TNA_SPARSE
                            bitmap_checker.apply(md);
#endif
                        }
                    }
                }
            }
        }
    }
}

#endif
