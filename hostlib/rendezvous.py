"""Client of the control endpoint (aggctl.server): JSON lines over one TCP connection.

The connection stays open for the life of a communicator: the endpoint treats its close as the
worker leaving, which is how a crashed worker's job is cleaned up.
"""

from __future__ import annotations

import json
import select
import socket
import threading

from aggproto.jobs import DEFAULT_CONTROL_PORT, JobDescription

from .errors import ControlConnectionLost, RendezvousError


def parse_endpoint(text: str) -> tuple[str, int]:
    """'HOST:PORT' (or 'HOST', meaning the default port) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        return text, DEFAULT_CONTROL_PORT
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"aggregator must be 'HOST:PORT' of the control endpoint, got {text!r}")
    return host, int(port)


class ControlClient:
    """One connection to the control endpoint; request() is thread-safe (one at a time)."""

    def __init__(
        self, endpoint: tuple[str, int], *, timeout: float = 30.0, source_ip: str | None = None
    ) -> None:
        self.endpoint = endpoint
        self._lock = threading.Lock()
        try:
            self._sock = socket.create_connection(
                endpoint, timeout=timeout, source_address=(source_ip, 0) if source_ip else None
            )
        except OSError as e:
            raise ControlConnectionLost(
                f"cannot reach the control endpoint {endpoint[0]}:{endpoint[1]}: {e}; is "
                f"`xdp-agg serve` (or python -m aggctl.server) running there?"
            ) from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._rfile = self._sock.makefile("rb")

    @property
    def local_address(self) -> tuple[str, int]:
        return self._sock.getsockname()[:2]

    def request(self, op: str, *, reply_timeout: float = 30.0, **fields) -> dict:
        """Send one request (op and fields) and wait up to `reply_timeout` s for its answer.

        Returns the answer (a dict with ok=True); raises RendezvousError with the endpoint's
        explanation when it says ok=False, or when the connection fails.
        """
        msg = json.dumps({"op": op, **fields}).encode() + b"\n"
        with self._lock:
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
            raise RendezvousError(answer.get("error") or f"{op!r} failed without a reason")
        return answer

    def job(self, op: str, **fields) -> JobDescription:
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
