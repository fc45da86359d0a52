"""The soft target: the serial reference model (xdp_agg.proto.model) as a UDP aggregator on ordinary
sockets, for tests and demos without root (xdp_agg.targets.soft.backend.SoftAggregator)."""

from .backend import SoftAggregator

__all__ = ["SoftAggregator"]
