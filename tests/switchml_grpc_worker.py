"""A p4app-switchML host in a testbed namespace (tests/root/test_switchml_grpc_netns.py): its setup
calls against `xdp-agg serve --switchml-grpc` (switchml_grpc_client.setup_switch), then each of
its threads sends its first packets as BuildPacket frames on the raw interface, as the DPDK
host does (to the switch MAC and address the controller answered), from its own UDP port, and
reads the results on that port. Prints one JSON line: the switch address and, per thread, the
results received (pool index, entries, exponent).

    python switchml_grpc_worker.py TARGET RANK WORLD IP MAC IFNAME THREADS PER_THREAD K SEED
"""

from __future__ import annotations

import json
import socket
import sys

import switchml_grpc_client as client
from harness import p4app_host

WORKER_PORT = 4000  # p4app's default backend.dpdk.worker_port


def main(argv: list[str]) -> None:
    target, rank, world, ip, mac, ifname = argv[0], int(argv[1]), int(argv[2]), *argv[3:6]
    threads, per_thread, k, seed = (int(x) for x in argv[6:10])
    switch = client.setup_switch(target, rank=rank, world=world, mac=mac, ip=ip, packet_numel=k)
    socks = []
    for t in range(threads):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((ip, WORKER_PORT + t))
        s.settimeout(20.0)  # bounds a failure only: the test counts every result
        socks.append(s)
    raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    raw.bind((ifname, 0))
    for t in range(threads):
        values, exponent = client.thread_values(seed, rank, t, per_thread, k)
        for _, frame in client.requests(
            mac=mac,
            ip=ip,
            switch=switch,
            thread=t,
            worker_port=WORKER_PORT,
            per_thread=per_thread,
            values=values,
            exponent=exponent,
        ):
            raw.send(frame)
    results = {}
    for t, s in enumerate(socks):
        got = []
        for _ in range(per_thread):
            payload = s.recv(65536)
            r = p4app_host.read_result(bytes(p4app_host.SML_AT) + payload, k)
            got.append([int.from_bytes(payload[6:8], "big"), r.entries.tolist(), r.exponent])
        results[t] = got
    print(json.dumps({"switch": [switch.session_id, switch.mac, switch.ip], "results": results}))


if __name__ == "__main__":
    main(sys.argv[1:])
