"""The control endpoint's job table on disk, and its recovery after a restart.

The data plane does not need the control endpoint: a job's all-reduces go on while `xdp-agg
serve` is down. What a restarted endpoint needs to carry on (answer `leave`, free a job when
its ranks are gone, keep new jobs off its id, slots and port) is its job table. `save` writes it
after every change (the server's on_change hook), atomically (a temporary file renamed over the
old one, so a crash leaves the old table or the new one, never half of one); `restore` reads it
back into a new RendezvousServer.

What is kept per job: its key, spec, world size, window, worker port, its token (so the file
is written with mode 0600), whether the barrier opened, and per rank its address, port, MAC
and state. The aggregator's identity (`generation`: for XDP, the program id of the attachment)
is kept beside it: a table written for another
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
import threading
from pathlib import Path

from aggproto.jobs import JobSpec

from .server import RendezvousServer, _Job, _Rank, _recovered_holder

log = logging.getLogger(__name__)

FORMAT = 1  # the file's format version


def snapshot(server: RendezvousServer, generation=None) -> dict:
    """The server's job table as JSON-able data (call with the server's lock held or quiet)."""
    jobs = []
    for job in server._jobs.values():
        if job.deleted:
            continue
        jobs.append(
            {
                "key": job.key,
                "spec": job.spec.to_dict(),
                "world_size": job.world_size,
                "window": job.window,
                "worker_port": job.worker_port,
                "token": job.token,
                "complete": job.complete,
                "ranks": {
                    str(r): {"ip": x.ip, "port": x.port, "mac": x.mac, "state": x.state}
                    for r, x in sorted(job.ranks.items())
                },
            }
        )
    return {"format": FORMAT, "generation": generation, "jobs": jobs}


def save(path: Path, data: dict) -> None:
    """Write `data` to `path` atomically (write a temporary file, fsync, rename over)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    # 0600: the table holds every job's token (aggctl.auth), which lets its holder act as a rank
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


def _same_job(spec: JobSpec, have: dict) -> bool:
    return all(
        have.get(k) == getattr(spec, k)
        for k in ("job_id", "num_workers", "elems", "slot_base", "slot_count", "agg_port")
    )


def restore(
    server: RendezvousServer, data: dict | None, generation=None, grace: float = 60.0
) -> list[str]:
    """Put the saved jobs the backend still has into `server` (before it serves); returns their
    keys. Ranks that do not rejoin within `grace` seconds are then treated as disconnected."""
    if not data:
        return []
    if data.get("generation") != generation:
        log.warning(
            "not restoring %d job(s): they were made on another attachment of the aggregator "
            "(%s, now %s), whose state is gone",
            len(data.get("jobs", [])),
            data.get("generation"),
            generation,
        )
        return []
    have = {j["job_id"]: j for j in server.backend.jobs()}
    restored = []
    with server._cond:
        for rec in data.get("jobs", []):
            try:
                spec = JobSpec(**rec["spec"])
                ranks = {
                    int(r): _Rank(x["ip"], int(x["port"]), x["mac"], None, x["state"])
                    for r, x in rec["ranks"].items()
                }
                key = rec["key"]
            except (KeyError, TypeError, ValueError) as e:
                log.error("skipping an unreadable job record %r: %s", rec, e)
                continue
            if spec.job_id not in have or not _same_job(spec, have[spec.job_id]):
                log.warning("not restoring job %r: the aggregator has no such job any more", key)
                continue
            job = _Job(key, spec, rec["world_size"], rec["window"], rec["worker_port"])
            # a table without a token restores a job no token matches (aggproto.control.same_token)
            job.token = str(rec.get("token") or "")
            job.ranks, job.complete = ranks, bool(rec.get("complete"))
            job.holders = {
                _recovered_holder(r) for r, x in ranks.items() if x.state == "registered"
            }
            server._jobs[key] = job
            if not job.holders:  # nobody can come back for it: free it now
                server._delete(job)
                continue
            restored.append(key)
            log.info("recovered job %r (id %d), ranks %s", key, spec.job_id, sorted(ranks))
    if restored:
        t = threading.Timer(grace, _expire, args=(server, grace))
        t.daemon = True
        t.start()
    return restored


def _expire(server: RendezvousServer, grace: float) -> None:
    """Recovered ranks that did not rejoin within `grace` are disconnected (frees their jobs)."""
    with server._cond:
        if server._stopping:
            return
        for job in list(server._jobs.values()):
            for r, x in job.ranks.items():
                if x.state == "registered" and x.conn is None:
                    log.warning(
                        "rank %d of job %r did not rejoin within %g s: disconnected",
                        r,
                        job.key,
                        grace,
                    )
                    server._mark_gone(job, r, "disconnected")
                    server._release(job, _recovered_holder(r))
        server._changed()
