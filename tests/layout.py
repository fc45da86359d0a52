"""Where each test file sits, by what it needs (docs/testing.md, "Layout"):

    tests/root/   a file with any test that needs root: marked `root`, or asking for a fixture
                  that loads BPF or builds namespaces (ROOT_FIXTURES)
    tests/house/  the checks of the code itself (HOUSE): style, layers, typing, function length,
                  docs, the CLI's help, this layout; none needs root
    tests/unit/   everything else: no root, no BPF, no namespaces

The rule is judged from the collected tests, so a file another branch adds at the top of tests/,
or a unit file that gains a root test, is caught by tests/house/test_layout.py. Run by hand:

    python tests/layout.py            # each misplaced file with the folder it belongs in
    python tests/layout.py --git-mv   # the `git mv` commands that put them there (printed only)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
FOLDERS = ("unit", "root", "house")

# The checks of the code itself, by file name: they read the tree, not run it.
HOUSE = frozenset(
    {
        "test_api_docs.py",  # the API reference builds without a warning
        "test_cli_tree.py",  # help on every option, an example and --json on every command
        "test_docs.py",  # README's size, docs/cli.md current, every link reaching a heading
        "test_front_door.py",  # every hostlib.init(...) a text shows binds to the signature
        "test_function_length.py",  # no production function over 100 lines
        "test_layers.py",  # no package imports one above it
        "test_layout.py",  # this file's rule
        "test_map.py",  # README's layout and design.md's "Where a change goes" current
        "test_style.py",  # ruff, clang-format
        "test_suite_outcomes.py",  # the torch suite driver's bookkeeping (a test of the tests)
        "test_typing.py",  # the mypy ratchet
    }
)

# Fixtures that load BPF or build namespaces: a test asking for one needs root even unmarked.
ROOT_FIXTURES = frozenset({"agg_prog", "agg", "testbed", "testbed_factory", "p4_json"})


def folder_for(name: str, needs_root: bool) -> str:
    """The folder a test file belongs in: root first (what it needs), then house, then unit."""
    if needs_root:
        return "root"
    return "house" if name in HOUSE else "unit"


class _Collector:
    """A pytest plugin noting, per test file, whether any of its tests needs root."""

    def __init__(self) -> None:
        self.needs_root: dict[str, bool] = {}

    def pytest_collection_modifyitems(self, items) -> None:
        for item in items:
            path = str(Path(str(item.path)).resolve().relative_to(TESTS))
            root = item.get_closest_marker("root") is not None
            root = root or bool(ROOT_FIXTURES & set(getattr(item, "fixturenames", ())))
            self.needs_root[path] = self.needs_root.get(path, False) or root


def collect() -> dict[str, bool]:
    """Every test file under tests/ (relative to it) and whether it needs root, from pytest's
    collection (run in this process: call it from a subprocess inside a test run)."""
    import pytest

    col = _Collector()
    args = ["--collect-only", "-q", "-p", "no:cacheprovider", str(TESTS)]
    rc = pytest.main(args, plugins=[col])
    if rc not in (0, 5):
        raise SystemExit(f"layout: collection failed ({rc})")
    for f in TESTS.rglob("test_*.py"):  # a file that collects nothing is still placed
        col.needs_root.setdefault(str(f.relative_to(TESTS)), False)
    return col.needs_root


def misplaced(needs_root: dict[str, bool]) -> dict[str, str]:
    """{file: where it belongs} for every test file not in the folder its needs say."""
    out = {}
    for path, root in sorted(needs_root.items()):
        p = Path(path)
        want = f"{folder_for(p.name, root)}/{p.name}"
        if path != want:
            out[path] = want
    return out


def main(argv: list[str]) -> int:
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        wrong = misplaced(collect())
    if "--git-mv" in argv:
        for src, dst in wrong.items():
            print(f"git mv tests/{src} tests/{dst}")
    else:
        print(json.dumps(wrong, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
