"""The style checks CI runs: ruff (lint and format, line length 100, configured in pyproject.toml)
over the Python, and the kernel-style clang-format (.clang-format; hostlib/.clang-format for the
CPython extension) over the C. The generated headers are checked by
tests/root/test_codegen.py instead.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the host's C and its headers, but the generated one (tests/root/test_codegen.py checks that)
C_SOURCES = sorted(ROOT.glob("bpf/*.[ch]")) + sorted(
    p for p in ROOT.glob("hostlib/*.[ch]") if p.name != "fp_wire.h"
)


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def ruff():
    if _ruff("--version").returncode != 0:
        pytest.skip("ruff is not installed (it is in the test extra: pip install -e '.[test]')")


def test_ruff_lint_is_clean(ruff):
    r = _ruff("check", "--output-format", "concise", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format_is_clean(ruff):
    r = _ruff("format", "--check", ".")
    assert r.returncode == 0, "run `ruff format .`:\n" + r.stdout + r.stderr


def test_c_follows_clang_format():
    tool = shutil.which("clang-format")
    if tool is None:
        pytest.skip("clang-format is not installed (make deps installs Debian's)")
    assert C_SOURCES, "no C sources found"
    r = subprocess.run(
        [tool, "--dry-run", "--Werror", *map(str, C_SOURCES)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, "run `clang-format -i bpf/*.[ch] hostlib/*.c`:\n" + r.stderr[-4000:]
