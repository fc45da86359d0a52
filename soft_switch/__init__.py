"""The soft target: the serial reference model (aggproto.model) as a UDP aggregator on ordinary
sockets, for tests and demos without root (soft_switch.backend.SoftAggregator)."""

from .backend import SoftAggregator

__all__ = ["SoftAggregator"]
