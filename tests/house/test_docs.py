"""The documentation: a short README, docs/cli.md current with the click tree, and every link
between the pages pointing at a file and a heading that exist."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "p4" / "README.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
README_LIMIT = 12_000  # 12 KB: a five-minute read


def _clidoc():
    spec = importlib.util.spec_from_file_location("clidoc", ROOT / "tools" / "clidoc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a page (outside code blocks), with GitHub's -1, -2 for repeats."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6} (.+)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def test_readme_is_short():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes; move detail into docs/"


def test_cli_page_is_current():
    assert (ROOT / "docs" / "cli.md").read_text() == _clidoc().render(), (
        "docs/cli.md is stale: run make cli-doc"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_reaches_a_file_and_heading(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # an outside address
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: links to nothing: {broken}"


def test_slugs_follow_github():
    assert slug("Several aggregators (striping)") == "several-aggregators-striping"
    assert slug("What bounds xdp-agg here is the machine's two CPUs") == (
        "what-bounds-xdp-agg-here-is-the-machines-two-cpus"
    )


def test_a_broken_link_is_caught(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("# Title\n\n[ok](#title) [gone](#nothing)\n")
    assert anchors(page) == {"title"}
