"""Authentication of the control protocol, shared by the endpoint (xdp_agg.ctl.server) and its
client (hostlib.rendezvous): the deployment secret's file, the proof of the secret, job tokens.

Two credentials (docs/protocol.md section 6.3, docs/operations.md "Trust model"):

- The *deployment secret*: random bytes in a file only its owner may read (mode 0600), created
  by `xdp-agg serve` when absent. A request proves it holds the secret with an `auth` field,
  {"nonce", "ts", "mac"}: mac = HMAC-SHA256(secret, PROOF_CONTEXT | nonce | ts | canonical
  request), the canonical request being the request without `auth` and `token` as sorted,
  compact JSON. The proof is bound to the request's content (a sniffed proof cannot be reused
  for another request), to a time (the endpoint refuses a ts more than its skew from its clock)
  and to a nonce (the endpoint remembers the nonces it accepted within that window and refuses
  a replay).
- A *job token*: random text the endpoint draws when it creates a job and returns to the
  creator. It is a bearer credential for that job only (register, leave, status, diagnose).

Nothing here opens a socket; the endpoint checks, the client proves.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import time
from pathlib import Path

SECRET_ENV = "XDP_AGG_SECRET_FILE"  # path of the deployment secret, for serve and for workers
TOKEN_ENV = "XDP_AGG_JOB_TOKEN"  # a job token a launcher hands to its workers
PROOF_CONTEXT = b"xdp-agg control v1\n"  # domain separation: these MACs mean nothing elsewhere
SECRET_BYTES = 32  # random bytes in a created secret (written as 64 hex digits)
MIN_SECRET_BYTES = 16  # a shorter secret file is refused
NONCE_BYTES = 16  # random bytes per proof (32 hex digits)
TOKEN_BYTES = 24  # random bytes per job token (32 URL-safe characters)
CREDENTIAL_FIELDS = ("auth", "token")  # request fields that carry credentials, not content


class SecretError(ValueError):
    """The deployment secret's file cannot be used (unreadable, readable by others, too short);
    the message says which file and what to do."""


def canonical(request: dict) -> bytes:
    """The bytes a proof covers: the request without its credential fields, as sorted, compact
    JSON (both sides compute the same bytes from the same decoded object)."""
    body = {k: v for k, v in request.items() if k not in CREDENTIAL_FIELDS}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def proof_mac(secret: bytes, request: dict, nonce: str, ts: float) -> str:
    """HMAC-SHA256 (hex) of the request under the secret, for this nonce and timestamp."""
    msg = PROOF_CONTEXT + nonce.encode() + b"\n" + repr(float(ts)).encode() + b"\n"
    return hmac.new(secret, msg + canonical(request), hashlib.sha256).hexdigest()


def prove(secret: bytes, request: dict, *, now: float | None = None) -> dict:
    """The `auth` field that proves `secret` for `request` (a fresh nonce, the current time)."""
    nonce = secrets.token_hex(NONCE_BYTES)
    ts = float(time.time() if now is None else now)
    return {"nonce": nonce, "ts": ts, "mac": proof_mac(secret, request, nonce, ts)}


def check_proof_mac(secret: bytes, request: dict, auth: dict) -> bool:
    """True when auth["mac"] is the MAC of the request for auth's nonce and ts (constant-time
    compare). Freshness and replay are the endpoint's (xdp_agg.ctl.auth)."""
    mac = auth.get("mac")
    if not isinstance(mac, str):
        return False
    good = proof_mac(secret, request, auth["nonce"], auth["ts"])
    return hmac.compare_digest(good.encode(), mac.encode("utf-8", "replace"))


def new_token() -> str:
    """A fresh job token."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def same_token(expected: str, given) -> bool:
    """Constant-time comparison of a job token with what a request carries. A job without a
    token (an empty one) matches nothing: only the secret's proof reaches it."""
    if not expected or not isinstance(given, str):
        return False
    return hmac.compare_digest(expected.encode(), given.encode("utf-8", "replace"))


def load_secret(path: str | os.PathLike) -> bytes:
    """The deployment secret in file `path`: its content, surrounding whitespace stripped.

    Refused (SecretError): a file group or others may read or write (it must be 0600 or
    stricter: anyone who reads it can create jobs), one not a regular file, one shorter than
    MIN_SECRET_BYTES.
    """
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise SecretError(
            f"cannot read the deployment secret {p}: {e.strerror}; give the file `xdp-agg serve` "
            f"uses (--secret-file, or ${SECRET_ENV})"
        ) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"the deployment secret {p} is not a regular file")
        if st.st_mode & 0o077:
            raise SecretError(
                f"the deployment secret {p} has mode {stat.S_IMODE(st.st_mode):04o}: group or "
                f"others may access it, and whoever reads it can create jobs; `chmod 600 {p}`"
            )
        data = f.read(4096).strip()
    if len(data) < MIN_SECRET_BYTES:
        raise SecretError(
            f"the deployment secret {p} holds {len(data)} bytes, fewer than {MIN_SECRET_BYTES}; "
            f"remove it and let `xdp-agg serve` create one, or write at least "
            f"{MIN_SECRET_BYTES} random bytes"
        )
    return data


def create_secret(path: str | os.PathLike) -> bytes:
    """Create the secret file `path` (mode 0600, SECRET_BYTES random bytes as hex) if it does not
    exist, then load it. The parent directory is made (0700) if missing. Creation is exclusive:
    two servers racing for the same path end up with the same secret."""
    p = Path(path)
    p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return load_secret(p)
    except OSError as e:
        raise SecretError(f"cannot create the deployment secret {p}: {e.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(SECRET_BYTES) + "\n")
    return load_secret(p)


# What a rank's pings carry of its loss recovery (hostlib's engine counters, cumulative, at that
# aggregator; docs/protocol.md 4.4 and 6.1): the control endpoint shows their sums per job.
RECOVERY_COUNTERS = ("packets_sent", "retransmissions", "early_losses", "timeouts", "spurious")
