"""The bmv2 target's toolchain: the P4 sources (package data), p4c-bm2-ss to compile them, and
where the bmv2 tools and the interpreter that runs simple_switch_CLI are.

simple_switch_CLI is a Python script that needs the `thrift` module, which Debian ships for its
own /usr/bin/python3 (python3-thrift); the CLI is therefore run with that interpreter (override
with XDP_AGG_BMV2_PYTHON) rather than through its `#!/usr/bin/env python3` line, which may find
another Python first on PATH.
"""

from __future__ import annotations

import importlib.resources
import os
import shutil
import subprocess
from pathlib import Path

# The P4 sources are package data: xdp_agg/targets/bmv2/p4 links to the repository's top-level p4/
# in a checkout and is a copy of it in a wheel.
P4_DIR = Path(str(importlib.resources.files("xdp_agg.targets.bmv2") / "p4"))


P4_MAIN = P4_DIR / "switchml.p4"


DEFAULT_POOL_SLOTS = 1024  # must match POOL_SLOTS the program was compiled with


TOOLS = {
    "p4c": "p4c-bm2-ss",  # the bmv2 simple_switch back end of p4c
    "switch": "simple_switch",
    "cli": "simple_switch_CLI",
}


class Bmv2Error(RuntimeError):
    """A bmv2 tool failed; the message carries its output."""


def missing_tools() -> list[str]:
    """The bmv2 tools not found on PATH (empty when everything is there)."""
    return [name for name in TOOLS.values() if shutil.which(name) is None]


def cli_python() -> str:
    """The interpreter simple_switch_CLI runs with: one that has the thrift module."""
    env = os.environ.get("XDP_AGG_BMV2_PYTHON")
    if env:
        return env
    return "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"


def which_tool(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise Bmv2Error(
            f"{tool} is not on PATH: install p4c and bmv2 (p4/README.md, 'The toolchain')"
        )
    return path


def netns_argv_prefix(netns: str | None) -> list[str]:
    # nsenter rather than `ip netns exec`: the latter remounts /sys, which we do not need.
    return [] if netns is None else ["nsenter", f"--net=/var/run/netns/{netns}"]


def compile_p4(
    out_dir, *, pool_slots: int = DEFAULT_POOL_SLOTS, source: Path = P4_MAIN, timeout: float = 300.0
) -> Path:
    """Compile the v1model program with p4c-bm2-ss; returns the path of the bmv2 JSON."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / (Path(source).stem + ".json")
    # --Wdisable=unused: the generated includes define every wire constant, used or not.
    argv = [
        which_tool(TOOLS["p4c"]),
        "--std",
        "p4-16",
        "--Wdisable=unused",
        f"-DPOOL_SLOTS={int(pool_slots)}",
        "-o",
        str(out),
        str(source),
    ]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise Bmv2Error(f"p4c failed ({r.returncode}):\n{r.stderr}{r.stdout}")
    return out
