"""`make soak` / `python -m bench.soak --minutes M --report DIR`: a long run that must stay exact
and flat.

Two jobs at once on one XDP aggregator, n workers each (default 4: 8 worker namespaces on a
one-arm testbed), 1% loss both ways on every worker link (the testbed's nftables loss), each
rank one long-lived bench.soak_worker process that all-reduces mixed sizes (1 KiB to 32 MiB,
int32 and float32, see bench.soak_worker.SIZES) until the time is up, checking every result:
int32 bit-exact, float32 within the block-scaling bound around the float64 sum.

Data paths (--data-path): "mixed" (the default) runs every even-numbered job's workers on
AF_XDP sockets and the others on kernel UDP sockets, so that one soak covers both of hostlib's
paths at once; "udp" or "afxdp" puts every job on one. A rank that did not get the path its job
asked for (hostlib falls back silently to UDP, with the reason in comm.stats) fails the
`data_paths` verdict. AF_XDP frames skip the worker's own nftables hooks, so whenever a job runs
on AF_XDP the loss sits on the bridge's worker ports (netns_testbed.faults.port_loss_script),
both ways, for every job alike, instead of on the workers' eth0.

Every --interval seconds (default 30) it samples: each worker's and the control endpoint's RSS
and open file descriptors (/proc/PID/status, /proc/PID/fd), the aggregator's map memory
(bpftool on every pinned map: memlock bytes, and key+value size x entries) and pinned map and
program count, the namespaces of the testbed, the pins, the jobs and slots in use (xdp-agg job
list), the aggregator's drop counters (xdp-agg stats), all-reduces done, throughput and
retransmissions since the last sample. A progress line per sample goes to stderr.

At the end the workers stop together (bench.soak_worker), the jobs must disappear from the
aggregator, then the aggregator is detached and the testbed removed, and nothing may be left:
no namespace of the testbed, no pin under /sys/fs/bpf/xdp-agg/NAME, no state file, no job, no
slot, no process. Flatness verdicts, after a warm-up (--warmup-min, default 25% of the run, at
most 5 minutes):
- RSS (rss_flat): per worker, its RSS at the start of each cycle of sizes (read by the worker
  itself when no tensor is alive: the comparable points), and the control endpoint's sampled
  RSS; the largest value of the second half of the post-warm-up series exceeds the largest of
  the first half by at most --rss-growth-mib (default 16 MiB); a fitted slope is reported too;
  (the workers' RSS sampled from /proc any time is reported too, without a verdict: it swings
  by several times the tensor in flight with the phase of the sample);
- file descriptors: per process (sampled), the second half's least value is no larger than the
  first half's (a descriptor open for a moment is no leak; one that stays raises the least);
- map memory and pinned map count: the same in every sample.

Writes DIR/summary.md (configuration, results, verdicts, the time series as a table),
DIR/samples.csv and DIR/soak.json (everything). Exit status 0 when every result is right and
every verdict holds, 1 otherwise (2: usage, 3: not root).

The parts: bench.soak.run (the testbed, the workers and the watch loop, as SoakOptions says),
bench.soak.probes (what one sample reads: /proc, bpftool, the pins, the namespaces),
bench.soak.verdicts (every check, judged with Thresholds) and bench.soak.report (summary.md,
samples.csv, soak.json); `python -m bench.soak` (bench/soak/__main__.py) parses the options.
"""
