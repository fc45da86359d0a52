"""The control side beside every aggregator target: the Backend contract and the control endpoint.

Modules: backend (the job/worker vocabulary every target speaks, and the checks every target
makes, written once), server (the control endpoint `xdp-agg serve` runs: jobs, registration,
the barrier), soft_aggregator (the reference model as a UDP aggregator, for tests without root),
bmv2_backend (the P4 program in simple_switch), p4gen (the P4 program's generated parts).
The XDP target's Backend is xdp_switch.aggregator.XdpBackend, one layer up.
"""
