"""The application above every target: the `xdp-agg` command line (cli), serving the control
endpoint in front of a target (serving: the XDP aggregator or the P4 program in bmv2), and the
systemd service (service). Nothing below imports it.
"""
