"""The wheel works outside the repository (an install must not depend on the checkout): built from a
copy of the working tree, installed into a fresh venv (system site packages, as `make venv` makes)
in a temporary directory, and run from there with the repository neither the working directory
nor on sys.path: its xdp-agg attaches, reports status, serves a small all-reduce between two
workers that use the wheel's host library (and its C fast path), and detaches."""

import json
import os
import shutil
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

import pytest

from xdp_agg.cluster import cluster_worker
from xdp_agg.proto import control
from xdp_switch import pins

REPO = Path(__file__).resolve().parents[2]
# the four top-level import names of the wheel (docs/design.md, "One namespace")
TOP_LEVEL = {"xdp_agg", "xdp_switch", "hostlib", "netns_testbed"}
pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.slow]


def _tracked_copy(dst: Path) -> None:
    """The working tree's files that git would commit (links kept as links), into dst."""
    ls = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "-co", "--exclude-standard"],
        capture_output=True,
        check=True,
    )
    for rel in filter(None, ls.stdout.decode().split("\0")):
        src = REPO / rel
        if not src.exists() and not src.is_symlink():  # deleted, not yet committed
            continue
        out = dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), out)
        else:
            shutil.copy2(src, out)


def _copy_objects(dst: Path) -> None:
    """The checkout's BPF objects (built first if out of date), their times kept: as `make
    bundle` builds the sdist after `make bpf`."""
    from xdp_switch import bpfbuild

    for obj in bpfbuild.build(quiet=True):
        out = dst / obj.relative_to(REPO)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(obj, out)


def _build_wheel(tmp: Path) -> Path:
    pytest.importorskip("build", reason="`build` is missing: pip install '.[test]' installs it")
    import setuptools

    src = tmp / "src"
    _tracked_copy(src)
    _copy_objects(src)
    # the sdist first, then the wheel from the sdist: proves the sdist holds everything
    # (hostlib/_fastpath.c, the BPF and P4 sources, the BPF objects: no clang is called, as on
    # an offline box that builds the bundle's sdist). Without isolation when this venv's
    # setuptools is new enough, so the test needs no package index.
    args = [sys.executable, "-m", "build", "--outdir", str(tmp / "dist"), str(src)]
    if int(setuptools.__version__.split(".")[0]) >= 77:
        args.insert(3, "--no-isolation")
    env = dict(os.environ, XDP_AGG_CLANG="/nonexistent/clang")
    cp = subprocess.run(args, capture_output=True, text=True, timeout=600, check=False, env=env)
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    assert "SetuptoolsDeprecationWarning" not in cp.stdout + cp.stderr
    assert "is absent from the `packages` configuration" not in cp.stdout + cp.stderr
    (wheel,) = (tmp / "dist").glob("xdp_agg-*.whl")
    assert list((tmp / "dist").glob("xdp_agg-*.tar.gz"))
    with zipfile.ZipFile(wheel) as z:  # the names the wheel claims in every user's site-packages
        names = set(z.namelist())
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith((".dist-info", ".data"))} == TOP_LEVEL
    # hostlib is typed (PEP 561), its C extension through its stub (tests/house/test_typing.py)
    assert {"hostlib/py.typed", "hostlib/_fastpath.pyi"} <= names
    assert "xdp_switch/objects/xdp_agg-percpu.o" in names
    return wheel


def test_wheel_installs_and_runs_outside_the_repository(tmp_path, testbed_factory):
    wheel = _build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run(
        ["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(venv)],
        check=True,
        timeout=120,
    )
    py, exe = venv / "bin/python", venv / "bin/xdp-agg"
    pip = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert pip.returncode == 0, pip.stderr[-3000:]

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    secret = tmp_path / "deployment.secret"  # serve creates it (0600); the workers prove it
    env[control.SECRET_ENV] = str(secret)

    def run(argv, **kw):
        return subprocess.run(
            [str(a) for a in argv],
            capture_output=True,
            text=True,
            cwd=work,
            env=env,
            timeout=300,
            check=False,
            **kw,
        )

    assert run([exe, "--version"]).stdout.strip() == "xdp-agg, version 0.1.0"
    assert run([venv / "bin/netns-testbed", "--version"]).stdout.startswith("netns-testbed, ")
    where = run(
        [
            py,
            "-c",
            "import json, xdp_agg.targets.bmv2 as b, hostlib, xdp_switch.loader as l; "
            "print(json.dumps([hostlib.__file__, str(l.SOURCE), str(b.P4_MAIN), "
            "l.SOURCE.is_symlink() or l.BPF_DIR.is_symlink(), b.P4_MAIN.exists()]))",
        ]
    )
    assert where.returncode == 0, where.stderr
    hostlib_file, source, p4_main, linked, p4_exists = json.loads(where.stdout)
    site = str(venv / "lib")
    assert hostlib_file.startswith(site) and source.startswith(site) and p4_main.startswith(site)
    assert not linked and p4_exists  # real copies of bpf/ and p4/, not links into a checkout

    tb = testbed_factory(workers=2, topology="one-arm")
    name = f"w{uuid.uuid4().hex[:8]}"
    agg = ["--netns", tb.aggregator.netns, "--name", name]
    server = None
    try:
        att = run([exe, *agg, "attach", "eth0", "--json"])
        assert att.returncode == 0, att.stderr
        st = json.loads(run([exe, *agg, "status", "--json"]).stdout)
        assert st["interfaces"][0]["attached"] and st["topology"] == "one-arm"

        server = subprocess.Popen(
            [str(exe), *agg, "serve", "--listen", "0.0.0.0:48812", "--secret-file", str(secret)],
            cwd=work,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = server.stderr.readline()
        assert "listening" in line, line + server.stderr.read()
        plan = json.dumps([{"dtype": "int32", "count": 10000}, {"dtype": "float32", "count": 3000}])
        workers = [
            tb.popen(
                w,
                cluster_worker.argv(i, 2, f"{w.agg_ip}:48812", "wheel", plan, python=str(py)),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=work,
                env=env,
            )
            for i, w in enumerate(tb.workers)
        ]
        for p in workers:
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, err[-3000:]
            reports = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
            assert len(reports) == 2 and all(r["ok"] for r in reports), reports
            assert all(r["native"] for r in reports)  # the wheel's compiled hostlib._fastpath
        stats = run([exe, *agg, "stats", "--json"])
        assert stats.returncode == 0 and json.loads(stats.stdout)["unattributed"]["pass"] > 0
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
        det = run([exe, *agg, "detach", "--json"])
    assert det.returncode == 0, det.stderr
    assert json.loads(det.stdout)["detached"] == ["eth0"]
    assert not pins.Instance(name).exists()
