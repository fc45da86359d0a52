"""The `xdp-agg` CLI's help, exit codes and messages (no root needed, except to start a child as
uid 65534)."""

import pytest
import unprivileged
from click.testing import CliRunner

from xdp_switch import cli


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.setenv("XDP_AGG_PIN_ROOT", str(tmp_path / "bpf" / "xdp-agg"))
    monkeypatch.setenv("XDP_AGG_STATE_DIR", str(tmp_path / "run"))
    runner = CliRunner()
    return lambda *args: runner.invoke(cli.main, list(args))


def test_help_has_examples_and_exit_codes(run):
    r = run("--help")
    assert r.exit_code == 0
    assert "sudo xdp-agg attach eth0" in r.output and "Exit codes" in r.output
    for verb in ("attach", "detach", "status", "stats", "job", "worker", "slots", "bench"):
        assert verb in r.output
    assert "Example" in run("job", "create", "--help").output


def test_not_root_is_an_environment_error(run, monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    r = run("attach", "eth0")
    assert r.exit_code == cli.EXIT_ENV
    assert "run with sudo" in r.output


@pytest.mark.root
@pytest.mark.as_nobody
def test_not_root_message_as_nobody():
    """`xdp-agg attach` started by uid 65534 (a real non-root process, not a faked uid) exits with
    the environment code and the hint, not a traceback; the child imports from a readable copy
    (tests/unprivileged.py), so this works wherever the checkout is."""
    with unprivileged.readable_copy("xdp_switch.cli") as copy:
        cp = unprivileged.run_as_nobody(copy, "xdp_switch.cli", "attach", "eth0")
    assert cp.returncode == cli.EXIT_ENV, cp.stderr
    assert "run with sudo" in cp.stderr
    assert "Traceback" not in cp.stderr


def test_nothing_attached_says_what_to_do(run):
    r = run("status")
    assert r.exit_code == cli.EXIT_FAILED
    assert "xdp-agg attach" in r.output


def test_usage_errors_exit_2(run):
    assert run("job", "create", "0", "--workers", "2", "--elems", "100").exit_code == cli.EXIT_USAGE
    assert run("job", "create", "99", "--workers", "2").exit_code == cli.EXIT_USAGE
    assert run("worker", "add", "0").exit_code == cli.EXIT_USAGE


def test_group_mac():
    assert cli.group_mac_for("239.1.2.3") == "01:00:5e:01:02:03"
    assert cli.group_mac_for("198.18.0.255") == "ff:ff:ff:ff:ff:ff"
