"""The targets besides XDP (xdp_switch): the reference model behind sockets (soft) and the P4
program in bmv2's simple_switch (bmv2), each speaking the Backend protocol (xdp_agg.ctl.backend).
"""
