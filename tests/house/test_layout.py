"""Each test file sits in the folder its needs say (tests/layout.py; docs/testing.md, "Layout"):
a file with a test that needs root (marked `root`, or asking for a BPF or namespace fixture) in
tests/root, the checks of the code itself in tests/house, the rest in tests/unit. A file another
branch adds at the top of tests/, or one that gains a root test, fails here with the `git mv`
that puts it right."""

import subprocess
import sys
from pathlib import Path

import layout

TESTS = Path(layout.__file__).resolve().parent


def test_every_test_file_is_in_the_folder_its_needs_say():
    cp = subprocess.run(
        [sys.executable, str(TESTS / "layout.py"), "--git-mv"],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cp.returncode == 0, cp.stderr[-3000:]
    assert cp.stdout == "", f"misplaced test files; run from the repository root:\n{cp.stdout}"


def test_the_rule():
    assert layout.folder_for("test_anything.py", needs_root=True) == "root"
    assert layout.folder_for("test_style.py", needs_root=True) == "root"  # needs come first
    assert layout.folder_for("test_style.py", needs_root=False) == "house"
    assert layout.folder_for("test_anything.py", needs_root=False) == "unit"
    wrong = layout.misplaced({"test_new.py": True, "unit/test_x.py": True, "root/test_y.py": False})
    assert wrong == {
        "test_new.py": "root/test_new.py",
        "unit/test_x.py": "root/test_x.py",
        "root/test_y.py": "unit/test_y.py",
    }


def test_every_house_file_exists():
    assert {p.name for p in (TESTS / "house").glob("test_*.py")} == set(layout.HOUSE)
