"""Exceptions of the host library.

Every error a training job can see is a HostlibError, so `except hostlib.HostlibError` catches
all of them; the subclasses say which side failed.
"""

from __future__ import annotations

from typing import Any


class HostlibError(Exception):
    """Base class of the host library's errors."""


class RendezvousError(HostlibError):
    """The control endpoint refused a request or could not be reached.

    The message is the endpoint's own explanation (it names missing ranks, busy job names, ...).
    """


class AuthError(RendezvousError):
    """The control endpoint refused this worker's credentials: no or a wrong proof of the
    deployment secret, or no or a wrong job token; or the secret file cannot be used (readable
    by others, missing). The message says which and where the credential comes from."""


class LimitError(RendezvousError):
    """The control endpoint refused a request for one of its limits (request rate, connection
    caps, idle time, line length); nothing was done, and trying later may work."""


class ControlConnectionLost(RendezvousError):
    """The control connection itself failed (closed, reset, no answer), as opposed to the
    endpoint answering with an error: hostlib's control link reconnects and rejoins on it."""


class AllreduceTimeout(HostlibError, TimeoutError):
    """An all-reduce made no progress for its timeout.

    The message says what is missing: no answer at all from the aggregator (with its address),
    or how many packets and slots are still outstanding, and, when the control endpoint could be
    asked, which ranks are absent or lagging. The same facts are kept as attributes.
    """

    def __init__(
        self,
        message: str,
        *,
        data_address: tuple[str, int] | None = None,
        packets: int = 0,
        outstanding: int = 0,
        outstanding_slots: tuple[int, ...] = (),
        results: int = 0,
        diagnosis: dict[str, Any] | None = None,
        stripe: int | None = None,
        endpoint: tuple[str, int] | None = None,
    ) -> None:
        super().__init__(message)
        self.data_address = data_address  # the stalled aggregator's data address
        self.packets = packets  # packets of this all-reduce
        self.outstanding = outstanding  # packets without a result when it gave up
        self.outstanding_slots = outstanding_slots
        self.results = results  # results received in this all-reduce
        self.diagnosis = diagnosis  # the control endpoint's `diagnose` answer, if it came
        # a striped job (several aggregators): which one stalled, and its control endpoint
        self.stripe = stripe
        self.endpoint = endpoint

    def copy(self, message: str, **changes: Any) -> AllreduceTimeout:
        """A copy with a new message and the attributes named in changes replaced (like
        dataclasses.replace); the others are kept."""
        fields = {
            "data_address": self.data_address,
            "packets": self.packets,
            "outstanding": self.outstanding,
            "outstanding_slots": self.outstanding_slots,
            "results": self.results,
            "diagnosis": self.diagnosis,
            "stripe": self.stripe,
            "endpoint": self.endpoint,
        }
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"AllreduceTimeout has no attribute(s) {sorted(unknown)}")
        return AllreduceTimeout(message, **{**fields, **changes})

    def with_diagnosis(self, text: str, diagnosis: dict[str, Any] | None) -> AllreduceTimeout:
        """A copy whose message ends with the control endpoint's view of the job."""
        return self.copy(f"{self.args[0]} {text}".rstrip(), diagnosis=diagnosis)


class SparseProtocolError(HostlibError):
    """A result that the sparse rules (docs/protocol.md section 8.4) cannot produce: it would
    send a slot past a block this worker holds data in, or backwards."""


def bad_next_error(
    slot: int, p: int, q: int, mine: int, column: int, B: int, w: int
) -> SparseProtocolError:
    """The SparseProtocolError of a result sending `slot` (column `column` of w) from block p to
    q of B, where this worker's next non-zero block is `mine` (both loops raise it)."""
    return SparseProtocolError(
        f"the aggregator sent slot {slot} from block {p} to block {q} of {B}, but this "
        f"worker's next non-zero block there is {mine} (column {column} of {w}): a result the "
        f"sparse rules cannot produce"
    )
