"""What the control endpoint checks before it acts: credentials and limits.

- Guard: the deployment secret's proofs (xdp_agg.proto.control) with a bounded clock skew and a
  replay cache, and the job tokens. With no secret (the trusted-lab opt-out) it allows every
  request, and says so in the log once.
- Limits: line length, connections (in all and per source address), the idle time of a
  connection that holds no job, and a per-source request rate (RateLimiter, a token bucket).

A refusal is a Denied exception whose `kind` ("auth" or "limit") goes into the error answer, so
a client tells them apart without reading the message. Nothing here touches a job: a refused
request changes nothing.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

from xdp_agg.proto import control

log = logging.getLogger(__name__)


class Denied(Exception):
    """A request refused before it acted: missing or wrong credentials, or over a limit."""

    def __init__(self, message: str, kind: str = "auth") -> None:
        super().__init__(message)
        self.kind = kind  # "auth" or "limit": the answer's "kind"


@dataclass
class Limits:
    """The control endpoint's bounds (every one configurable, so tests can make them short)."""

    max_line: int = 1 << 16  # bytes in one request line; a longer one is answered, then closed
    max_connections: int = 512  # open connections in all
    max_per_source: int = 64  # open connections from one source address
    idle_timeout: float = 30.0  # s a connection holding no job may go without a full request
    rate: float = 20.0  # requests per second per source address, sustained
    burst: int = 60  # requests a source may send at once
    proof_skew: float = 120.0  # s a proof's timestamp may differ from the endpoint's clock
    replay_cache: int = 1 << 16  # proofs remembered (within the skew) to refuse replays
    job_lease: float = 60.0  # s a job lives without requests or traffic of its members (lease)

    def __post_init__(self) -> None:
        for name in ("max_line", "max_connections", "max_per_source", "burst", "replay_cache"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"limit {name} must be at least 1")
        for name in ("idle_timeout", "rate", "proof_skew"):
            v = float(getattr(self, name))
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"limit {name} must be a positive number of seconds or /s")


class Checked(dict):
    """A request (the decoded JSON object) with what the guard found: `proven` is True when it
    carried a valid proof of the deployment secret (or the endpoint has no secret)."""

    proven: bool = False


class Guard:
    """Checks proofs of the deployment secret and job tokens; `secret` None allows all."""

    def __init__(self, secret: bytes | None, limits: Limits) -> None:
        self.secret = secret
        self.limits = limits
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}  # nonce -> when it may be forgotten (monotonic)
        if secret is None:  # a deliberate choice (secret=None); the CLI warns on its stderr
            log.info(
                "the control endpoint runs WITHOUT authentication: anyone who reaches it can "
                "create, join and end jobs (a trusted lab only)"
            )

    @property
    def open(self) -> bool:
        """True when no secret is configured: every request is allowed."""
        return self.secret is None

    def check(self, request: dict) -> Checked:
        """The request as a Checked; Denied if it carries a proof that is malformed, wrong,
        stale or replayed. A request without a proof is not refused here (it may carry a job
        token, or need no credential)."""
        out = Checked(request)
        if self.open:
            out.proven = True
            return out
        auth = request.get("auth")
        if auth is None:
            return out
        if not (
            isinstance(auth, dict)
            and isinstance(auth.get("nonce"), str)
            and 16 <= len(auth["nonce"]) <= 128
            and isinstance(auth.get("ts"), (int, float))
            and not isinstance(auth.get("ts"), bool)
            and math.isfinite(auth["ts"])
            and isinstance(auth.get("mac"), str)
        ):
            raise Denied("'auth' must be {nonce: 16-128 chars, ts: seconds, mac: hex}")
        skew = time.time() - auth["ts"]
        if abs(skew) > self.limits.proof_skew:
            raise Denied(
                f"the proof's timestamp is {skew:+.0f} s from the endpoint's clock (at most "
                f"{self.limits.proof_skew:g} s): synchronize the clocks (NTP)"
            )
        if not control.check_proof_mac(self.secret, request, auth):
            raise Denied(
                "the proof of the deployment secret is wrong: the worker's secret file is not "
                f"the one `xdp-agg serve` uses (check ${control.SECRET_ENV} / --secret-file)"
            )
        self._remember(auth["nonce"])
        out.proven = True
        return out

    def _remember(self, nonce: str) -> None:
        now = time.monotonic()
        with self._lock:
            if nonce in self._seen:
                raise Denied("this proof was used before (a replayed request): nothing done")
            if len(self._seen) >= self.limits.replay_cache:
                self._seen = {n: t for n, t in self._seen.items() if t > now}
                if len(self._seen) >= self.limits.replay_cache:
                    raise Denied("too many proofs in the skew window; try again later", "limit")
            # a nonce older than the skew is refused by its timestamp: forget it after that
            self._seen[nonce] = now + 2 * self.limits.proof_skew

    def need_secret(self, request: Checked, what: str) -> None:
        """Denied unless the request proved the deployment secret."""
        if not request.proven:
            raise Denied(
                f"{what} needs proof of the deployment secret: give the worker the secret file "
                f"of `xdp-agg serve` (${control.SECRET_ENV}, or HostOptions(secret_file=...) "
                "given to hostlib.init)"
            )

    def need_job(self, request: Checked, key: str, token: str) -> None:
        """Denied unless the request proved the secret or carries job `key`'s token."""
        if request.proven or control.same_token(token, request.get("token")):
            return
        given = "a wrong token" if request.get("token") is not None else "no token"
        raise Denied(
            f"{request.get('op')}: job {key!r} needs its token or proof of the deployment "
            f"secret, and the request has {given}: rank 0's launcher passes the token "
            f"(${control.TOKEN_ENV}), or give every rank the secret (${control.SECRET_ENV})"
        )

    def has_credentials(self, request: Checked) -> bool:
        """True when the request proved the secret or carries some token (not yet checked)."""
        return request.proven or request.get("token") is not None


class RateLimiter:
    """A token bucket per source address: `rate` requests per second, `burst` at once."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = float(rate)
        self.burst = float(burst)
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # source -> (tokens, when)

    def allow(self, source: str) -> bool:
        """Take one token from `source`'s bucket; False when it is empty."""
        now = time.monotonic()
        with self._lock:
            tokens, when = self._buckets.get(source, (self.burst, now))
            tokens = min(self.burst, tokens + (now - when) * self.rate)
            if len(self._buckets) > 4096:  # forget sources whose buckets are full again
                full = now - self.burst / self.rate
                self._buckets = {s: v for s, v in self._buckets.items() if v[1] > full}
            if tokens < 1.0:
                self._buckets[source] = (tokens, now)
                return False
            self._buckets[source] = (tokens - 1.0, now)
            return True
