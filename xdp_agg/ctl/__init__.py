"""The control side beside every aggregator target: the Backend contract and the control endpoint.

Modules: backend (the job/worker vocabulary every target speaks, and the checks every target
makes, written once), server (the control endpoint `xdp-agg serve` runs: jobs, registration,
the barrier), auth, jobtable (the saved job table), tree (a rack endpoint's join of its parent's
job). The targets are one layer up, side by side:
xdp_switch (XdpBackend), xdp_agg.targets.soft (SoftAggregator), xdp_agg.targets.bmv2 (Bmv2Backend).
"""
