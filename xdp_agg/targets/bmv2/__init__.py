"""The bmv2 target: the P4 twin of the XDP aggregator, run in simple_switch. Three parts, from
the bottom: the toolchain (the P4 sources, p4c, where the tools are), the switch process
(simple_switch and its CLI), and the Backend on top of it (xdp_agg.targets.bmv2.backend, with
launch).
"""

from .backend import FLOOD_MGID, Bmv2Backend, job_mgid, launch
from .switch import DEFAULT_THRIFT_PORT, PortSpec, SimpleSwitch, SwitchCLI, port_specs
from .toolchain import (
    DEFAULT_POOL_SLOTS,
    P4_DIR,
    P4_MAIN,
    TOOLS,
    Bmv2Error,
    cli_python,
    compile_p4,
    missing_tools,
)

__all__ = [
    "DEFAULT_POOL_SLOTS",
    "DEFAULT_THRIFT_PORT",
    "FLOOD_MGID",
    "P4_DIR",
    "P4_MAIN",
    "TOOLS",
    "Bmv2Backend",
    "Bmv2Error",
    "PortSpec",
    "SimpleSwitch",
    "SwitchCLI",
    "cli_python",
    "compile_p4",
    "job_mgid",
    "launch",
    "missing_tools",
    "port_specs",
]
