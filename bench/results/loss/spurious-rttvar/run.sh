#!/bin/bash
# A: evidence at 2 srtt (3b93868); R: at max(2 srtt, srtt + 4 rttvar), switched by XA_EXP_RTTVAR in a build made for
# this comparison only (the switch is not in the repository; 32931dd is R without it)
cd /work/main
for i in 1 2; do
  for v in A R; do
    if [ $v = R ]; then export XA_EXP_RTTVAR=1; else unset XA_EXP_RTTVAR; fi
    .venv/bin/python -m bench.allreduce --workers 8 --links 10gbit --sizes 64MiB --rows throughput --loss 0,0.01 --reps 3 --no-syscpu --no-profile --out /tmp/l51/ab4-$v-$i > /tmp/l51/ab4-$v-$i.log 2>&1
    echo "$v $i $(uptime)"; grep -A6 "Under loss" /tmp/l51/ab4-$v-$i/results.md | grep "^| 8 |" | cut -d'|' -f8-10,14-17
  done
done
