"""The test harness, loaded as pytest plugins (tests/conftest.py): the rank runner over one or k
soft aggregators (ranks), the two-CPU driver of the XDP program (cpus), the CLI runner (cli), the
bmv2 switch with veths for the P4 tests (p4)."""
