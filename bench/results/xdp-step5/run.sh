#!/bin/bash
# interleaved XDP per-packet bench: old main (e6c213a) vs current main
for i in 1 2 3; do
  for w in old main; do
    d=/work/wt-$w; [ $w = main ] && d=/work/main
    (cd $d && .venv/bin/python -m xdp_agg.app.cli bench --repeats 5 --json > /tmp/xb-$w-$i.json 2>/tmp/xb-$w-$i.err; echo "$w $i rc $?")
  done
done
