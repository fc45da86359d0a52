/*
 * The stream loop of the C fast path (hostlib/fp_loop.h): sending what the round strategy
 * builds, the timers and the congestion window, taking results to it, and the loop that runs
 * one all-reduce.
 */
#include "fp_loop.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Busy-polling, as NumpyDenseLoop._spin (hostlib/numpy_dense.py): while at most SPIN_OUTSTANDING
 * packets of the all-reduce are outstanding, for at most SPIN_TIME s; credit as there. Off with
 * EngineConfig.spin (HostOptions.spin). */
#define SPIN_OUTSTANDING 64
#define SPIN_TIME        60e-6
#define SPIN_PENALTY     2
#define SPIN_CREDIT_MAX  8
#define SPIN_BACKOFF     200
/* The drain loop hands over to sending once this many packets are ready, so that a long
 * burst of results does not let the pipe run dry. */
#define SEND_READY_AT 64

/* The Faults test hook on one datagram (a packet or a result): how many copies go on, 0 (lost,
 * counted), 1 or 2 (duplicated), as `loss` and `dup` say; 1 without Faults. */
static int fault_copies(Run *r, double loss, double dup)
{
    Stream *st = r->s;
    if (!st->cfg.faults)
        return 1;
    if (rng_uniform(&st->rng) < loss) {
        r->c.fault_drops++;
        return 0;
    }
    return 1 + (rng_uniform(&st->rng) < dup);
}

/* --- sending ------------------------------------------------------------------------------ */
/* Send the rows of slots sendq[0..n) (Faults applied) through the transport. Returns 0, or
 * -errno on an error that is neither transient nor a GSO refusal (the caller raises OSError). */
static int send_slots(Run *r, int n)
{
    Stream *st = r->s;
    int nrows = 0;
    r->c.packets_sent += (uint64_t)n;
    for (int i = 0; i < n; i++) {
        r->c.bytes_sent += (uint64_t)st->lens[st->sendq[i]];
        int copies = fault_copies(r, st->cfg.send_loss, st->cfg.send_dup);
        while (copies--) {
            st->txlens[nrows] = st->lens[st->sendq[i]];
            st->txrows[nrows++] = st->rows + (size_t)st->sendq[i] * (size_t)st->stride;
        }
    }
    if (nrows == 0)
        return 0;
    return st->t->ops->send(st->t, st->txrows, st->txlens, nrows, &r->c);
}

/* --- timers and the congestion window ----------------------------------------------------- */
#define RTO_FLOOR_RTTS 3  /* once a round trip is measured, the timer's floor is 3 srtt */
#define REO_MULT_MAX   64 /* the reordering allowance: at most 16 min_rtt (and srtt) */
#define REO_QUIET      16 /* early resends without a needless one before it shrinks again */
#define FLOOR_MULT_MAX 16 /* the timers' floor grows at most 16-fold on needless resends */
#define LOSS_AGE_RTTS  2  /* found lost early only once older than 2 srtt (detect_losses) */
#define BACKOFF_MAX    64 /* new packets' timers back off at most 64-fold (first_rto) */
#define LATE_COPY_RTTS 1  /* a resent packet's slot waits 1 srtt for late copies (late_copies) */

/* A packet's first timer (docs/protocol.md 4.4): RFC 6298's srtt + 4 rttvar within
 * [floor, rto_max], times the stream's back-off after expiries (RFC 6298 5.7). Before a round
 * trip is measured it is rto_min; after, the floor follows the round trip (3 srtt, at least
 * rto_floor, times floor_mult: higher on a host whose stalls made resends needless; at most
 * rto_min; timers only: rto_min, as before early detection). */
static double first_rto(const Stream *st)
{
    if (!st->cc.have_rtt)
        return st->cfg.rto_min;
    double floor = st->cfg.rto_min;
    if (st->cfg.early_loss) {
        double f = RTO_FLOOR_RTTS * st->cc.srtt;
        f = (f < st->cfg.rto_floor ? st->cfg.rto_floor : f) * st->cc.floor_mult;
        floor = f < floor ? f : floor;
    }
    double t = st->cc.srtt + 4 * st->cc.rttvar;
    t = (t < floor ? floor : t) * st->cc.backoff;
    return t > st->cfg.rto_max ? st->cfg.rto_max : t;
}

static void rtt_update(Stream *st, double sample)
{
    st->cc.recent[st->cc.recent_n++ % FP_RECENT_RTTS] = sample;
    st->cc.backoff = 1;
    if (sample < st->cc.min_rtt)
        st->cc.min_rtt = sample;
    if (sample < st->cc.min_here)
        st->cc.min_here = sample;
    if (!st->cc.have_rtt) {
        st->cc.srtt = sample;
        st->cc.rttvar = sample / 2;
        st->cc.have_rtt = 1;
    } else {
        st->cc.rttvar = 0.75 * st->cc.rttvar + 0.25 * fabs(st->cc.srtt - sample);
        st->cc.srtt = 0.875 * st->cc.srtt + 0.125 * sample;
    }
}

/* How long after a later packet's result an earlier packet's may still come before it counts
 * as lost: a quarter of min_rtt, more after needless resends, at most srtt (RFC 8985 6.2's
 * reo_wnd). */
static double reo_wnd(const Stream *st)
{
    if (!st->cc.have_rtt)
        return 0;
    double w = st->cc.reo_mult * st->cc.min_rtt / 4;
    return w < st->cc.srtt ? w : st->cc.srtt;
}

/* The standing round trip: the least of the last FP_RECENT_RTTS samples (one a batch of
 * results: 4 is about a round trip's worth where results come in bunches, as they do
 * behind a queue, which 8 did not always see). A queue on the path
 * delays every packet, so it raises this; a round that waited for another rank's lost packet to
 * be resent delays that round alone, so it does not (Copa's standing RTT; srtt averages such
 * waits in, and at n = 8 and 10% loss most rounds have one). */
static double standing_rtt(const Stream *st)
{
    int n = st->cc.recent_n < FP_RECENT_RTTS ? st->cc.recent_n : FP_RECENT_RTTS;
    double m = INFINITY;
    for (int i = 0; i < n; i++)
        m = st->cc.recent[i] < m ? st->cc.recent[i] : m;
    return m;
}

/* Whether the round trips say a queue has built up on the path: the standing round trip more
 * than queue_delay and more than min_rtt above min_rtt. A loss without it is taken for random
 * loss, which a smaller window would not prevent (docs/protocol.md 4.4). */
static int queue_built(const Stream *st)
{
    double q = standing_rtt(st) - st->cc.min_rtt;
    return st->cc.have_rtt && q > st->cfg.queue_delay && q > st->cc.min_rtt;
}

/* Multiplicative decrease, once per window: packets sent before this point that are lost
 * later are the same congestion event. */
static void window_cut(Run *r)
{
    Stream *st = r->s;
    if (st->cfg.cwnd_fixed)
        return;
    st->cc.cwnd = st->cc.cwnd / 2 < 1 ? 1 : st->cc.cwnd / 2;
    st->cc.ssthresh = st->cc.cwnd;
    r->recover = r->next_new;
}

static inline int64_t window_now(const Run *r)
{
    int64_t c = (int64_t)r->s->cc.cwnd;
    c = c < 1 ? 1 : c;
    return c > r->w ? r->w : c;
}

/* How long a worker holds a slot whose packet it resent (docs/protocol.md 3.3): until its last
 * copy is LATE_COPY_RTTS srtt old, at least rto_floor / 2. The aggregator tells the rounds of
 * a slot apart by one version bit, so a copy that arrives after our next packet in that slot
 * would count as our contribution to the round after it (a wrong sum, or a result that never
 * matches). Held this long, a copy up to that late still finds its round ours: a duplicate.
 * Shorter than the other workers' timers (at least 3 srtt and rto_floor), and a round trip
 * shorter than the age at which their evidence finds a packet lost (loss_age), so that
 * holding our packet makes none of them resend theirs. */
static double late_copy_hold(const Stream *st)
{
    double guard = LATE_COPY_RTTS * st->cc.srtt, least = st->cfg.rto_floor / 2;
    return guard > least ? guard : least;
}

/* When a slot whose packet was resent may take its next packet: after late_copy_hold (rto_min
 * before a round trip is measured, as the first timers). */
static double late_copies(const Stream *st, int64_t s)
{
    if (!st->cc.have_rtt) /* nothing measured: as long as the first timers, rto_min */
        return st->tx_at[s] + st->cfg.rto_min;
    return st->tx_at[s] + late_copy_hold(st);
}

/* How old a packet must be before evidence finds it lost (detect_losses): LOSS_AGE_RTTS
 * srtt (another worker may send its copy up to a round trip after us), or srtt + 4 rttvar
 * where round trips spread wider (RFC 6298's timeout without its floor: on a busy host a result
 * comes that late without any loss, one CPU's softirq behind the other's; as 2 srtt, 0.1-0.2%
 * of a clean n = 8 run's packets went twice). Where its slot's last round was resent or slow
 * (`held`: st->held, took: someone resent it), a worker that resent it may hold its copy of
 * this one (late_copies): then a round trip more than that hold, as a round that waits for a
 * held copy is late, not lost. (With the hold at 2 srtt, at least 1 ms, and the age at 2
 * srtt, every resend made the other workers resend the slot's next packet, and those resends
 * held it again: 0.3-0.4% of a clean run's packets went twice.) */
static double loss_age(const Stream *st, int held)
{
    double age = LOSS_AGE_RTTS * st->cc.srtt, spread = st->cc.srtt + 4 * st->cc.rttvar;
    double after_hold = late_copy_hold(st) + st->cc.srtt;
    age = spread > age ? spread : age;
    return held && after_hold > age ? after_hold : age;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* First transmissions of ready packets, lowest packet number first, as far as the congestion
 * window allows -- except the lowest packet without a result (`base`), which may always go.
 *
 * Why: a packet completes only once every rank sent it. If a full window let each rank pick
 * its own subset of the ready packets (rank A holds p1 in flight with p0 waiting, rank B the
 * other way round), every rank could wait for a packet that another rank is holding back:
 * a deadlock. Every rank can always send its base packet (its slot is free: base - w is
 * done), so the lowest packet any rank still lacks always completes, and the stream moves.
 * A packet whose slot waits for late copies of its last one (late_copies) waits, the base too:
 * the time it waits is bounded, so the stream still moves. */
static int send_ready(Run *r, int *sent)
{
    Stream *st = r->s;
    int n = 0;
    double t = now_s();
    *sent = 0;
    r->held = 0;
    r->held_until = INFINITY;
    int64_t room = window_now(r) - r->inflight;
    if (r->nready == 0 || (room <= 0 && st->ready[r->base % r->w] != r->base))
        return 0;
    int64_t *cand = st->cand;
    int64_t m = 0;
    for (int64_t s = 0; s < r->w; s++)
        if (st->ready[s] >= 0)
            cand[m++] = st->ready[s];
    /* in packet order, always: then every worker's copies of a round go out in the same
     * order, the aggregator completes rounds in packet order, and a later packet's result is
     * evidence that an earlier one was lost (detect_losses) */
    if (m > 1)
        qsort(cand, (size_t)m, sizeof *cand, cmp_i64);
    for (int64_t i = 0; i < m && (n < room || cand[i] == r->base); i++) {
        int64_t p = cand[i], s = p % r->w;
        if (st->reuse_at[s] > t) { /* a copy of the slot's last packet may still be on its way */
            r->held++;
            r->held_until = st->reuse_at[s] < r->held_until ? st->reuse_at[s] : r->held_until;
            continue;
        }
        uint8_t *row = st->rows + (size_t)s * (size_t)st->stride;
        st->lens[s] = r->round->fill(r, p, row);
        st->sendq[n++] = (int32_t)s;
        st->pkt[s] = p;
        st->ready[s] = -1;
        r->state[p] = 1;
        if (p >= r->next_new)
            r->next_new = p + 1;
    }
    r->nready -= n;
    *sent = n;
    if (n == 0)
        return 0;
    double rto = first_rto(st);
    for (int i = 0; i < n; i++) {
        int s = st->sendq[i];
        st->tries[s] = 0;
        st->sent_at[s] = t;
        st->tx_at[s] = t;
        st->early[s] = 0;
        st->rto[s] = rto;
        st->deadline[s] = t + rto;
    }
    if (t + rto < r->next_deadline)
        r->next_deadline = t + rto;
    r->inflight += n;
    return send_slots(r, n);
}

/* The packet in slot s's timer expired: it doubles (the lowest packet without a result's, a
 * probe, only up to rto_min, so that when the path comes back (a burst ends) it goes through
 * within that, and its result and its successor's show the rest lost (detect_losses) rather
 * than each waiting on its own doubled timer). Returns the back-off its expiries ask for. */
static int timer_doubles(Run *r, int64_t s)
{
    Stream *st = r->s;
    double cap = st->cfg.early_loss && st->pkt[s] == r->base ? st->cfg.rto_min : st->cfg.rto_max;
    cap = cap > st->rto[s] ? cap : st->rto[s];
    st->rto[s] = 2 * st->rto[s] < cap ? 2 * st->rto[s] : cap;
    return st->tries[s] < 6 ? 2 << st->tries[s] : BACKOFF_MAX;
}

/* Of the packets whose timer (not early detection) expired by `now`, the earliest: with early
 * detection only it goes again (RFC 6298 5.4), -1 when none. A timer expires without
 * evidence: no later packet's result came. Where every timer in the window expires together a
 * worker stalled (another rank descheduled: no round completes), or a burst lost everything;
 * one packet then finds out which, and its result shows the others lost (detect_losses) in a
 * round trip, where resending the window would resend it needlessly at every stall. */
static int64_t earliest_timer(const Run *r, double now)
{
    const Stream *st = r->s;
    int64_t first = -1;
    for (int64_t s = 0; s < r->w; s++)
        if (st->deadline[s] <= now && !st->early[s] && (first < 0 || st->pkt[s] < first))
            first = st->pkt[s];
    return st->cfg.early_loss ? first : -1;
}

/* Resend the packets whose deadline passed (the identical bytes of its slot row): found lost
 * early (st->early: its timer stays as it was) or its timer expired (doubled; with early
 * detection the earliest such packet only, the others' timers doubled: earliest_timer). The
 * window is cut for a loss only where the round trips show a queue; with early detection off,
 * for every timer (as before it). Not for a burst of timers without a queue: a path that lost
 * everything for a while needs the window it had when it comes back, and a smaller one would
 * hold back the new packets whose results show the burst's packets lost. */
static int expire(Run *r, double now)
{
    Stream *st = r->s;
    int n = 0, cut = 0, backoff = 1;
    int64_t first = earliest_timer(r, now);
    double next = INFINITY;
    for (int64_t s = 0; s < r->w; s++) {
        if (st->deadline[s] <= now && !st->early[s] && first >= 0 && st->pkt[s] != first) {
            timer_doubles(r, s); /* waits: the earliest goes, and its result tells */
            st->deadline[s] = now + st->rto[s];
        } else if (st->deadline[s] <= now) {
            int fresh = st->pkt[s] >= r->recover;
            if (st->early[s]) {
                st->early[s] = 0;
                r->c.early_losses++;
                cut |= fresh && queue_built(st);
                if (++st->cc.reo_quiet >= REO_QUIET && st->cc.reo_mult > 1)
                    st->cc.reo_mult /= 2, st->cc.reo_quiet = 0;
            } else {
                if (st->tries[s] == 0)
                    r->c.timeouts++;
                cut |= fresh && (!st->cfg.early_loss || queue_built(st));
                int b = timer_doubles(r, s);
                backoff = backoff > b ? backoff : b;
            }
            st->tries[s]++;
            st->tx_at[s] = now;
            st->deadline[s] = now + st->rto[s];
            st->sendq[n++] = (int32_t)s;
        }
        if (st->deadline[s] < next)
            next = st->deadline[s];
    }
    r->next_deadline = next;
    if (n == 0)
        return 0;
    /* timers expired without a round trip sampled since: the new packets' timers back off as
     * far as the most expired packet's (2^its expiries), or a path whose round trip grew past
     * them would never answer a packet sent once (Karn; RFC 6298 5.7) */
    if (st->cfg.early_loss && backoff > st->cc.backoff)
        st->cc.backoff = backoff < BACKOFF_MAX ? backoff : BACKOFF_MAX;
    r->c.retransmissions += (uint64_t)n;
    if (cut)
        window_cut(r);
    return send_slots(r, n);
}

/* Early loss detection (docs/protocol.md 4.4): a packet in flight that went out before the
 * newest first transmission whose result came (by send time, then packet number: every worker
 * sends in packet order, so the aggregator completes rounds in about that order) is lost unless
 * its result comes within the reordering allowance of this evidence, and it is at least
 * loss_age old (another worker may send its copy up to a round trip after us, or hold it for
 * late copies: the order of the results it reacts to can differ after a loss). Its deadline
 * becomes that moment (marked st->early) where that is sooner than its timer; expire resends it
 * then. */
static void detect_losses(Run *r, double now)
{
    Stream *st = r->s;
    double at0 = now + reo_wnd(st), next = r->next_deadline;
    double ages[2] = {loss_age(st, 0), loss_age(st, 1)}; /* by st->held */
    r->rack_moved = 0;
    for (int64_t s = 0; s < r->w; s++) {
        double tx = st->tx_at[s], age = ages[st->held[s]], at = tx + age > at0 ? tx + age : at0;
        if (st->pkt[s] < 0 || st->deadline[s] <= at || st->early[s])
            continue;
        if (tx < r->rack_xmit || (tx == r->rack_xmit && st->pkt[s] < r->rack_pkt)) {
            st->deadline[s] = at;
            st->early[s] = 1;
            next = at < next ? at : next;
        }
    }
    r->next_deadline = next;
}

/* A resend whose packet's result came sooner than a round trip after it: the result answers an
 * earlier copy, so the resend was needless (RFC 8985 6.2's test; a second result is no sign: a
 * resend that another worker's loss made us send is answered too, 3.2). More reordering is
 * allowed, and the timers' floor rises (a stall longer than it: a descheduled worker). */
static void needless_resend(Run *r)
{
    Congestion *cc = &r->s->cc;
    r->needless++;
    if (cc->reo_mult < REO_MULT_MAX)
        cc->reo_mult++;
    cc->reo_quiet = 0;
    if (cc->floor_mult < FLOOR_MULT_MAX)
        cc->floor_mult *= 2;
}

/* --- receiving ---------------------------------------------------------------------------- */
/* Whether a result for p is a duplicate (counted, a spurious resend too) or echoes a packet not
 * sent yet (counted stale): 1 when it is either, 0 for a result to take. */
static int seen(Run *r, int64_t p)
{
    if (r->state[p] >= 2) {
        r->c.duplicates++;
        if (r->state[p] > 2) { /* the first copy's result came after a resend */
            r->c.spurious++;
            r->state[p]--;
        }
        return 1;
    }
    if (r->state[p] == 0) { /* echoes a packet not sent yet: not a result of ours */
        r->c.stale++;
        return 1;
    }
    return 0;
}

/* p's result taken at `now`: counters, its timer, the RTT sample and the congestion window. */
static void took(Run *r, int64_t p, double now)
{
    Stream *st = r->s;
    int64_t s = p % r->w;
    int32_t tries = st->tries[s];
    r->state[p] = (uint8_t)(2 + (tries > 253 ? 253 : tries));
    r->c.results++;
    r->ndone++;
    r->results_here++;
    r->last_progress = now;
    /* the newest transmission whose result came (by send time, then packet number). A resent
     * packet's round may have been completed by another worker's resend, sent before or after
     * ours: its result is evidence only against what we sent LOSS_AGE_RTTS srtt before ours */
    double tx = st->tx_at[s];
    /* a round resent, or slow enough that someone may have: our next packet here may wait for
     * a worker's hold (loss_age) */
    st->held[s] = tries > 0 || now - tx > LOSS_AGE_RTTS * st->cc.srtt;
    if (tries > 0) {
        if (now - tx < st->cc.min_rtt) /* came sooner than a resend can be answered */
            needless_resend(r);
        tx -= LOSS_AGE_RTTS * st->cc.srtt; /* evidence only against what is that much older */
    }
    if (tx > r->rack_xmit || (tx == r->rack_xmit && p > r->rack_pkt)) {
        r->rack_xmit = tx;
        r->rack_pkt = p;
        r->rack_moved = 1;
    }
    st->reuse_at[s] = tries > 0 ? late_copies(st, s) : 0;
    st->deadline[s] = INFINITY;
    st->early[s] = 0;
    st->pkt[s] = -1;
    r->inflight--;
    if (tries == 0 && st->sent_at[s] > r->batch_sample_at) { /* Karn: not a resent one */
        r->batch_sample_at = st->sent_at[s];
        r->batch_sample = now - st->sent_at[s];
    }
    if (!st->cfg.cwnd_fixed && st->cc.cwnd < st->cfg.window) {
        /* slow start below ssthresh, then +1 per window of results */
        st->cc.cwnd += st->cc.cwnd < st->cc.ssthresh ? 1.0 : 1.0 / st->cc.cwnd;
        if (st->cc.cwnd > st->cfg.window)
            st->cc.cwnd = st->cfg.window;
    }
}

/* base on to the lowest packet without its result (one the strategy passed has none) */
static void advance(Run *r)
{
    int (*passed)(const Run *, int64_t) = r->round->passed;
    while (r->base < r->P && (r->state[r->base] >= 2 || (passed && passed(r, r->base))))
        r->base++;
}

/* One datagram of len bytes: which packet it answers (the strategy's checks, then the loop's
 * duplicate detection, then the strategy's of the round), the loop's bookkeeping of that
 * packet, and what the strategy makes of it: the packet ready next in its slot. */
static void on_datagram(Run *r, const uint8_t *d, size_t len, double now)
{
    const RoundOps *ops = r->round;
    if (r->fail) /* the run is over: a result was refused */
        return;
    int64_t p = ops->identify(r, d, len);
    if (p < 0 || seen(r, p) || (ops->matches && !ops->matches(r, p, d)))
        return;
    took(r, p, now);
    RoundStep step = ops->apply(r, p, d);
    r->todo -= step.finished;
    r->fail = step.fail;
    if (step.next >= 0) {
        r->s->ready[step.next % r->w] = step.next;
        r->nready++;
    }
    advance(r);
}

/* One datagram through the Faults hook: lost, taken, or taken twice. */
static void deliver(Run *r, const uint8_t *d, size_t len, double now)
{
    Stream *st = r->s;
    int copies = fault_copies(r, st->cfg.recv_loss, st->cfg.recv_dup);
    while (copies--) {
        on_datagram(r, d, len, now);
    }
}

static void on_message(Run *r, const uint8_t *buf, size_t n, size_t seg, double now)
{
    Stream *st = r->s;
    size_t plen = (size_t)st->plen;
    r->c.bytes_received += n;
    if (r->round->varlen) { /* results differ in length: GRO's last datagram may be shorter */
        seg = seg ? seg : n;
        size_t off = 0;
        do {
            size_t len = n - off < seg ? n - off : seg;
            deliver(r, buf + off, len, now);
            off += len;
        } while (off < n);
        return;
    }
    /* seg is the GRO segment size (n for one datagram); a coalesced buffer may end with one
     * shorter datagram: keep the full rows, count the rest (as udp_io.RowReceiver) */
    size_t full = seg == plen ? n / plen : 0;
    if (full * plen != n)
        r->c.malformed++;
    for (size_t i = 0; i < full; i++)
        deliver(r, buf + i * plen, plen, now);
}

static void on_message_cb(void *ctx, const uint8_t *buf, size_t n, size_t seg, double now)
{
    on_message(ctx, buf, n, seg, now);
}

/* One batch of received messages. One RTT sample per batch, from its most recently sent
 * packet: the results of one batch waited in the socket for different times, and the newest
 * sent one waited least, so its sample is closest to the path's round trip. (The timers
 * themselves are only checked after the socket was drained, so a late drain cannot fire
 * them.) */
static int receive_batch(Run *r)
{
    Stream *st = r->s;
    r->batch_sample_at = -INFINITY;
    int m = st->t->ops->receive(st->t, on_message_cb, r, &r->c);
    if (m > 0 && r->batch_sample_at > -INFINITY)
        rtt_update(st, r->batch_sample);
    return m;
}

/* Wait for the transport until `until` (monotonic seconds), at most a second: the progress
 * line and signals; EINTR returns early. */
static int wait_until(Stream *st, double until)
{
    double dt = until - now_s();
    return st->t->ops->wait(st->t, dt > 1.0 ? 1.0 : dt);
}

/* Busy-poll the transport for a while near the end of an all-reduce, if the credit allows:
 * > 0 something came, 0 nothing (or no spinning now), < 0 -errno. */
static int spin(Run *r)
{
    Stream *st = r->s;
    /* near the end (a strategy may know only a lower bound of the packets still to come) */
    if (!st->cfg.spin || r->round->left(r) > SPIN_OUTSTANDING)
        return 0;
    if (st->cc.spin_credit < 0) {
        st->cc.spin_credit++; /* a probe again after |credit| skipped chances */
        return 0;
    }
    double end = now_s() + SPIN_TIME;
    int m = 0;
    while ((m = receive_batch(r)) == 0 && now_s() < end)
        ;
    if (m < 0)
        return m;
    if (m > 0) {
        st->cc.spin_credit =
            st->cc.spin_credit + 1 > SPIN_CREDIT_MAX ? SPIN_CREDIT_MAX : st->cc.spin_credit + 1;
        return m;
    }
    st->cc.spin_credit -= SPIN_PENALTY;
    if (st->cc.spin_credit < 0)
        st->cc.spin_credit = -SPIN_BACKOFF;
    return 0;
}

/* Take what waits, until the socket is empty (*empty set), enough is ready to send or the run
 * is over. Returns the messages taken, or -errno (r->fail says whether a result ended it). */
static int drain(Run *r, int *empty)
{
    int got = 0;
    *empty = 0;
    for (;;) {
        int m = receive_batch(r);
        if (m < 0)
            return m;
        if (m == 0) {
            *empty = 1;
            return got;
        }
        got += m;
        if (r->nready >= SEND_READY_AT || r->todo <= 0 || r->fail)
            return got;
    }
}

int fp_run_loop(Run *r, double timeout, const LoopHooks *h)
{
    Stream *st = r->s;
    double next_print = h->progress ? r->last_progress + h->every : INFINITY;
    int deferred = 0;
    while (r->todo > 0) {
        int sent = 0, rc = send_ready(r, &sent);
        if (rc < 0)
            return rc;
        /* drain: results already waiting count before any timer may fire */
        int empty, got = drain(r, &empty);
        if (got < 0)
            return got;
        if (r->fail)
            return r->fail;
        if (r->todo <= 0)
            break;
        double now = now_s();
        if (r->rack_moved && st->cfg.early_loss)
            detect_losses(r, now);
        if (now >= r->next_deadline) {
            if (empty || deferred) {
                deferred = 0;
                if ((rc = expire(r, now)) < 0)
                    return rc;
            } else {
                deferred = 1; /* drain the rest first; at the latest on the next turn */
            }
        }
        if (now - r->last_progress > timeout)
            return ST_STALLED;
        if (now >= next_print) {
            if (h->progress(h->ctx, r->ndone, r->c.retransmissions))
                return -EINTR;
            next_print = now + h->every;
        }
        if (got || sent || (r->nready > r->held && r->inflight < window_now(r)))
            continue;
        /* nothing to do until a result comes or a timer expires */
        if ((rc = spin(r)) != 0) {
            if (rc < 0 || r->fail)
                return rc < 0 ? rc : r->fail;
            continue;
        }
        double until = r->next_deadline < r->held_until ? r->next_deadline : r->held_until;
        if (r->last_progress + timeout < until)
            until = r->last_progress + timeout + 1e-4;
        if (next_print < until)
            until = next_print;
        rc = wait_until(st, until);
        if (rc == -EINTR) {
            if (h->interrupted(h->ctx))
                return -EINTR;
        } else if (rc < 0) {
            return rc;
        }
    }
    return ST_DONE;
}

/* The per-slot arrays of a Stream: X(member, count, size of one), `w` the window. Allocated
 * together by fp_stream_init, freed together by fp_stream_free. */
#define STREAM_ARRAYS(X)                  \
    X(rows, w, (size_t)st->stride)        \
    X(lens, w, sizeof(int))               \
    X(deadline, w, sizeof(double))        \
    X(sent_at, w, sizeof(double))         \
    X(rto, w, sizeof(double))             \
    X(tx_at, w, sizeof(double))           \
    X(early, w, sizeof(uint8_t))          \
    X(held, w, sizeof(uint8_t))           \
    X(reuse_at, w, sizeof(double))        \
    X(tries, w, sizeof(int32_t))          \
    X(pkt, w, sizeof(int64_t))            \
    X(ready, w, sizeof(int64_t))          \
    X(cand, w, sizeof(int64_t))           \
    X(sendq, 2 * w, sizeof(int32_t))      \
    X(txrows, 2 * w, sizeof(*st->txrows)) \
    X(txlens, 2 * w, sizeof(int))

int fp_stream_init(Stream *st, const StreamConfig *cfg, Transport *t)
{
    memset(st, 0, sizeof *st);
    st->cfg = *cfg;
    st->t = t;
    st->plen = t->plen;
    st->stride = t->plen + cfg->row_extra;
    st->rng = cfg->seed * 0x2545F4914F6CDD1Dull + 1;
    /* slow start from a small window; ssthresh at the slot window until the first loss */
    st->cc.cwnd = cfg->cwnd_fixed ? cfg->window : (cfg->window < 16 ? cfg->window : 16);
    st->cc.ssthresh = cfg->window;
    st->cc.min_rtt = INFINITY;
    st->cc.min_here = INFINITY;
    st->cc.reo_mult = 1;
    st->cc.floor_mult = 1;
    st->cc.backoff = 1;
    st->ke = cfg->pairs ? 2 * cfg->k : cfg->k;
    /* M: scaling.int_range (16 bits: each half of a word's sum must fit int16) */
    st->M = (double)((cfg->pairs ? 32767 : 2147483647) / cfg->scaling_workers);
    for (int i = 0; i < 256; i++)
        st->ftab[i] = ldexp(st->M, -(int)(int8_t)i);
    size_t w = (size_t)cfg->window;
    int ok = 1;
#define STREAM_ALLOC(member, count, size) ok &= (st->member = calloc(count, size)) != NULL;
    STREAM_ARRAYS(STREAM_ALLOC)
#undef STREAM_ALLOC
    if (!ok) {
        fp_stream_free(st);
        return -ENOMEM;
    }
    for (size_t i = 0; i < w; i++)
        st->pkt[i] = -1;
    return 0;
}

void fp_stream_free(Stream *st)
{
#define STREAM_FREE(member, count, size) free((void *)st->member);
    STREAM_ARRAYS(STREAM_FREE)
#undef STREAM_FREE
    if (st->t)
        st->t->ops->close(st->t);
    memset(st, 0, sizeof *st);
}

void fp_run_start(Run *r, Stream *st)
{
    r->s = st;
    r->recover = 0;
    r->needless = 0;
    r->fail = 0;
    r->todo = r->round->start(r);
    r->next_deadline = INFINITY;
    r->rack_xmit = -INFINITY;
    r->rack_pkt = -1;
    r->rack_moved = 0;
    r->held = 0;
    r->held_until = INFINITY;
    for (int64_t s = 0; s < r->w; s++) {
        st->deadline[s] = INFINITY;
        st->early[s] = 0;
        st->tries[s] = 0;
        st->pkt[s] = -1;
    }
    for (int64_t p = 0; p < r->w; p++)
        st->ready[p] = p;
    r->nready = r->w;
    r->last_progress = now_s();
}

void fp_run_end(Run *r)
{
    for (int64_t s = 0; s < r->w; s++) /* no packet of this all-reduce is in flight any more */
        r->s->pkt[s] = -1, r->s->deadline[s] = INFINITY;
    Congestion *cc = &r->s->cc;
    if (r->needless == 0 && cc->floor_mult > 1) /* a quiet one: the floor comes down */
        cc->floor_mult /= 2;
    if (cc->min_here < INFINITY) /* the least round trip: of this all-reduce and the next */
        cc->min_rtt = cc->min_here, cc->min_here = INFINITY;
}
