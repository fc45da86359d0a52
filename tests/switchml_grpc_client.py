"""An independent p4app-switchML host's control plane, and its data as two threads send it: the
gRPC calls of DpdkBackend::SetupSwitch in their order, and each thread's requests built by
tests/p4app_host.py (BuildPacket), for the replay tests of `xdp-agg serve --switchml-grpc`.

Sources, p4lang/p4app-switchML at b5c74a04fa66faa82acab154a4e21c8f76d913f2 (2022-07-14):
- dev_root/client_lib/src/backends/dpdk/dpdk_backend.cc lines 70-140: rank 0 picks a session id
  (a nanosecond timestamp), everyone calls Broadcast(value, rank, num_workers, root=0) and takes
  its value; the UdpSession request carries the session id, rank, num_workers, the worker's MAC
  and IPv4 as integers, most significant octet first (ChangeMacEndianness, dpdk_utils.cc lines
  79-82; rte_be_to_cpu_32), and the packet size category of packet_numel (lines 106-116); rank 0
  calls UdpSession then Barrier, every other rank Barrier then UdpSession (lines 122-131); the
  switch's MAC and IPv4 are the answer's, its port 48864 (line 136); then all call Barrier
  (line 139);
- dpdk_worker_thread.cc lines 66-70 and 93-94: thread t sends from worker_port + t and uses the
  pool indices from 2 * (max_outstanding_packets / threads) * t
  (dpdk_worker_thread_utils.inc lines 42-52: the second half of its range sets bit 15 instead).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np
from harness import p4app_host

from xdp_agg.ctl import switchml_proto as pb
from xdp_agg.ctl.switchml_grpc import mac_text, mac_value


def call(channel: grpc.Channel, service: str, method: str):
    req, resp = pb.SERVICES[service][method]
    return channel.unary_unary(
        pb.method_path(service, method),
        request_serializer=pb.message_class(req).SerializeToString,
        response_deserializer=pb.message_class(resp).FromString,
    )


class Relay:
    """A TCP relay on 127.0.0.1 that connects to `target` (HOST, PORT) from `source`, an address
    of this host (any 127.x.y.z on loopback, no root needed): the controller sees the caller's
    gRPC peer address as `source`, as it would see a p4app host on its own address. One
    upstream connection per accepted connection, bytes copied both ways."""

    def __init__(self, target: tuple[str, int], source: str) -> None:
        self.target, self.source = target, source
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self._listener.getsockname()[1]
        self._socks: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
                up = socket.create_connection(self.target, source_address=(self.source, 0))
            except OSError:  # closed
                return
            self._socks += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def _pump(a: socket.socket, b: socket.socket) -> None:
    """Copy a's bytes to b until a ends; then end b's sending side."""
    try:
        while data := a.recv(65536):
            b.sendall(data)
        b.shutdown(socket.SHUT_WR)
    except OSError:
        pass


@contextlib.contextmanager
def channel(target: str, source: str | None = None):
    """A channel to the controller at `target` (HOST:PORT) with its own connection, as each p4app
    process has (one GrpcClient per rank: grpc_client.cc lines 99-107), from `source` (through a
    Relay) when given; no proxy from the environment: the controller is on the test's network."""
    relay = None
    if source is not None:
        host, port = target.rsplit(":", 1)
        relay = Relay((host, int(port)), source)
        target = relay.address
    options = [("grpc.enable_http_proxy", 0), ("grpc.use_local_subchannel_pool", 1)]
    try:
        with grpc.insecure_channel(target, options=options) as ch:
            yield ch
    finally:
        if relay is not None:
            relay.close()


@dataclass
class Switch:
    """What SetupSwitch learned: the session id and the switch's end-to-end address."""

    session_id: int
    mac: str
    ip: str
    port: int = p4app_host.SWITCH_PORT


def packet_size(packet_numel: int) -> int:
    """pkt_len_enum of dpdk_backend.cc lines 106-116."""
    return p4app_host.size_code(packet_numel)


def udp_session_request(
    session_id: int, *, rank: int, world: int, mac: str | int, ip: str, packet_numel: int
):
    """The UdpSessionRequest of dpdk_backend.cc lines 97-116 (`mac` as text, or the integer a
    caller puts there)."""
    return pb.UdpSessionRequest(
        session_id=session_id,
        rank=rank,
        num_workers=world,
        mac=mac if isinstance(mac, int) else mac_value(mac),
        ipv4=int(ipaddress.IPv4Address(ip)),
        packet_size=packet_size(packet_numel),
    )


def setup_switch(
    target: str,
    *,
    rank: int,
    world: int,
    mac: str,
    ip: str,
    packet_numel: int,
    timeout=60.0,
    source: str | None = None,
) -> Switch:
    """DpdkBackend::SetupSwitch against the controller at `target` (HOST:PORT), in its order,
    on one connection (from `source` when given: channel)."""
    with channel(target, source) as ch:
        session_id = time.time_ns() if rank == 0 else 0
        bcast = call(ch, "Sync", "Broadcast")(
            pb.BroadcastRequest(value=session_id, rank=rank, num_workers=world, root=0),
            timeout=timeout,
        )
        session_id = bcast.value
        request = udp_session_request(
            session_id, rank=rank, world=world, mac=mac, ip=ip, packet_numel=packet_numel
        )
        barrier = pb.BarrierRequest(num_workers=world)
        udp_session, sync = call(ch, "Session", "UdpSession"), call(ch, "Sync", "Barrier")
        if rank == 0:
            response = udp_session(request, timeout=timeout)
            sync(barrier, timeout=timeout)
        else:
            sync(barrier, timeout=timeout)
            response = udp_session(request, timeout=timeout)
        sync(barrier, timeout=timeout)
    return Switch(session_id, mac_text(response.mac), str(ipaddress.IPv4Address(response.ipv4)))


def thread_values(seed: int, rank: int, thread: int, per_thread: int, k: int):
    """The int32 values (per_thread x k) and the exponent thread `thread` of rank `rank`
    contributes in a test run seeded `seed` (the worker and the test compute the same)."""
    rng = np.random.default_rng([seed, rank, thread])
    return rng.integers(-(2**20), 2**20, size=(per_thread, k)), int(rng.integers(-5, 5))


def expected(seed: int, world: int, thread: int, per_thread: int, k: int):
    """The sums (per_thread x k, int32) and the max exponent thread `thread`'s slots get."""
    got = [thread_values(seed, r, thread, per_thread, k) for r in range(world)]
    total = sum(v for v, _ in got).astype(np.int32)
    return total, max(e for _, e in got)


def thread_slots(t: int, per_thread: int) -> list[int]:
    """The pool indices thread t uses first (PktId2PoolIndex with shift 0: version 0)."""
    start = 2 * per_thread * t
    return [start + i for i in range(per_thread)]


def requests(
    *,
    mac: str,
    ip: str,
    switch: Switch,
    thread: int,
    worker_port: int,
    per_thread: int,
    values,
    exponent: int = 0,
) -> list[tuple[int, bytes]]:
    """(pool index, frame) of each of thread `thread`'s first packets, values[i] the i-th's."""
    me = p4app_host.Endpoint(mac, ip, worker_port + thread)
    there = p4app_host.Endpoint(switch.mac, switch.ip, switch.port)
    return [
        (
            slot,
            p4app_host.build_packet(
                worker=me,
                switch=there,
                job_id=0,
                pkt_id=i,
                pool_index=slot,
                values=values[i],
                exponent=exponent,
            ),
        )
        for i, slot in enumerate(thread_slots(thread, per_thread))
    ]
