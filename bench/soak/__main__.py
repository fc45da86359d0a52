"""`python -m bench.soak`: the soak's options, its run, verdicts and report (bench/soak/__init__.py
says what it does)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from . import __doc__ as DOC
from .report import detail, write_report
from .run import SoakOptions, run
from .verdicts import Thresholds, verdicts

D = SoakOptions()  # the defaults


def parse_args(argv=None) -> SoakOptions:
    """The options of the command line, as SoakOptions (exits 2 on a usage error)."""
    ap = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description=DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  sudo python -m bench.soak --minutes 30\n"
        "  sudo python -m bench.soak --minutes 1.5 --interval 5 --report /tmp/soak",
    )
    ap.add_argument("--minutes", type=float, default=D.minutes, help="length of the run")
    ap.add_argument("--report", type=Path, default=D.report, help="report directory")
    ap.add_argument("--interval", type=float, default=D.interval, help="seconds between samples")
    ap.add_argument(
        "--warmup-min", type=float, default=D.warmup_min, help="default: 25%%, at most 5"
    )
    ap.add_argument("--loss", type=float, default=D.loss, help="loss each way on worker links")
    ap.add_argument("--jobs", type=int, default=D.jobs, help="concurrent jobs")
    ap.add_argument("--workers", type=int, default=D.workers, help="workers per job")
    ap.add_argument("--max-mib", type=int, default=D.max_mib, help="largest tensor, MiB")
    ap.add_argument("--elems", type=int, default=D.elems)
    ap.add_argument("--window", type=int, default=D.window)
    ap.add_argument("--mtu", type=int, default=D.mtu)
    ap.add_argument(
        "--rss-growth-mib",
        type=int,
        default=D.rss_growth_mib,
        help="RSS at cycle starts, control endpoint",
    )
    ap.add_argument(
        "--data-path",
        choices=("mixed", "udp", "afxdp"),
        default=D.data_path,
        help="hostlib's data path per job: mixed = AF_XDP for even-numbered jobs, kernel UDP "
        "sockets for the others (both paths in one soak), or one path for all",
    )
    ap.add_argument("--allreduce-timeout", type=float, default=D.allreduce_timeout)
    ap.add_argument("--drain-s", type=float, default=D.drain_s, help="wait for the last all-reduce")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.interval <= 0 or args.jobs < 1 or args.workers < 1:
        ap.error("--minutes, --interval, --jobs and --workers must be positive")
    if (args.jobs * args.workers) > 32:
        ap.error("the testbed has at most 32 workers: --jobs x --workers <= 32")
    return SoakOptions(**vars(args))


def main(argv=None) -> int:
    """Run the soak the command line asks for; 0 when every verdict holds (module docstring)."""
    opts = parse_args(argv)
    if os.geteuid() != 0:
        print("bench.soak: needs root (namespaces, XDP)", file=sys.stderr)
        return 3

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    # SIGTERM (a CI timeout, kill PID) unwinds like an error: the testbed and aggregator go.
    # Only in this process: pyroute2 forks helpers (netns creation) that inherit the handler
    # and are stopped with SIGTERM; unwinding a forked copy of this stack would run the
    # testbed's teardown there and remove the namespaces under the build (seen: a hung build).
    main_pid = os.getpid()

    def on_term(signum, frame):
        if os.getpid() != main_pid:
            os._exit(128 + signum)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    res = run(opts, log)
    try:
        v = verdicts(res, Thresholds(opts.rss_growth_mib))
        write_report(res, v, opts.report)
    except Exception:
        # a long run's data is not lost to a bug in the report's code
        opts.report.mkdir(parents=True, exist_ok=True)
        (opts.report / "soak-raw.json").write_text(json.dumps(res, default=str) + "\n")
        log(f"soak: the report failed; raw results in {opts.report / 'soak-raw.json'}")
        raise
    for k, x in v.items():
        log(f"  {k:28s} {'ok' if x['ok'] else 'FAILED'}: {detail(k, x)}")
    ok = all(x["ok"] for x in v.values())
    log(f"soak {'PASSED' if ok else 'FAILED'}; report in {opts.report}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
