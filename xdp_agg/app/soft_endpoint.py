"""`python -m xdp_agg.app.soft_endpoint`: a control endpoint in front of a soft aggregator, by hand.

    python -m xdp_agg.app.soft_endpoint --listen 127.0.0.1:48800 --soft 127.0.0.1
    python -m xdp_agg.app.soft_endpoint --soft 127.0.0.1 --metrics 127.0.0.1:9464   # + Prometheus

The secret: --secret-file, $XDP_AGG_SECRET_FILE, else ./xdp-agg-soft.secret, created 0600.
"""

from __future__ import annotations

import argparse
import logging
import os

from xdp_agg.ctl.endpoint import stand_up
from xdp_agg.ctl.server import ServerDefaults
from xdp_agg.proto import control
from xdp_agg.proto.jobs import DEFAULT_CONTROL_PORT
from xdp_agg.proto.limits import DEFAULT_POOL_SLOTS
from xdp_agg.targets.soft import SoftAggregator

from . import serving

log = logging.getLogger("xdp_agg.app.soft_endpoint")


def main(argv: list[str] | None = None) -> None:
    """A control endpoint in front of a SoftAggregator, until interrupted."""
    p = argparse.ArgumentParser(
        prog="python -m xdp_agg.app.soft_endpoint", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--listen",
        default=None,
        help="HOST:PORT (TCP); default: the --soft address, port 48800",
    )
    p.add_argument(
        "--soft",
        default="127.0.0.1",
        metavar="IP",
        help="run a SoftAggregator bound to IP (ports 0xBEE0..0xBEEF as jobs need)",
    )
    p.add_argument("--pool-slots", type=int, default=DEFAULT_POOL_SLOTS)
    p.add_argument("--barrier-timeout", type=float, default=120.0)
    p.add_argument(
        "--secret-file",
        default=os.environ.get(control.SECRET_ENV),
        help=f"the deployment secret (created 0600 when absent); default ${control.SECRET_ENV}, "
        "else ./xdp-agg-soft.secret",
    )
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="accept every request without credentials (a trusted lab only)",
    )
    p.add_argument(
        "--metrics",
        default=None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (xdp_agg.app.metrics; needs "
        "prometheus_client)",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    host, _, port = (args.listen or f"{args.soft}:{DEFAULT_CONTROL_PORT}").rpartition(":")
    if host == "0.0.0.0":
        log.warning("listening on every address (0.0.0.0), as --listen asked")
    secret = None
    if not args.insecure_no_auth:
        path = os.path.abspath(args.secret_file or "xdp-agg-soft.secret")
        try:
            secret = control.create_secret(path)
        except control.SecretError as e:
            p.error(str(e))
        log.info("deployment secret: %s (give workers %s=%s)", path, control.SECRET_ENV, path)
    defaults = ServerDefaults(
        agg_ip=args.soft, pool_slots=args.pool_slots, barrier_timeout=args.barrier_timeout
    )
    metrics_at = None
    if args.metrics:
        m_host, _, m_port = args.metrics.rpartition(":")
        metrics_at = (m_host, int(m_port))
    with SoftAggregator(args.soft) as agg:
        server, _ = stand_up(agg, host, int(port), defaults, secret=secret)
        log.info("control endpoint on %s:%d, soft aggregator on %s", *server.address, args.soft)
        sources = dict(backend=agg, target="soft", endpoint=server)
        with serving.metrics_exporting(metrics_at, sources) as url:
            if url:
                log.info("Prometheus metrics at %s", url)
            server.run_until_interrupted()


if __name__ == "__main__":
    main()
