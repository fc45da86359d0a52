"""Run a module as the unprivileged user nobody (uid and gid 65534): what a non-root user sees.

The checkout, and a venv inside it, may sit in a directory other users cannot enter (/root, a
`mktemp -d` folder: mode 0700). A child started as nobody straight from there dies with
ModuleNotFoundError before it reaches the code under test (CI once failed so). So the child runs the
base interpreter (not the venv's, which may live in that directory too) with PYTHONPATH set to a
temporary directory of mode 0755 holding copies of every module the code needs that does not come
with that interpreter: the project's packages, taken from where this test run imports them (the code
under test), and their dependencies from the venv. Starting a fresh interpreter as nobody, rather
than dropping privileges after importing as root, also checks that importing the CLI needs no root,
as it would not for a user typing the command.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

NOBODY = 65534

# Printed by a root child that has the test run's sys.path: where each top-level module that
# importing the target adds lives (a package's directory, a module's file, a namespace's paths).
_PROBE = r"""
import importlib, json, os, sys
before = set(sys.modules)
importlib.import_module(sys.argv[1])
found = {}
for name in sorted(set(sys.modules) - before):
    mod = sys.modules[name]
    if "." in name or mod is None:
        continue
    file = getattr(mod, "__file__", None)
    if file and os.path.basename(file).startswith("__init__."):
        found[name] = [os.path.dirname(file)]
    elif file:
        found[name] = [file]
    else:
        found[name] = list(getattr(mod, "__path__", []))
print(json.dumps(found))
"""


def readable_by_others(path: str) -> bool:
    """Whether a user outside root's groups can reach and read `path` (mode bits; ACLs ignored)."""
    path = os.path.realpath(path)
    parent = os.path.dirname(path)
    while parent != os.path.dirname(parent):
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(parent)
    mode = os.stat(path).st_mode
    need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) else 0)
    return mode & need == need


def base_python() -> str:
    """The interpreter the venv was made from: the venv's own bin/ may not be reachable."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _base_path(python: str) -> set[str]:
    """sys.path of `python` without PYTHONPATH or user site: what the child finds by itself."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    out = subprocess.run(
        [python, "-s", "-c", "import json, sys; print(json.dumps(sys.path))"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return {os.path.realpath(p) for p in json.loads(out) if p}


def _copy_file(src: str, dst: str) -> None:
    """Hard-link a file others can read (instant, even for numpy); otherwise copy it and make the
    copy readable. Linking is skipped for unreadable files because a link shares the mode."""
    if os.stat(src).st_mode & stat.S_IROTH:
        with contextlib.suppress(OSError):  # another filesystem, or links not allowed
            os.link(src, dst)
            return
    shutil.copy2(src, dst)
    os.chmod(dst, os.stat(dst).st_mode | stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)


def _copy(src: str, dst_dir: str) -> None:
    dst = os.path.join(dst_dir, os.path.basename(src))
    if os.path.isdir(src):
        shutil.copytree(src, dst, copy_function=_copy_file, dirs_exist_ok=True)
    else:
        _copy_file(src, dst)


@contextlib.contextmanager
def readable_copy(module: str) -> Iterator[str]:
    """A directory nobody can read holding what importing `module` needs beyond the base
    interpreter's own sys.path; removed afterwards."""
    python = base_python()
    if not readable_by_others(python):
        pytest.skip(f"the base interpreter {python} is not readable by other users")
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE, module], capture_output=True, text=True, timeout=60
    )
    assert probe.returncode == 0, probe.stderr
    own = _base_path(python)
    root = tempfile.mkdtemp(prefix="xdp-agg-readable-")
    try:
        os.chmod(root, 0o755)  # mkdtemp makes it 0700
        if not readable_by_others(root):
            pytest.skip(f"the temporary directory {root} is not reachable by other users")
        for locations in json.loads(probe.stdout).values():
            for loc in locations:
                if os.path.dirname(os.path.realpath(loc)) in own:
                    continue  # the base interpreter has it (stdlib, system site packages)
                _copy(loc, root)
                libs = loc.rstrip(os.sep) + ".libs"  # shared libraries of wheels (numpy.libs)
                if os.path.isdir(libs):
                    _copy(libs, root)
        for dirpath, _, _ in os.walk(root):
            os.chmod(dirpath, 0o755)  # copytree keeps the source's mode, maybe 0700
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_as_nobody(
    copy: str, module: str, *args: str, timeout: float = 60
) -> subprocess.CompletedProcess:
    """`python -m module args` as uid/gid 65534 with no supplementary groups, importing from
    `copy` (see readable_copy). Needs root. A clean environment keeps the caller's PYTHONPATH
    (maybe unreachable) and user site out."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": copy,
        "PYTHONDONTWRITEBYTECODE": "1",
        "HOME": "/nonexistent",
        "LC_ALL": "C.UTF-8",
    }
    return subprocess.run(
        [base_python(), "-s", "-m", module, *args],
        cwd=copy,
        env=env,
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
