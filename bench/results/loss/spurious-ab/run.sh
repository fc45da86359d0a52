#!/bin/bash
# interleaved: old (8c9b703, before the change, a worktree at /work/wt-ab) vs new (main), 64 MiB, 10 Gbit/s, loss 0, 0.1%, 1%
n=${1:-8}
for i in 1 2; do
  for v in old new; do
    d=/work/main; [ $v = old ] && d=/work/wt-ab
    cd $d && .venv/bin/python -m bench.allreduce --workers $n --links 10gbit --sizes 64MiB --rows throughput --loss 0,0.001,0.01 --reps 3 --no-syscpu --no-profile --out /work/main/bench/results/loss/spurious-ab/$n-$v-$i > /work/main/bench/results/loss/spurious-ab/$n-$v-$i.log 2>&1
    echo "$v $i $(uptime)"; grep -A8 "Under loss" /work/main/bench/results/loss/spurious-ab/$n-$v-$i/results.md | grep "^| $n |" | cut -d'|' -f8-10,14-17
  done
done
