/* sparse_round.p4 (TNA, Tofino 2 only): what a sparse job (docs/protocol.md section 8) adds to
 * the state machine under Tofino's rules, where each register is one stateful ALU that a pass
 * reaches once. The v1model program's p4/sparse_round.p4 keeps the same state; the reference
 * model's _sparse_check, _sparse and _sparse_result (xdp_agg/proto/model.py) say what it means.
 *
 * Row 13 (drop_sparse_mismatch) is decided before the bitmap, so that a contribution of another
 * round changes nothing, as in the model: per (slot, version) the round's key (block, blocks;
 * DENSE_KEY twice for a dense round) with an open flag, in one register that SparseRound's
 * `claim` reads and writes at once. A packet finding the key open compares (the same: on to the
 * bitmap; another: dropped); one finding it closed makes its own key the round's and opens it.
 * The bitmap cannot say here whether the packet is new, so the key is not closed when its round
 * completes (a retransmission would then reopen it with nothing to close it again) but when the
 * *next* round of the slot, the other version's, completes: the completing packet's last pass
 * closes the other version's key (`close`). A worker sends version v's next round only once it
 * has the result of the other version's round, which leaves after that pass; and it
 * retransmits version v's last round only while it lacks that round's result, so before the
 * other version's round can complete. So every retransmission finds its round's key open, and
 * every new round's first contribution finds it closed. (A copy delayed in the network past the
 * next round of its version is taken for a new round, as in the XDP program and in SwitchML's
 * dense protocol.) A 32-element completion takes one pass more for the close
 * (next_step_selector.p4); a 64-element one closes in its harvest pass.
 *
 * After the counter, SparseState keeps the smallest next with its exponent and whether any
 * contribution had data, and SparseResult writes a completion or an answered retransmission
 * from them: msg_type 2 with the sum, or 3 with no payload, the lengths following. An empty
 * contribution's payload headers were zeroed by UDPReceiver: the accumulators' table,
 * unchanged, overwrites with zeros at a round's first contribution and adds nothing later.
 *
 * The control plane clears `round_key` (both versions) with the bitmaps and counters when it
 * creates a job, and gives set_worker the job's sparse flag and lengths. */
#ifndef _XDP_AGG_TNA_SPARSE_ROUND_P4_
#define _XDP_AGG_TNA_SPARSE_ROUND_P4_

#ifdef TNA_SPARSE

struct round_key_t {
    bit<32> lo; // block
    bit<32> hi; // blocks | ROUND_OPEN while open
}

control SparseRound(inout switchml_md_t md) {
    Register<round_key_t, pool_entry_t>(POOL_ENTRIES) round_key;

    // Tofino 2: three comparisons (open; block; blocks, masked), which Tofino 2's stateful ALU
    // has (four comparators, maskable); Tofino's two do not suffice (TNA_SPARSE).
    RegisterAction<round_key_t, pool_entry_t, bit<8>>(round_key) claim = {
        void apply(inout round_key_t value, out bit<8> verdict) {
            if ((value.hi & ROUND_OPEN) == 0) {
                value.lo = md.key_lo;
                value.hi = md.key_hi | ROUND_OPEN;
                verdict = RK_NONE; // claimed
            } else if (value.lo == md.key_lo && (value.hi & BLOCKS_MASK) == md.key_hi) {
                verdict = RK_NONE; // the same round
            } else {
                verdict = RK_OTHER;
            }
        }
    };

    RegisterAction<round_key_t, pool_entry_t, bit<8>>(round_key) close = {
        void apply(inout round_key_t value, out bit<8> verdict) {
            value.lo = 0;
            value.hi = 0;
            verdict = RK_NONE;
        }
    };

    action claim_action() {
        md.rk = claim.execute(md.pool_entry);
    }

    // pool_entry is the other version's in a close pass (Ingress sets it so)
    action close_action() {
        md.rk = close.execute(md.pool_entry);
    }

    // One table for both: a register's actions are one table's (its stage's stateful ALU).
    table round {
        key = {
            md.accepted: exact;
            md.sparse_job: exact;
            md.step: exact;
            md.reason: ternary;
        }
        actions = {
            claim_action;
            close_action;
            @defaultonly NoAction;
        }
        const entries = {
            // a first pass that passed rows 0-12 (its reason is still AGG_PASS)
            (1, 1, STEP_CONSUME0, _): claim_action();
            // the last pass of a completing packet
            (1, 1, STEP_HARVEST7, AGG_COMPLETED): close_action();
        }
        const default_action = NoAction(); // a dense job, a drop, another pass
        size = 2;
    }

    apply {
        round.apply();
    }
}

struct next_e0_t {
    bit<32> next; // the smallest next, kept beside its exponent: one ALU decides both
    bit<32> e0; // the maximum e0 (biased: e0 ^ 0x80) over the contributions naming it
}

/* The round's smallest next with its exponent, and whether it has data: written by the first
 * contribution, updated by each new one, read by a retransmission of a complete round. Two
 * registers, each its own table (bf-p4c: one stateful ALU output per action); the pair's ALU
 * returns both of its words (Tofino 2: up to four outputs). */
control SparseState(in header_t hdr, inout switchml_md_t md) {
    Register<next_e0_t, pool_entry_t>(POOL_ENTRIES) next_e0;
    Register<bit<8>, pool_entry_t>(POOL_ENTRIES) has_data;

    RegisterAction<next_e0_t, pool_entry_t, bit<32>>(next_e0) next_first = {
        void apply(inout next_e0_t value, out bit<32> next, out bit<32> e0) {
            value.next = hdr.sparse.next;
            value.e0 = md.e0_biased;
            next = value.next;
            e0 = value.e0;
        }
    };

    // Tofino 2: three comparisons (next <, next ==, and max's), of its four comparators.
    // The exponent travels with the smallest next (8.4): a smaller next takes its e0, an equal
    // one maxes it in.
    RegisterAction<next_e0_t, pool_entry_t, bit<32>>(next_e0) next_update = {
        void apply(inout next_e0_t value, out bit<32> next, out bit<32> e0) {
            if (hdr.sparse.next < value.next) {
                value.next = hdr.sparse.next;
                value.e0 = md.e0_biased;
            } else if (hdr.sparse.next == value.next) {
                value.e0 = max(value.e0, md.e0_biased);
            }
            next = value.next;
            e0 = value.e0;
        }
    };

    RegisterAction<next_e0_t, pool_entry_t, bit<32>>(next_e0) next_read = {
        void apply(inout next_e0_t value, out bit<32> next, out bit<32> e0) {
            next = value.next;
            e0 = value.e0;
        }
    };

    RegisterAction<bit<8>, pool_entry_t, bit<8>>(has_data) data_first = {
        void apply(inout bit<8> value, out bit<8> data) {
            if (md.empty == 0) {
                value = 1;
            } else {
                value = 0;
            }
            data = value;
        }
    };

    RegisterAction<bit<8>, pool_entry_t, bit<8>>(has_data) data_update = {
        void apply(inout bit<8> value, out bit<8> data) {
            if (md.empty == 0) {
                value = 1;
            }
            data = value;
        }
    };

    RegisterAction<bit<8>, pool_entry_t, bit<8>>(has_data) data_read = {
        void apply(inout bit<8> value, out bit<8> data) {
            data = value;
        }
    };

    action first_next() {
        md.next_min = next_first.execute(md.pool_entry, md.next_e0);
    }

    action update_next() {
        md.next_min = next_update.execute(md.pool_entry, md.next_e0);
    }

    action read_next() {
        md.next_min = next_read.execute(md.pool_entry, md.next_e0);
    }

    action first_data() {
        md.has_data = data_first.execute(md.pool_entry);
    }

    action update_data() {
        md.has_data = data_update.execute(md.pool_entry);
    }

    action read_data() {
        md.has_data = data_read.execute(md.pool_entry);
    }

    // As the exponents' table (exponents.p4), keyed on the counter's outputs: a round's first
    // contribution, a later one, a retransmission of a complete round; a pending duplicate
    // reads nothing. A packet of another round never gets here (accepted cleared).
    table next_state {
        key = {
            md.accepted: exact;
            md.sparse: exact;
            md.is_new: exact;
            md.count_before: ternary;
        }
        actions = {
            first_next;
            update_next;
            read_next;
            @defaultonly NoAction;
        }
        const entries = {
            (1, 1, 1, 0): first_next();
            (1, 1, 1, _): update_next();
            (1, 1, 0, 0): read_next();
        }
        const default_action = NoAction();
        size = 3;
    }

    table data_state { // next_state's entries, for has_data
        key = {
            md.accepted: exact;
            md.sparse: exact;
            md.is_new: exact;
            md.count_before: ternary;
        }
        actions = {
            first_data;
            update_data;
            read_data;
            @defaultonly NoAction;
        }
        const entries = {
            (1, 1, 1, 0): first_data();
            (1, 1, 1, _): update_data();
            (1, 1, 0, 0): read_data();
        }
        const default_action = NoAction();
        size = 3;
    }

    apply {
        next_state.apply();
        data_state.apply();
    }
}

/* A completion or a retransmission of a complete sparse round leaves as the round's result,
 * written from the stored state: its smallest next and that next's e0 (e1 is the exponents'
 * maximum already), and msg_type 2 with the sum (read into the payload headers, which an empty
 * request has: UDPReceiver zeroed them) or 3 with no payload, so the lengths follow the kind. */
control SparseResult(inout header_t hdr, in switchml_md_t md) {
    apply {
        if (md.sparse == 1 && (md.reason == AGG_COMPLETED || md.reason == AGG_RETX_ANSWERED)) {
            hdr.sparse.next = md.next_min;
            hdr.exponents.e0 = md.next_e0[7:0] ^ 0x80;
            if (md.has_data == 0) {
                hdr.switchml.msg_type = SML_MSG_TYPE_SPARSE_EMPTY;
                hdr.d0.setInvalid();
                hdr.d1.setInvalid();
                hdr.udp.length = SML_UDP_LEN_SPARSE_EMPTY;
                hdr.ipv4.total_len = SML_IPV4_HLEN + SML_UDP_LEN_SPARSE_EMPTY;
            } else {
                hdr.switchml.msg_type = SML_MSG_TYPE_SPARSE;
                hdr.udp.length = md.sparse_udp_len; // 22 + 4k bytes (set_worker)
                hdr.ipv4.total_len = md.sparse_ip_len;
            }
        }
    }
}

#endif // TNA_SPARSE

#endif
