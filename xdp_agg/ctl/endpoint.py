"""The one way to stand up a control endpoint: a ControlEndpoint in front of a backend, and,
where the endpoint keeps a job table on disk, that table restored at start and saved on every
change. `xdp-agg serve` (both targets), the soft endpoint and the tests all come through here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from xdp_agg.proto.jobs import WorkerSpec

from . import auth, jobtable
from .backend import Backend
from .server import ControlEndpoint, ServerDefaults


def stand_up(
    backend: Backend,
    host: str,
    port: int,
    defaults: ServerDefaults | dict | None = None,
    *,
    secret: bytes | None,
    limits: auth.Limits | None = None,
    fill_worker: Callable[[WorkerSpec, tuple[str, int]], None] | None = None,
    table: Path | None = None,
    generation=None,
    grace: float = 60.0,
) -> tuple[ControlEndpoint, list[str]]:
    """A control endpoint bound to host:port (not yet serving: start() it, or
    run_until_interrupted()), and the keys of the jobs it recovered.

    secret: the deployment secret (None: no authentication); limits: its bounds. With `table`
    (a path), the endpoint keeps its jobs when it stops, restores the saved ones the backend
    still has (of the same `generation`, the aggregator's attachment; ranks have `grace`
    seconds to rejoin) and saves the table after every change. Raises OSError when the address
    cannot be bound."""
    server = ControlEndpoint(
        backend,
        host,
        port,
        defaults,
        fill_worker=fill_worker,
        secret=secret,
        limits=limits,
        keep_jobs=table is not None,
    )
    if table is None:
        return server, []
    saved = jobtable.load(table)
    server.registry.on_change = lambda: jobtable.save(table, server.registry.snapshot(generation))
    recovered = server.registry.restore(saved, generation, grace=grace)
    server.registry.notify_change()  # what was not recovered is not kept either
    return server, recovered
