"""The errors every target and the application raise, each carrying the exit code the `xdp-agg`
CLI gives it (at the bottom of the namespace: it imports nothing, so every layer may raise them).

    XdpAggError               exit 1: the operation failed (nothing attached, interface busy,
     |                                compiler or verifier error, ...)
     +- Refused               exit 1: the aggregator refused a job or worker (also a ValueError,
     |                                which is how the Backend contract says "bad spec")
     +- LiveJobs              exit 1: `detach` refused: jobs are live (--force detaches anyway)
     +- Busy                  exit 4: another process holds the aggregator (a second `serve`)
     +- EnvironmentProblem    exit 3: the machine is not set up for this (no bpffs, the BPF
         |                            objects missing, p4c/bmv2 missing)
         +- NeedsRoot         exit 3: run as root

The XDP target's loader, pins, links and backend, and serving (every target) raise these; the CLI
prints the message and exits with `exit_code`, so no exit code is chosen by reading a message. The
message says what to do. Any other exception is a bug and reaches the user as a traceback. Usage
errors (a bad option or argument) are click's and exit with 2.
"""

from __future__ import annotations

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ENV, EXIT_BUSY = 0, 1, 2, 3, 4


class XdpAggError(Exception):
    """An operation of a target or the application failed; str(e) says why and what to do."""

    exit_code = EXIT_FAILED


class Refused(XdpAggError, ValueError):
    """The aggregator refused a job or a worker (slots outside the pool or overlapping, an
    address already taken, ...). A ValueError too: the Backend contract's refusal, which the
    control endpoint turns into an answer to the client."""


class LiveJobs(XdpAggError):
    """`detach` would end jobs that are live; the message lists them (--force detaches)."""


class Busy(XdpAggError):
    """Another process holds the aggregator for the same role (a second `xdp-agg serve` of one
    name); the message names it."""

    exit_code = EXIT_BUSY


class EnvironmentProblem(XdpAggError):
    """The machine lacks something this needs: bpffs, the BPF objects, a tool on PATH."""

    exit_code = EXIT_ENV


class NeedsRoot(EnvironmentProblem):
    """The operation needs root (BPF, XDP, namespaces)."""

    def __init__(self, what: str = "this") -> None:
        super().__init__(f"{what} needs root: run with sudo")
