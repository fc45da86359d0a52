"""The systemd service (xdp_agg/app/service.py): its config file, `service-install`, the unit
(checked with systemd-analyze verify where it is installed), and the commands the unit runs,
tested directly, since systemd is not PID 1 here: `service-start` attaches and serves, then a
small all-reduce goes through it, and `service-stop` leaves nothing behind."""

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from harness.cli import xdp_agg_cli as run_cli

from xdp_agg.app import cli, service
from xdp_agg.app.options import AttachOptions
from xdp_agg.cluster import cluster_worker
from xdp_switch import pins

REPO = Path(__file__).resolve().parents[2]


# --- config ------------------------------------------------------------------------------------
def test_sample_config_parses_to_what_install_service_was_given(tmp_path):
    rep = service.install_files(
        tmp_path,
        "lab",
        ["p0", "p1"],
        listen="198.18.0.1:48801",
        attach=AttachOptions(pool_slots=2048),
        exe="/usr/bin/xdp-agg",
    )
    cfg = service.parse_config(Path(rep["config"]).read_text())
    assert cfg.interfaces == ["p0", "p1"] and cfg.listen == "198.18.0.1:48801"
    assert cfg.attach == AttachOptions(pool_slots=2048)  # the sample's keys are the defaults
    assert cfg.attach_args() == ["p0", "p1", "--pool-slots", "2048"]
    assert cfg.serve_args() == [
        "--listen",
        "198.18.0.1:48801",
        "--secret-file",
        "/etc/xdp-agg/lab.secret",
    ]


def test_config_values_and_quoting():
    cfg = service.parse_config(
        '# comment\nINTERFACES="eth1"\nTOPOLOGY=one-arm\nXDP_MODE=skb\nPOOL_SLOTS=64\n'
        'VARIANT=spinlock\nNETNS=agg\nSERVE_OPTIONS="--udp-checksum --group 239.1.1.1"\n'
    )
    assert (cfg.interfaces, cfg.netns) == (["eth1"], "agg")
    assert cfg.attach == AttachOptions("one-arm", "skb", 64, "spinlock")
    assert cfg.serve_args() == [
        "--udp-checksum",
        "--group",
        "239.1.1.1",
    ]
    assert "--topology" in cfg.attach_args()


def test_an_older_configs_toolchain_key_is_ignored():
    """TOOLCHAIN (bcc or libbpf, before bcc left the attach path): read, and nothing changes."""
    cfg = service.parse_config("INTERFACES=eth1\nTOOLCHAIN=bcc\nVARIANT=spinlock\n")
    assert cfg.attach == AttachOptions(variant="spinlock")
    assert "TOOLCHAIN" not in service.SAMPLE_CONFIG


@pytest.mark.parametrize(
    "text,what",
    [
        ("INTERFACES=\n", "INTERFACES is empty"),
        ("INTERFACES=eth0\nPOOL=3\n", ":2: expected one of"),
        ("INTERFACES=eth0\nTOPOLOGY=ring\n", "TOPOLOGY must be one of one-arm, switch"),
        ("INTERFACES=eth0\nPOOL_SLOTS=0\n", "POOL_SLOTS must be 1..16384"),
        ("INTERFACES=eth0\nXDP_MODE=offload\n", "XDP_MODE must be one of native, skb"),
        ('INTERFACES="eth0\n', "No closing quotation"),
    ],
)
def test_config_errors_name_the_problem(text, what):
    with pytest.raises(service.ConfigError, match=what) as e:
        service.parse_config(text, "x.conf")
    assert e.value.exit_code == cli.EXIT_FAILED


# --- service-install ---------------------------------------------------------------------------
def test_install_service_writes_unit_and_keeps_an_edited_config(tmp_path):
    r = run_cli("service-install", "lab", "--interfaces", "eth1", "--root", str(tmp_path))
    assert r.exit_code == 0, r.output
    unit = tmp_path / "etc/systemd/system/xdp-agg@.service"
    conf = tmp_path / "etc/xdp-agg/lab.conf"
    assert "systemctl enable --now xdp-agg@lab.service" in r.output
    text = unit.read_text()
    assert "service-start %i --config /etc/xdp-agg/%i.conf" in text
    assert "ExecStopPost=" in text and "Restart=on-failure" in text
    conf.write_text(conf.read_text().replace('INTERFACES="eth1"', 'INTERFACES="eth2"'))
    again = json.loads(run_cli("service-install", "lab", "--root", str(tmp_path), "--json").output)
    assert again["kept"] == [str(conf)] and 'INTERFACES="eth2"' in conf.read_text()
    forced = json.loads(
        run_cli("service-install", "lab", "--root", str(tmp_path), "--force", "--json").output
    )
    assert str(conf) in forced["written"] and 'INTERFACES=""' in conf.read_text()


def test_unit_validates_with_systemd_analyze(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian's systemd package)")
    exe = shutil.which("xdp-agg") or str(Path(sys.executable).parent / "xdp-agg")
    if not os.access(exe, os.X_OK):
        pytest.skip("no xdp-agg script installed to point the unit at (pip install the project)")
    service.install_files(tmp_path, "lab", ["eth1"], exe=exe)
    units = tmp_path / "units"
    units.mkdir()
    shutil.copy(tmp_path / "etc/systemd/system/xdp-agg@.service", units)
    # verify loads the template through the instance name; it checks keys, values and that
    # ExecStart's program is executable
    cp = subprocess.run(
        [analyze, "verify", str(units / "xdp-agg@lab.service")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert cp.returncode == 0 and not cp.stderr.strip(), cp.stderr


# --- the unit's commands, without systemd ------------------------------------------------------
def test_service_start_exit_codes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDP_AGG_PIN_ROOT", str(tmp_path / "pins"))
    monkeypatch.setenv("XDP_AGG_STATE_DIR", str(tmp_path / "run"))
    missing = run_cli("service-start", "lab", "--config", str(tmp_path / "none.conf"))
    assert missing.exit_code == cli.EXIT_FAILED and "service-install lab" in missing.output
    conf = tmp_path / "lab.conf"
    conf.write_text('INTERFACES=eth0\nSERVE_OPTIONS="--no-such-option"\n')
    assert run_cli("service-start", "lab", "--config", str(conf)).exit_code == cli.EXIT_USAGE
    assert not pins.Instance("lab").exists()  # refused before attaching anything
    stop = run_cli("service-stop", "lab", "--json")
    assert stop.exit_code == 0 and json.loads(stop.output)["detached"] == []


def _xdp_agg(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "xdp_agg.app.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
        **kw,
    )


@pytest.mark.root
@pytest.mark.bpf
@pytest.mark.netns
@pytest.mark.slow
def test_service_start_serves_an_allreduce_and_stop_detaches(testbed_factory, tmp_path):
    tb = testbed_factory(workers=2, topology="one-arm")
    name = f"s{uuid.uuid4().hex[:8]}"
    try:
        _serve_and_stop(tb, name, tmp_path)
    finally:  # whatever failed, leave no program or pins behind
        if pins.Instance(name).exists():
            _xdp_agg("service-stop", name)
        if pins.Instance(name).exists():
            pins.Instance(name).remove()


def _serve_and_stop(tb, name, tmp_path):
    agg_ns = tb.aggregator.netns
    conf = tmp_path / f"{name}.conf"
    conf.write_text(  # TOOLCHAIN: an older version's key, read and ignored
        f"INTERFACES=eth0\nNETNS={agg_ns}\nPOOL_SLOTS=256\nTOOLCHAIN=libbpf\nLISTEN=0.0.0.0:48811\n"
        f"SECRET_FILE={tmp_path / 'secret'}\n"
        'SERVE_OPTIONS="--barrier-timeout 30"\n'
    )
    # what an earlier run could leave: the same name attached; service-start replaces it
    first = _xdp_agg("--netns", agg_ns, "--name", name, "attach", "eth0", "--json")
    assert first.returncode == 0, first.stderr
    old_prog = json.loads(first.stdout)["prog_id"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "xdp_agg.app.cli", "service-start", name, "--config", str(conf)],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        while not any("listening" in line for line in lines):
            line = proc.stderr.readline()
            assert line, f"service-start ended: {''.join(lines)}"
            lines.append(line)
        assert any("detached what an earlier run left" in line for line in lines), lines
        st = json.loads(_xdp_agg("--name", name, "status", "--json").stdout)
        assert st["topology"] == "one-arm" and st["pool_slots"] == 256 and st["netns"] == agg_ns
        assert st["interfaces"][0]["attached"] and st["prog_id"] != old_prog
        want = AttachOptions(  # as attached: the forwarding mode chosen for one-arm too
            "one-arm", pool_slots=256, forwarding="off"
        )
        assert AttachOptions.from_dict(st["options"]) == want

        plan = json.dumps([{"dtype": "int32", "count": 5000}])
        workers = [
            tb.popen(
                w,
                cluster_worker.argv(i, 2, f"{w.agg_ip}:48811", "svc", plan),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=REPO,
                env={**os.environ, "XDP_AGG_SECRET_FILE": str(tmp_path / "secret")},
            )
            for i, w in enumerate(tb.workers)
        ]
        for p in workers:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            assert json.loads(out.splitlines()[-1])["ok"]
    finally:
        proc.send_signal(signal.SIGTERM)  # what systemctl stop sends
        proc.wait(timeout=30)
    assert proc.returncode == 0
    assert pins.Instance(name).exists()  # serving ended; detaching is ExecStopPost's job
    stop = _xdp_agg("service-stop", name, "--json")
    assert stop.returncode == 0, stop.stderr
    assert json.loads(stop.stdout)["detached"] == ["eth0"]
    assert not pins.Instance(name).exists()
    assert "xdp" not in tb.run("agg", ["ip", "link", "show", "dev", "eth0"]).stdout.split("\n")[0]
