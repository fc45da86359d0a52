"""Client of the control endpoint (xdp_agg.ctl.server): JSON lines over one TCP connection.

The connection stays open for the life of a communicator: the endpoint treats its close as the
worker leaving, which is how a crashed worker's job is cleaned up.

Credentials (xdp_agg.proto.control): with the deployment secret, every request carries a fresh proof
of it; with a job's token (learned from create, from status when the secret was proven, or
given), every request about that job carries it.
"""

from __future__ import annotations

import json
import select
import socket
import threading
from typing import Any

from xdp_agg.proto import control
from xdp_agg.proto.jobs import DEFAULT_CONTROL_PORT, JobDescription

from .errors import AuthError, ControlConnectionLost, LimitError, RendezvousError

_ERRORS = {"auth": AuthError, "limit": LimitError}  # the answer's "kind" -> what we raise


def load_secret(path: str | None) -> bytes | None:
    """The deployment secret from file `path` (HostOptions.secret_file, which the environment's
    XDP_AGG_SECRET_FILE sets); None without one. AuthError when the file cannot be used."""
    if path is None:
        return None
    try:
        return control.load_secret(path)
    except control.SecretError as e:
        raise AuthError(str(e)) from None


def parse_endpoint(text: str) -> tuple[str, int]:
    """'HOST:PORT' (or 'HOST', meaning the default port) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        return text, DEFAULT_CONTROL_PORT
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"aggregator must be 'HOST:PORT' of the control endpoint, got {text!r}")
    return host, int(port)


class ControlClient:
    """One connection to the control endpoint; request() is thread-safe (one at a time).

    secret: the deployment secret (load_secret): every request proves it. tokens: job name ->
    token, for requests about those jobs; answers that carry a job's token add it.
    """

    def __init__(
        self,
        endpoint: tuple[str, int],
        *,
        timeout: float = 30.0,
        source_ip: str | None = None,
        secret: bytes | None = None,
        tokens: dict[str, str] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.secret = secret
        self.tokens: dict[str, str] = dict(tokens or {})
        self._lock = threading.Lock()
        try:
            self._sock = socket.create_connection(
                endpoint, timeout=timeout, source_address=(source_ip, 0) if source_ip else None
            )
        except OSError as e:
            raise ControlConnectionLost(
                f"cannot reach the control endpoint {endpoint[0]}:{endpoint[1]}: {e}; is "
                f"`xdp-agg serve` (or python -m xdp_agg.app.soft_endpoint) running there?"
            ) from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._rfile = self._sock.makefile("rb")

    @property
    def local_address(self) -> tuple[str, int]:
        return self._sock.getsockname()[:2]

    def request(self, op: str, *, reply_timeout: float = 30.0, **fields: Any) -> dict[str, Any]:
        """Send one request (op and fields) and wait up to `reply_timeout` s for its answer.

        Returns the answer (a dict with ok=True); raises RendezvousError with the endpoint's
        explanation when it says ok=False, or when the connection fails.
        """
        req = {"op": op, **fields}
        job = fields.get("job")
        token = self.tokens.get(job) if isinstance(job, str) else None
        if token is not None:
            req["token"] = token
        with self._lock:
            if self.secret is not None:  # proved now, not before waiting for the lock: fresh
                req["auth"] = control.prove(self.secret, req)
            msg = json.dumps(req).encode() + b"\n"
            try:
                self._sock.settimeout(reply_timeout)
                self._sock.sendall(msg)
                line = self._rfile.readline()
            except (OSError, ValueError) as e:  # ValueError: the file was closed
                raise ControlConnectionLost(
                    f"control endpoint {self.endpoint[0]}:{self.endpoint[1]} did not answer "
                    f"{op!r} within {reply_timeout:g} s: {e}"
                ) from None
        if not line:
            raise ControlConnectionLost(
                f"control endpoint {self.endpoint[0]}:{self.endpoint[1]} closed the connection "
                f"during {op!r}"
            )
        try:
            answer = json.loads(line)
        except ValueError:
            raise RendezvousError(f"control endpoint sent something that is not JSON: {line!r}")
        if not answer.get("ok"):
            cls = _ERRORS.get(answer.get("kind"), RendezvousError)
            raise cls(answer.get("error") or f"{op!r} failed without a reason")
        if isinstance(answer.get("token"), str) and isinstance(job, str):
            self.tokens[job] = answer["token"]
        return answer

    def job(self, op: str, **fields: Any) -> JobDescription:
        """request(), for the ops whose answer describes the job (create, status, register)."""
        answer = self.request(op, **fields)
        try:
            return JobDescription.from_dict(answer.get("job") or {})
        except ValueError as e:
            raise RendezvousError(f"control endpoint answered {op!r} with {e}") from None

    def peer_closed(self) -> bool:
        """True when the endpoint has closed the connection (EOF or an error waiting), without
        consuming anything; call it with no request in flight."""
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
            return (
                bool(readable) and self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            )
        except BlockingIOError:
            return False
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        try:
            self._rfile.close()
            self._sock.close()
        except OSError:
            pass
