"""The newcomer's map is current: every path README's Layout table and docs/design.md's "Where a
change goes" table name exists, every package of the repository has its row in the Layout table,
and no text names a test file where it no longer is."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILE = re.compile(r"\.(py|h|c|p4|md|json|toml|proto|yml)$")


def _section(page: str, heading: str) -> str:
    text = (ROOT / page).read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def _paths(section: str) -> set[str]:
    """The paths a section names: in backquotes, or docs pages written bare."""
    found = set()
    for token in re.findall(r"`([^`\s]+)`", section) + re.findall(r"\bdocs/[\w./-]+\.md", section):
        token = token.rstrip(".,:;)")
        if "/" in token or FILE.search(token):
            found.add(token)
    return found


def _missing(paths: set[str]) -> list[str]:
    return sorted(p for p in paths if not (ROOT / p).exists())


def test_every_path_in_where_a_change_goes_exists():
    paths = _paths(_section("docs/design.md", "Where a change goes"))
    assert len(paths) > 20
    assert _missing(paths) == []
    bare = sorted(p for p in paths if "/" not in p)
    assert bare == [], f"name these by their path from the repository root: {bare}"


def test_every_path_in_the_readme_layout_exists():
    """A row's other names may be its first path's (`abi.py` in the row of `xdp_agg/codegen/`)."""
    paths = set()
    for line in _section("README.md", "Layout").splitlines():
        if not line.startswith("| `"):
            continue
        first = re.match(r"\| `([^`]+)`", line).group(1)
        for p in _paths(line):
            paths.add(p if (ROOT / p).exists() else f"{first.rstrip('/')}/{p}")
    assert len(paths) > 15
    assert _missing(paths) == []


def test_every_package_has_its_row_in_the_readme_layout():
    rows = set(re.findall(r"^\| `([^`]+)`", _section("README.md", "Layout"), re.M))
    packages = {f"{p.parent.name}/" for p in ROOT.glob("*/__init__.py")} - {"xdp_agg/"}
    packages |= {
        f"xdp_agg/{p.parent.relative_to(ROOT / 'xdp_agg')}/"
        for p in ROOT.glob("xdp_agg/**/__init__.py")
        if p.parent.name != "targets" and "bmv2/p4" not in str(p) and p.parent != ROOT / "xdp_agg"
    }
    assert sorted(packages - rows) == []


def test_no_text_names_a_test_file_that_is_not_there():
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    gone = []
    for f in files:
        if not f.endswith((".py", ".md", ".c", ".h", ".toml")) or f.startswith("bench/results"):
            continue
        for name in re.findall(r"(?<![\w/])tests/(?:\w+/)?test_\w+\.py", (ROOT / f).read_text()):
            if not (ROOT / name).exists():
                gone.append(f"{f}: {name}")
    assert gone == []
