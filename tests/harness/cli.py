"""The CLI runner: `xdp-agg` and `netns-testbed` run in this process through click's CliRunner,
so that a test sees the exit code and everything printed, and can monkeypatch what the command
calls."""

from __future__ import annotations

import pytest
from click.testing import CliRunner, Result

from netns_testbed import cli as testbed_cli
from xdp_agg.app import cli as agg_cli

PROGRAMS = {"xdp-agg": agg_cli.main, "netns-testbed": testbed_cli.main}


def invoke(program: str, *args: str, env: dict | None = None, **kw) -> Result:
    """Run `program ARGS...` (a name in PROGRAMS); click's Result (exit_code, output)."""
    return CliRunner().invoke(PROGRAMS[program], list(args), env=env, prog_name=program, **kw)


def xdp_agg_cli(*args: str, env: dict | None = None, **kw) -> Result:
    """Run `xdp-agg ARGS...`."""
    return invoke("xdp-agg", *args, env=env, **kw)


def run_testbed_cli(*args: str, env: dict | None = None, **kw) -> Result:
    """Run `netns-testbed ARGS...`."""
    return invoke("netns-testbed", *args, env=env, **kw)


@pytest.fixture
def xdp_agg(tmp_path, monkeypatch):
    """xdp_agg_cli with the pins and state files under tmp_path: nothing the command writes or
    reads is the machine's."""
    monkeypatch.setenv("XDP_AGG_PIN_ROOT", str(tmp_path / "bpf" / "xdp-agg"))
    monkeypatch.setenv("XDP_AGG_STATE_DIR", str(tmp_path / "run"))
    return xdp_agg_cli
