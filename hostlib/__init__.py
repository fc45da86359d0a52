"""xdp-agg host library: all-reduce through an in-network (or soft) aggregator.

    import hostlib
    with hostlib.init(rank, world_size, "198.18.0.1:48800", "run-7") as comm:
        total = comm.allreduce(gradients)

    opts = hostlib.HostOptions.from_env(window=32)      # options as data; the environment's
    comm = hostlib.init(rank, world_size, "198.18.0.1:48800", "run-7", opts)

Modules: communicator (init, Communicator, the public API), options (HostOptions, the one
reader of the XDP_AGG_* environment), engine (the self-clocked packet stream; its Faults is
the tests' loss generator), striping (a job over several aggregators), scaling (block floating
point for floats), udp_io (GSO/GRO batched sockets), rendezvous (control endpoint client),
netinfo (own address and MAC), diagnosis (a timeout's explanation), errors.
"""

from .communicator import AllreduceHandle, Communicator, init
from .engine import STAT_NAMES
from .errors import AllreduceTimeout, AuthError, HostlibError, LimitError, RendezvousError
from .options import HostOptions

__all__ = [
    "init",
    "Communicator",
    "AllreduceHandle",
    "HostOptions",
    "STAT_NAMES",
    "HostlibError",
    "RendezvousError",
    "AuthError",
    "LimitError",
    "AllreduceTimeout",
]
