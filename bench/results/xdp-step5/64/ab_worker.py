"""One tree's side of ab.py: loads one measured case of `xdp-agg bench` (and the floor) once,
then for each line on stdin runs one bench pass of k elements on CPU 0 and prints
"<ns/packet of the case> <ns/packet of the floor>". Run with the tree's own venv, in the tree:
it imports that tree's xdp_switch (e6c213a: bcc; later: the clang objects and libbpf)."""

import os
import sys

from xdp_switch import loader
from xdp_switch import microbench as mb

case, k = sys.argv[1], int(sys.argv[2])
os.sched_setaffinity(0, {0})
close_floor, floor_fd = mb._load_floor()
variant = "spinlock" if case == "spinlock" else "percpu"
extra = {"frags": True} if case == mb.FRAGS_CASE else {}
prog = loader.load(pool_slots=64, variant=variant, **extra)
kind = {mb.CHECKSUM_CASE: "csum", mb.UNICAST_CASE: "unicast"}.get(case, "group")
n, slots, rounds = 4, 64, 20
frames = mb.stream(k, n, slots, rounds, udp_checksum=kind == "csum")
plain = mb.stream(k, n, slots, rounds)
print("ready", flush=True)
for _ in sys.stdin:
    p = mb.measure_pass(prog, k, n, slots, rounds, frames, kind)
    print(f"{p} {mb.measure(floor_fd, plain)}", flush=True)
prog.close()
