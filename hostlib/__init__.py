"""xdp-agg host library: all-reduce through an in-network (or soft) aggregator.

    import hostlib
    with hostlib.init(rank, world_size, aggregator="198.18.0.1:48800", job="run-7") as comm:
        total = comm.allreduce(gradients)

Modules: communicator (init, Communicator, the public API), engine (the self-clocked packet
stream), striping (a job over several aggregators), scaling (block floating point for floats),
udp_io (GSO/GRO batched sockets), rendezvous (control endpoint client), netinfo (own address and
MAC), errors.
"""

from .communicator import AllreduceHandle, Communicator, init
from .engine import STAT_NAMES, Faults
from .errors import AllreduceTimeout, AuthError, HostlibError, LimitError, RendezvousError

__all__ = [
    "init",
    "Communicator",
    "AllreduceHandle",
    "Faults",
    "STAT_NAMES",
    "HostlibError",
    "RendezvousError",
    "AuthError",
    "LimitError",
    "AllreduceTimeout",
]
