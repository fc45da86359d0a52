"""A communicator's control connection that survives a restart of the control endpoint.

The data plane does not need the control endpoint: all-reduces go on while `xdp-agg serve` is
down or restarting. Its TCP connection does die with it, and the endpoint treats a closed
connection as the worker leaving. So a training job must not fail for that: ControlLink
watches its connection in the background and, once it has closed, reconnects (with back-off,
for as long as the communicator lives) and re-identifies itself with `rejoin {job, rank, ip,
port}` (with the job's token, like every request about the job), which the restarted
endpoint (having recovered its job table, xdp_agg.ctl.jobtable) answers by letting the new
connection hold the job. A request that finds the connection broken does
the same at once, then retries once.

If the endpoint does not know the job any more (it was restarted without its table, or the
aggregator was re-attached), rejoin is refused: that is remembered (`lost`), logged once, and
the link stops trying; all-reduces still run as long as the data plane has the job, and a
timeout's diagnosis then says what the endpoint answered.

While open, the link sends a `ping` every RENEW_INTERVAL seconds: the endpoint removes a job
whose members all went quiet (no request, no traffic) for its lease (xdp_agg.ctl.lease, default 60
s), and a live rank that does not all-reduce for a while (evaluation, a checkpoint) must not look
like one that hangs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import ControlConnectionLost, RendezvousError
from .rendezvous import ControlClient

log = logging.getLogger(__name__)

WATCH_INTERVAL = 0.25  # s between looks at an idle connection
BACKOFF = (0.1, 2.0)  # s: first and longest wait between reconnection attempts
RENEW_INTERVAL = 10.0  # s between pings that renew the job's lease (xdp_agg.ctl.lease)


class ControlLink:
    """ControlClient's request()/close() for one registered rank, with reconnect + rejoin."""

    def __init__(
        self,
        client: ControlClient,
        *,
        job: str,
        rank: int,
        ip: str,
        port: int,
        source_ip: str | None = None,
    ) -> None:
        self._client = client
        self._identity = {"job": job, "rank": rank, "ip": ip, "port": port}
        self._source_ip = source_ip
        self._swap = threading.Lock()  # held while the client is replaced
        self._closed = threading.Event()
        self.reconnects = 0  # successful reconnect + rejoin
        self.lost: str | None = None  # why rejoining was refused, once it was
        # what the pings tell the endpoint of this rank's loss recovery (control.RECOVERY_COUNTERS
        # of the engine at that aggregator; set by the Communicator), None: nothing
        self.report: Callable[[], dict[str, int]] | None = None
        self._watcher = threading.Thread(
            target=self._watch, name=f"hostlib-ctl-r{rank}", daemon=True
        )
        self._watcher.start()

    @property
    def endpoint(self) -> tuple[str, int]:
        return self._client.endpoint

    @property
    def tokens(self) -> dict[str, str]:
        """The job tokens the connection holds (ControlClient.tokens; a reconnect keeps them)."""
        return self._client.tokens

    def request(self, op: str, *, reply_timeout: float = 30.0, **fields: Any) -> dict[str, Any]:
        """ControlClient.request; a broken connection is re-established (and the rank rejoined)
        once, then the request is sent again."""
        client = self._client
        try:
            return client.request(op, reply_timeout=reply_timeout, **fields)
        except ControlConnectionLost:
            if self._closed.is_set() or not self._reconnect(client, attempts=3):
                raise
        return self._client.request(op, reply_timeout=reply_timeout, **fields)

    def close(self) -> None:
        """Stop watching and close the connection."""
        self._closed.set()
        with self._swap:
            self._client.close()

    # --- internals --------------------------------------------------------------------------
    def _watch(self) -> None:
        renewed = time.monotonic()
        while not self._closed.wait(WATCH_INTERVAL):
            if time.monotonic() - renewed >= RENEW_INTERVAL:
                renewed = time.monotonic()
                self._renew()
            client = self._client
            if self.lost is not None or not client._lock.acquire(blocking=False):
                continue  # a request is in flight: it finds a broken connection itself
            try:
                broken = client.peer_closed()
            finally:
                client._lock.release()
            if broken:
                self._reconnect(client, attempts=None)

    def _renew(self) -> None:
        """Ping, renewing the job's lease and telling the endpoint this rank's loss recovery
        counters; a broken connection is left to the watch loop."""
        if self.lost is not None:
            return
        try:  # the report must not stop the pings: they keep the job's lease
            fields = {"recovery": self.report()} if self.report is not None else {}
        except Exception:  # noqa: BLE001 - an engine closing under us; ping without it
            fields = {}
        try:
            self._client.request("ping", reply_timeout=5.0, **fields)
        except RendezvousError:  # ControlConnectionLost too: the loop's peer check reconnects
            pass

    def _reconnect(self, broken: ControlClient, attempts: int | None) -> bool:
        """Replace `broken` by a new connection that has rejoined; False when it could not
        (after `attempts` tries; None: until closed)."""
        wait, tries = BACKOFF[0], 0
        while not self._closed.is_set():
            with self._swap:
                if self._client is not broken:
                    return True  # another thread did it
                try:
                    # the same credentials: rejoin needs the job's token (xdp_agg.ctl.auth)
                    fresh = ControlClient(
                        self.endpoint,
                        timeout=5.0,
                        source_ip=self._source_ip,
                        secret=broken.secret,
                        tokens=broken.tokens,
                    )
                except RendezvousError:
                    fresh = None
                if fresh is not None:
                    try:
                        fresh.request("rejoin", reply_timeout=10.0, **self._identity)
                    except ControlConnectionLost:
                        fresh.close()
                        fresh = None
                    except RendezvousError as e:  # the endpoint answered: it will not take us
                        fresh.close()
                        if self.lost is None:
                            log.warning("control endpoint refused to rejoin: %s", e)
                        self.lost = str(e)
                        return False
                if fresh is not None:
                    broken.close()
                    self._client = fresh
                    self.reconnects += 1
                    log.info("control connection re-established (rejoined %s)", self._identity)
                    return True
            tries += 1
            if attempts is not None and tries >= attempts:
                return False
            if self._closed.wait(wait):
                return False
            wait = min(wait * 2, BACKOFF[1])
        return False
