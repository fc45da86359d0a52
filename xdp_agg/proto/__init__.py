"""The protocol, at the bottom of every layer: what every aggregator target and host agree on.

Modules: wire (the bytes on the wire, defined once: C, P4 and scapy are generated from it),
limits (jobs, workers, ports, pool), reasons (why a packet took its path: the counters of every
target), keys (the formulas that index the aggregator's tables), jobs (the job and worker
description the control endpoint and the hosts exchange), model (the serial reference state
machine), scapy_layer (the wire format as scapy layers). Nothing here imports another package of
this project.
"""
