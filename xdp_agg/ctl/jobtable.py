"""The control endpoint's job table on disk, and its recovery after a restart.

The data plane does not need the control endpoint: a job's all-reduces go on while `xdp-agg
serve` is down. What a restarted endpoint needs to carry on (answer `leave`, free a job when
its ranks are gone, keep new jobs off its id, slots and port) is its job table. `save` writes it
after every change (the server's on_change hook), atomically (a temporary file renamed over the
old one, so a crash leaves the old table or the new one, never half of one); `load` reads it
back for ControlEndpoint.restore. What goes into the table (ControlEndpoint.snapshot) and how
it comes back is the server's; this module is the file. xdp_agg.ctl.endpoint.stand_up wires both.

What is kept per job: its key, spec, world size, window, worker port, its token (so the file
is written with mode 0600), whether the barrier opened, per rank its address, port, MAC and
state, and for a SwitchML session's job the addresses its ranks called from (its hosts, whose
next session may replace it once recovered). The aggregator's identity (`generation`: for
XDP, the program id of the attachment) is kept beside it: a table written for another
attachment (the aggregator was detached and attached again, so its jobs are gone) is not
restored, and `restore` also drops every job the backend no longer has with the same id,
slots and port.

A recovered rank holds its job through a placeholder until it re-identifies itself (`rejoin`,
which hostlib's control link sends as soon as it has reconnected); a rank that does not within
`grace` seconds counts as disconnected, so a worker that died while the endpoint was down still
frees its job.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from .registry import TABLE_FORMAT as FORMAT

log = logging.getLogger(__name__)


def save(path: Path, data: dict) -> None:
    """Write `data` to `path` atomically (write a temporary file, fsync, rename over)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    # 0600: the table holds every job's token (xdp_agg.ctl.auth), which lets its holder act as a
    # rank
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file of another mode is replaced with this one
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: Path) -> dict | None:
    """The saved table, or None when there is none (or it is unreadable: logged)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.error("ignoring the job table %s: %s", path, e)
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        log.error("ignoring the job table %s: not format %d", path, FORMAT)
        return None
    return data
