"""The `xdp-agg` CLI's help, exit codes and messages (no root needed, except to start a child as
uid 65534)."""

import subprocess
import sys
from pathlib import Path

import pytest
import unprivileged
from harness.cli import invoke

from xdp_agg.app import cli, serving
from xdp_agg.errors import EnvironmentProblem, NeedsRoot, Refused, XdpAggError
from xdp_switch import backend as xdp_backend
from xdp_switch import pins

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def run(xdp_agg):
    """`xdp-agg ARGS` with the pins and state under tmp_path (the harness's CLI runner)."""
    return xdp_agg


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
    with unprivileged.readable_copy("xdp_agg.app.cli") as copy:
        cp = unprivileged.run_as_nobody(copy, "xdp_agg.app.cli", "attach", "eth0")
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
    assert serving.group_mac_for("239.1.2.3") == "01:00:5e:01:02:03"
    assert serving.group_mac_for("198.18.0.255") == "ff:ff:ff:ff:ff:ff"


def test_success_exits_0(run, monkeypatch):
    monkeypatch.setattr(
        xdp_backend, "stats", lambda name: {"unattributed": {"pass": 3}, "jobs": {}}
    )
    r = run("stats", "--json")
    assert r.exit_code == cli.EXIT_OK == 0, r.output
    assert '"pass": 3' in r.output
    assert run("--version").exit_code == 0


@pytest.mark.parametrize(
    "error,code",
    [
        (XdpAggError, cli.EXIT_FAILED),
        (Refused, cli.EXIT_FAILED),
        (pins.NotAttached, cli.EXIT_FAILED),
        (EnvironmentProblem, cli.EXIT_ENV),
        (NeedsRoot, cli.EXIT_ENV),
    ],
)
def test_exit_code_comes_from_the_error_class(run, monkeypatch, error, code):
    """The code is the class's, whatever the message says: a failure whose text mentions sudo
    stays 1, an environment problem with any text is 3."""
    misleading = "needs root: run with sudo; no bpffs; no BPF objects"
    exc = error("x", Path("/nowhere")) if error is pins.NotAttached else error(misleading)
    if error is NeedsRoot:
        exc = NeedsRoot("looking")

    def fail(name):
        raise exc

    monkeypatch.setattr(xdp_backend, "status", fail)
    r = run("status")
    assert r.exit_code == code == error.exit_code
    assert r.output.startswith("xdp-agg: ") and "Traceback" not in r.output


def test_environment_problems_exit_3(run, monkeypatch, tmp_path):
    from xdp_switch import bpfbuild

    monkeypatch.setattr(pins, "bpffs_mounted", lambda path=None: False)
    monkeypatch.setattr("os.geteuid", lambda: 0)
    monkeypatch.setattr(xdp_backend.links, "xdp_prog_id", lambda ifname: 0)
    monkeypatch.setattr(xdp_backend.links, "addresses", lambda ifname: {"ifname": ifname})
    assert run("attach", "eth0").exit_code == cli.EXIT_ENV  # no bpffs
    monkeypatch.setattr(bpfbuild, "in_checkout", lambda: False)  # as installed, but unbuilt
    monkeypatch.setattr(bpfbuild, "OBJ_DIR", tmp_path)
    assert run("bench").exit_code == cli.EXIT_ENV  # no BPF objects


def test_refused_job_exits_1(run, monkeypatch):
    """A spec the Backend contract refuses (a ValueError from check_job) is a failure, 1."""

    class FakeBackend:
        state = pins.State(
            "default", "one-arm", "native", None, [{"ifname": "eth0"}], 64, 1, 2, 0.0
        )

        def __init__(self, name):
            pass

        def create_job(self, spec):
            raise Refused(f"slots {spec.slot_base}.. are outside the pool of 64")

    monkeypatch.setattr(xdp_backend, "XdpBackend", FakeBackend)
    monkeypatch.setattr(
        serving.links, "addresses", lambda ifname: {"ipv4": [], "mac": "02:00:00:00:00:01"}
    )
    r = run("job", "create", "0", "--workers", "2", "--slots", "60:8")
    assert r.exit_code == cli.EXIT_FAILED, r.output
    assert "outside the pool" in r.output


def test_bad_addresses_are_usage_errors(run):
    assert (
        run("job", "create", "0", "--workers", "2", "--group", "198.18.0").exit_code
        == cli.EXIT_USAGE
    )
    assert run("worker", "add", "0", "0", "not-an-ip").exit_code == cli.EXIT_USAGE
    assert run("serve", "--listen", "0.0.0.0").exit_code == cli.EXIT_USAGE
    assert run("--name", "../x", "status").exit_code == cli.EXIT_USAGE


def test_unexpected_exception_shows_a_traceback(run, monkeypatch):
    """A bug is not dressed up as a failure: the exception reaches the user with its traceback."""
    monkeypatch.setattr(xdp_backend, "status", lambda name: {}["no such key"])
    r = run("status")
    assert isinstance(r.exception, KeyError)  # not SystemExit: click did not swallow it
    code = (
        "import xdp_switch.backend as a; a.status = lambda name: 1 / 0\n"
        "from xdp_agg.app.cli import main; main(['status'])"
    )
    cp = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
        timeout=60,
    )
    assert cp.returncode == 1
    assert "Traceback (most recent call last)" in cp.stderr and "ZeroDivisionError" in cp.stderr


def test_state_file_vocabulary():
    """The state file says "topology" (the testbed's word) and "xdp_mode"; a file without
    "topology" is not one this version reads."""
    from netns_testbed import plan

    assert pins.TOPOLOGIES == tuple(plan.TOPOLOGIES)
    assert set(xdp_backend.DELIVERY) == set(pins.TOPOLOGIES)
    new = pins.State("a", "switch", "skb", None, [], 64, 1, 2, 0.0).to_dict()
    assert new["topology"] == "switch" and new["xdp_mode"] == "skb" and "mode" not in new
    old = {**new, "mode": "one-arm"}
    del old["topology"]
    with pytest.raises(TypeError, match="topology"):
        pins.State.from_dict(old)


def test_state_file_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("XDP_AGG_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("XDP_AGG_PIN_ROOT", str(tmp_path / "pins"))
    inst = pins.Instance("rt")
    with pytest.raises(pins.NotAttached):
        inst.load_state()
    st = pins.State("rt", "one-arm", "native", "agg", [{"ifname": "eth0"}], 64, 1, 2, 0.0)
    inst.save_state(st)
    assert inst.load_state() == st


@pytest.mark.parametrize("prog", ["xdp-agg", "netns-testbed"])
def test_shell_completion(prog):
    """click's completion, as docs/operations.md tells users to enable it: the bash script, and
    the completions it asks for (here: the verbs starting with "st")."""
    var = f"_{prog.replace('-', '_').upper()}_COMPLETE"
    script = invoke(prog, env={var: "bash_source"})
    assert (
        script.exit_code == 0
        and f"complete -o nosort -F _{prog.replace('-', '_')}_completion" in script.output
    )
    words = invoke(prog, env={var: "bash_complete", "COMP_WORDS": f"{prog} st", "COMP_CWORD": "1"})
    assert "plain,status" in words.output.splitlines()
