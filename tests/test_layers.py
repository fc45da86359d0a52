"""Layers you can see in the folders: no package imports one above it.

From the bottom: the protocol (aggproto) and the BPF system calls (bpfsys) import no package of
ours; the host library (hostlib) builds on the protocol only; the testbed (netns_testbed) on
bpfsys only; the control endpoint and its backends (aggctl) on the protocol and on hostlib's
batched UDP socket (the software aggregator sends as hosts do); the XDP target (xdp_switch) on
those below; the application (aggapp: the CLI, serving, the service) above every target;
orchestration (aggcluster) and the benchmarks (bench) on top. Every import counts, module level
or inside a function.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

ALLOWED = {
    "aggproto": set(),
    "aggcodegen": {"aggproto"},
    "bpfsys": set(),
    "hostlib": {"aggproto"},
    "netns_testbed": {"bpfsys"},
    "aggctl": {"aggproto", "hostlib"},
    # the targets, side by side: none imports another
    "xdp_switch": {"aggproto", "aggcodegen", "aggctl", "bpfsys"},
    "soft_switch": {"aggproto", "aggctl", "hostlib"},
    "bmv2_switch": {"aggproto", "aggcodegen", "aggctl"},
    "aggapp": {"aggproto", "aggctl", "bpfsys", "xdp_switch", "soft_switch", "bmv2_switch"},
    "aggcluster": {
        "aggapp",
        "aggproto",
        "aggctl",
        "bpfsys",
        "hostlib",
        "netns_testbed",
        "xdp_switch",
    },
    "bench": {
        "aggapp",
        "aggproto",
        "aggctl",
        "aggcluster",
        "bpfsys",
        "hostlib",
        "netns_testbed",
        "xdp_switch",
    },
}
OURS = set(ALLOWED)


def imports_of(path: Path) -> set[str]:
    """Top-level names of our packages that a file imports (absolute imports; relative ones stay
    inside the file's own package)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & OURS


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_package_imports_one_above_it(package):
    bad = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        extra = imports_of(path) - ALLOWED[package] - {package}
        if extra:
            bad[str(path.relative_to(ROOT))] = sorted(extra)
    assert not bad, f"{package} may import only {sorted(ALLOWED[package])}: {bad}"


def test_every_package_is_in_the_table():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages == OURS, "a new top-level package needs its place in ALLOWED"


def test_the_check_sees_a_violation(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from xdp_switch import cli\n    import hostlib.engine\n")
    assert imports_of(f) == {"xdp_switch", "hostlib"}
