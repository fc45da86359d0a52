"""Orchestration on top of every layer: a testbed, an attached aggregator, its control endpoint
and worker processes (cluster, cluster_worker), and the demo that runs them (demo)."""
