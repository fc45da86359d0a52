"""Timers and early loss detection of the Python loops (docs/protocol.md 4.4), the rules of the
C loop's (hostlib/fp_loop.c: first_rto, detect_losses, expire, needless_resend) over numpy's
per-slot arrays.

A packet in flight is resent when its timer expires, or earlier, once a result came for a
packet sent after it and its own result did not follow within a reordering allowance (in the
spirit of RFC 8985's RACK): a lost packet costs about a round trip, not a timer. The timers'
floor follows the measured round trip once there is one (3 srtt, at least `rto_floor`, at most
`rto`), so the last packets of an all-reduce, after which nothing can show them lost, wait a
few round trips rather than `rto`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .stream_state import EngineConfig

RTO_FLOOR_RTTS = 3  # the timers' floor, in srtt (fp_loop.c RTO_FLOOR_RTTS)
REO_MULT_MAX = 64  # the reordering allowance: at most 16 min_rtt, and srtt (REO_MULT_MAX)
REO_QUIET = 16  # early resends without a needless one before the allowance shrinks (REO_QUIET)
FLOOR_MULT_MAX = 16  # the timers' floor grows at most 16-fold on needless resends
LOSS_AGE_RTTS = 2  # found lost early only once older than 2 srtt (fp_loop.c LOSS_AGE_RTTS)
BACKOFF_MAX = 64  # new packets' timers back off at most 64-fold (fp_loop.c BACKOFF_MAX)
LATE_COPY_RTTS = 1  # a resent packet's slot waits 1 srtt for late copies (fp_loop.c)


def late_copies(tx_at: np.ndarray, rtt: RttEstimator, cfg: EngineConfig) -> np.ndarray:
    """When slots whose packets were last sent at `tx_at` (and were resent) may take their next
    packets: LATE_COPY_RTTS srtt later, at least rto_floor / 2, or `rto` before a round trip is
    measured (fp_loop.c late_copies says why: a copy arriving after our next packet in its slot
    would count in the round after it)."""
    if rtt.srtt is None:
        return tx_at + cfg.rto
    return tx_at + late_copy_hold(rtt.srtt, cfg)


def late_copy_hold(srtt: float, cfg: EngineConfig) -> float:
    """How long a worker holds a slot whose packet it resent: LATE_COPY_RTTS srtt, at least
    rto_floor / 2 (fp_loop.c late_copy_hold)."""
    return max(cfg.rto_floor / 2, LATE_COPY_RTTS * srtt)


def loss_age(rtt: RttEstimator, cfg: EngineConfig, held: bool) -> float:
    """How old a packet must be before evidence finds it lost: LOSS_AGE_RTTS srtt, or srtt + 4
    rttvar where round trips spread wider; where its slot's last round was resent or slow
    (`held`), also a round trip more than the hold another worker may put on its copy
    (fp_loop.c loss_age says why)."""
    srtt = rtt.srtt or 0.0
    age = max(LOSS_AGE_RTTS * srtt, srtt + 4 * rtt.rttvar)
    return max(age, late_copy_hold(srtt, cfg) + srtt) if held else age


class RttEstimator:
    """Round trips (RFC 6298, one sample per received batch), the least one, the reordering
    allowance and the timers' floor and back-off, kept across all-reduces."""

    def __init__(self) -> None:
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.min_rtt = np.inf  # the least of this all-reduce and the last
        self.min_here = np.inf  # the least of this one's (a path that changes is followed)
        self.reo_mult = 1  # the reordering allowance in quarters of min_rtt
        self.reo_quiet = 0  # early resends since the allowance last grew
        self.floor_mult = 1  # the timers' floor, times this (needless resends double it)
        self.backoff = 1  # new packets' timers, times this, until a round trip is sampled
        self.needless_count = 0  # needless resends in all (quiet_run compares)

    def update(self, sample: float) -> None:
        self.backoff = 1
        self.min_rtt = min(self.min_rtt, sample)
        self.min_here = min(self.min_here, sample)
        if self.srtt is None:
            self.srtt, self.rttvar = sample, sample / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - sample)
            self.srtt = 0.875 * self.srtt + 0.125 * sample

    def rto(self, rto: float, cap: float, floor: float | None) -> float:
        """A packet's first timer: srtt + 4 rttvar within [rto, cap] before early detection
        (`floor` None), or within [min(rto, max(floor, 3 srtt) * floor_mult), cap] with it,
        times the back-off; `rto` until a round trip is measured."""
        if self.srtt is None:
            return rto
        least = max(floor or 0.0, RTO_FLOOR_RTTS * self.srtt) * self.floor_mult
        least = rto if floor is None else min(rto, least)
        return min(max(least, self.srtt + 4 * self.rttvar) * self.backoff, cap)

    def timers_expired(self, tries: np.ndarray) -> None:
        """Timers of packets resent `tries` times before expired (with early detection): new
        packets' timers back off as far as the most expired one's, 2^(its expiries), until a
        round trip is sampled (RFC 6298 5.7), or a path whose round trip grew past them would
        never answer a packet sent once (Karn's rule)."""
        if tries.size:
            most = int(tries.max())
            self.backoff = max(self.backoff, 2 << most if most < 6 else BACKOFF_MAX)
            self.backoff = min(self.backoff, BACKOFF_MAX)

    def reo_wnd(self) -> float:
        """How long after a later packet's result an earlier one's may still come before it
        counts as lost: min_rtt / 4 times the multiplier, at most srtt."""
        if self.srtt is None:
            return 0.0
        return min(self.reo_mult * self.min_rtt / 4, self.srtt)

    def needless(self, n: int) -> None:
        """`n` resends were needless (their packet's result came sooner than a round trip after
        them): allow more reordering (RFC 8985 6.2 step 4), and raise the timers' floor (a
        stall longer than it, e.g. a descheduled worker)."""
        for _ in range(n):
            self.needless_count += 1
            self.reo_mult = min(self.reo_mult + 1, REO_MULT_MAX)
            self.reo_quiet = 0
            self.floor_mult = min(self.floor_mult * 2, FLOOR_MULT_MAX)

    def early(self, n: int) -> None:
        """`n` packets resent early: after each REO_QUIET without a needless one, allow less."""
        for _ in range(n):
            self.reo_quiet += 1
            if self.reo_quiet >= REO_QUIET and self.reo_mult > 1:
                self.reo_mult //= 2
                self.reo_quiet = 0

    def run_ended(self, needless_before: int) -> None:
        """An all-reduce ended; without a needless resend since `needless_before` (the count at
        its start), the timers' floor comes down; its least round trip becomes min_rtt."""
        if self.needless_count == needless_before:
            self.floor_mult = max(1, self.floor_mult // 2)
        if self.min_here < np.inf:  # the least round trip: of this all-reduce and the next
            self.min_rtt, self.min_here = self.min_here, np.inf


def doubled(timers: np.ndarray, probe: np.ndarray, rto: float, rto_max: float) -> np.ndarray:
    """Expired timers, doubled: up to rto_max; the probe's (the lowest packet without a result)
    only up to `rto`, so that it goes through soon after a burst (fp_loop.c expire)."""
    cap = np.where(probe, np.maximum(rto, timers), rto_max)
    return np.minimum(timers * 2, cap)


def expired(
    slots: np.ndarray,
    rack: Rack,
    tries: np.ndarray,
    rto: np.ndarray,
    probe: int,
    rtt: RttEstimator,
    cfg: EngineConfig,
    stats: dict,
) -> np.ndarray:
    """The rules of a pass over the slots whose deadline passed, `slots` (fp_loop.c expire);
    returns the slots to send again. Found lost early (`rack.early`), a slot keeps its timer
    and goes; else its timer doubles (slot `probe`'s, the lowest packet without a result, only
    up to `cfg.rto`), and with early detection only the earliest of them goes (RFC 6298 5.4:
    its result shows the others lost, where a stall would have them all resent needlessly;
    fp_loop.c earliest_timer), and new packets' timers back off; the tries of those that go
    count the resend. The caller sends them and sets the deadlines of all `slots` from `rto`."""
    early = rack.early[slots]
    timer = slots[~early]
    if cfg.early_loss and timer.size > 1:
        first = timer[np.argmin(rack.pkt[timer])]
        waits = timer[timer != first]
        rto[waits] = doubled(rto[waits], waits == probe, cfg.rto, cfg.rto_max)
        timer = np.array([first])
    resend = np.concatenate([slots[early], timer])
    stats["timeouts"] += int(np.count_nonzero(tries[timer] == 0))
    stats["early_losses"] += int(np.count_nonzero(early))
    stats["retransmissions"] += resend.size
    rtt.early(int(np.count_nonzero(early)))
    rack.early[slots] = False
    if cfg.early_loss:
        rtt.timers_expired(tries[timer])
        rto[timer] = doubled(rto[timer], timer == probe, cfg.rto, cfg.rto_max)
    else:
        rto[timer] = np.minimum(rto[timer] * 2, cfg.rto_max)
    tries[resend] += 1
    return resend


class Rack:
    """One all-reduce's early detection over its per-slot arrays (views the loop keeps):
    `tx_at` the latest transmission of each slot's packet, `pkt` that packet's number,
    `deadline` its timer or, where `early` is set, the moment it counts as lost.

    The evidence is the newest transmission whose result came, by send time and then packet
    number: every worker sends in packet order, so the aggregator completes rounds in packet
    order, and an earlier packet whose result has not come within the reordering allowance of
    a later one's is lost (whoever's copy it was: docs/protocol.md 4.4)."""

    def __init__(self, w: int) -> None:
        self.tx_at = np.zeros(w)
        self.pkt = np.full(w, -1, dtype=np.int64)
        self.early = np.zeros(w, dtype=bool)
        self.held = np.zeros(w, dtype=bool)  # the slot's last round was slow: see took()
        self.xmit, self.newest = -np.inf, -1  # the newest transmission answered, its packet
        self.moved = False

    def sent(self, s0: int, s1: int, first: int, now: float) -> None:
        """Packets first..first+s1-s0-1 went out at `now` from slots s0..s1-1."""
        self.tx_at[s0:s1] = now
        self.pkt[s0:s1] = np.arange(first, first + s1 - s0)
        self.early[s0:s1] = False

    def took(self, s0: int, s1: int, tries: np.ndarray, now: float, rtt: RttEstimator) -> int:
        """Results came at `now` for the packets of slots s0..s1-1 (their `tries`); how many of
        their resends were needless (the result came sooner than min_rtt after the resend). A
        resent packet's round may have been completed by another worker's resend, sent before
        or after ours: its result is evidence only against what we sent LOSS_AGE_RTTS srtt
        before ours. A slot whose round was resent or slow (its result came later than a loss
        would be found: someone resent it) may have its next round held by a worker that
        resent it (late_copies): `held`, and its next packet is found lost only at loss_age."""
        tx, pkt = self.tx_at[s0:s1].copy(), self.pkt[s0:s1]
        resent = tries > 0
        self.held[s0:s1] = resent | (now - tx > LOSS_AGE_RTTS * (rtt.srtt or 0.0))
        needless = int(np.count_nonzero(resent & (now - tx < rtt.min_rtt)))
        tx[resent] -= LOSS_AGE_RTTS * (rtt.srtt or 0.0)
        i = np.lexsort((pkt, tx))[-1]  # the newest by send time, then number
        t, p = float(tx[i]), int(pkt[i])
        if (t, p) > (self.xmit, self.newest):
            self.xmit, self.newest, self.moved = t, p, True
        self.early[s0:s1] = False
        return needless

    def detect(
        self, deadline: np.ndarray, now: float, rtt: RttEstimator, cfg: EngineConfig
    ) -> float:
        """Set the deadline of every packet in flight sent before the newest answered one to
        now + the reordering allowance, or to when it is loss_age old if that is later, where
        that is sooner than its deadline; the least deadline now."""
        self.moved = False
        age = np.where(self.held, loss_age(rtt, cfg, True), loss_age(rtt, cfg, False))
        at = np.maximum(now + rtt.reo_wnd(), self.tx_at + age)
        older = (self.tx_at < self.xmit) | ((self.tx_at == self.xmit) & (self.pkt < self.newest))
        sooner = (deadline < np.inf) & ~self.early & older & (deadline > at)
        if sooner.any():
            deadline[sooner] = at[sooner]
            self.early |= sooner
        return float(deadline.min())
