"""xdp-agg's own packages, one namespace: the protocol (proto), the C and P4 code generated from it
(codegen), the BPF system calls (bpfsys), the errors every layer raises (errors), the control
side (ctl), the soft and bmv2 targets (targets), the application (app) and orchestration
(cluster). The XDP target (xdp_switch), the host library (hostlib) and the testbed
(netns_testbed) keep their own names. Importing this package imports none of them: the layers
below an application import only what they use (tests/house/test_layers.py).
"""
