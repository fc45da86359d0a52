#!/bin/bash
# interleaved `xdp-agg bench --repeats 5 --json`, 3 runs per tree: run-cli.sh OUT tree... where
# each tree is a worktree /work/wt-<tree> with its .venv (e6c213a: old; 5feb14f: s5; main)
out=$1; shift
mkdir -p "$out"
for i in 1 2 3; do
  for w in "$@"; do
    (cd /work/wt-$w && .venv/bin/python -m xdp_agg.app.cli bench --repeats 5 --json \
      > "$out/$w-$i.json" 2> "$out/$w-$i.err"
     echo "$w $i rc $? $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)")
  done
done
