"""Layers you can see in the folders: no package imports one above it.

From the bottom: the protocol (xdp_agg.proto), the BPF system calls (xdp_agg.bpfsys) and the
errors every layer raises (xdp_agg.errors) import no package of ours; the host library (hostlib)
builds on the protocol only; the testbed (netns_testbed) on bpfsys only; the control endpoint
and its backends (xdp_agg.ctl) on the protocol and on hostlib's batched UDP socket (the software
aggregator sends as hosts do); the XDP target (xdp_switch) on those below; the application
(xdp_agg.app: the CLI, serving, the service) above every target; orchestration
(xdp_agg.cluster) and the benchmarks (bench) on top. Every import counts, module level or inside
a function. A layer is a top-level package, or a part of the xdp_agg namespace (xdp_agg.proto,
xdp_agg.targets.soft, ...): the namespace is one name in site-packages, not one layer.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ERRORS = "xdp_agg.errors"

ALLOWED = {
    "xdp_agg.proto": set(),
    "xdp_agg.errors": set(),
    "xdp_agg.codegen": {"xdp_agg.proto"},
    "xdp_agg.bpfsys": {ERRORS},  # the errors sit at the bottom: every layer may raise them
    "hostlib": {"xdp_agg.proto"},
    "netns_testbed": {"xdp_agg.bpfsys"},
    "xdp_agg.ctl": {"xdp_agg.proto", "hostlib"},
    # the targets, side by side: none imports another
    "xdp_switch": {"xdp_agg.proto", "xdp_agg.codegen", "xdp_agg.ctl", "xdp_agg.bpfsys", ERRORS},
    "xdp_agg.targets.soft": {"xdp_agg.proto", "xdp_agg.ctl", "hostlib", ERRORS},
    "xdp_agg.targets.bmv2": {"xdp_agg.proto", "xdp_agg.codegen", "xdp_agg.ctl", ERRORS},
    "xdp_agg.app": {
        "xdp_agg.proto",
        "xdp_agg.ctl",
        "xdp_agg.bpfsys",
        "xdp_switch",
        "xdp_agg.targets.soft",
        "xdp_agg.targets.bmv2",
        ERRORS,
    },
    "xdp_agg.cluster": {
        "xdp_agg.app",
        "xdp_agg.proto",
        "xdp_agg.ctl",
        "xdp_agg.bpfsys",
        "hostlib",
        "netns_testbed",
        "xdp_switch",
        ERRORS,
    },
    "bench": {
        "xdp_agg.app",
        "xdp_agg.proto",
        "xdp_agg.ctl",
        "xdp_agg.cluster",
        "xdp_agg.bpfsys",
        "hostlib",
        "netns_testbed",
        "xdp_switch",
        ERRORS,
    },
}
OURS = set(ALLOWED)
TOP = {"xdp_agg", "xdp_switch", "hostlib", "netns_testbed", "bench"}  # the folders at the top


def layer(name: str) -> str:
    """The layer a module belongs to: its top-level package, or for the xdp_agg namespace its
    part (xdp_agg.proto.wire -> xdp_agg.proto, xdp_agg.targets.soft.backend ->
    xdp_agg.targets.soft)."""
    parts = name.split(".")
    if parts[0] != "xdp_agg" or len(parts) == 1:
        return parts[0]
    return ".".join(parts[:3] if parts[1] == "targets" else parts[:2])


def imports_of(path: Path) -> set[str]:
    """Layers of ours that a file imports (absolute imports; relative ones stay inside the
    file's own package). `from xdp_agg import bpfsys` imports the layer xdp_agg.bpfsys."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {layer(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module in ("xdp_agg", "xdp_agg.targets"):
                found |= {layer(f"{node.module}.{a.name}") for a in node.names}
            else:
                found.add(layer(node.module))
    return found & (OURS | {"xdp_agg", "xdp_agg.targets"})


def _files(package: str) -> list[Path]:
    where = ROOT / package.replace(".", "/")
    return [where.with_suffix(".py")] if not where.is_dir() else sorted(where.rglob("*.py"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_package_imports_one_above_it(package):
    bad = {}
    for path in _files(package):
        extra = imports_of(path) - ALLOWED[package] - {package}
        if extra:
            bad[str(path.relative_to(ROOT))] = sorted(extra)
    assert not bad, f"{package} may import only {sorted(ALLOWED[package])}: {bad}"


def test_every_package_is_in_the_table():
    """Four names at the top (and bench, which the wheel leaves out); every part of the
    xdp_agg namespace is a layer of the table."""
    assert {p.parent.name for p in ROOT.glob("*/__init__.py")} == TOP
    ns = ROOT / "xdp_agg"
    parts = {
        f"xdp_agg.{p.parent.name}" for p in ns.glob("*/__init__.py") if p.parent.name != "targets"
    }
    parts |= {f"xdp_agg.{p.stem}" for p in ns.glob("*.py") if p.stem != "__init__"}
    parts |= {f"xdp_agg.targets.{p.parent.name}" for p in ns.glob("targets/*/__init__.py")}
    assert parts | (TOP - {"xdp_agg"}) == OURS, "a new package needs its place in ALLOWED"


def test_the_namespace_imports_nothing():
    """`import xdp_agg` (or its targets) pulls in no layer: the bottom imports only what it uses."""
    for init in (ROOT / "xdp_agg/__init__.py", ROOT / "xdp_agg/targets/__init__.py"):
        assert imports_of(init) == set(), init


def test_the_check_sees_a_violation(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "def f():\n    from xdp_switch import cli\n    import hostlib.engine\n"
        "    from xdp_agg import bpfsys\n    from xdp_agg.targets.soft import backend\n"
    )
    assert imports_of(f) == {"xdp_switch", "hostlib", "xdp_agg.bpfsys", "xdp_agg.targets.soft"}


# --- the C fast path's units (hostlib/fp_*.c, fp_*.h) ----------------------------------------
# A unit is a stem (fp_loop: fp_loop.c and fp_loop.h); it depends on the units whose headers its
# files include. The loop runs its round strategies through RoundOps (fp_run.h) and the strategies
# see the loop's types only, so neither depends on the other (docs/design.md, the C loop). (The
# AF_XDP units, _xsk and xsk_prog, are not checked: each includes the other's header.)
_INCLUDE = re.compile(r'^#include "([^"]+)\.h"', re.M)


def c_units(where: Path, pattern: str = "*.[ch]") -> dict[str, set[str]]:
    """Each C unit of `pattern` in `where` and the other units it includes."""
    deps: dict[str, set[str]] = {}
    for path in sorted(where.glob(pattern)):
        deps.setdefault(path.stem, set()).update(_INCLUDE.findall(path.read_text()))
    return {unit: found - {unit} for unit, found in deps.items()}


def c_cycle(deps: dict[str, set[str]]) -> list[str]:
    """A cycle of units that depend on each other ([] when there is none)."""
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done

    def walk(unit: str, path: list[str]) -> list[str]:
        state[unit] = 1
        for dep in sorted(deps.get(unit, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [unit, dep]
            if dep not in state and (found := walk(dep, path + [unit])):
                return found
        state[unit] = 2
        return []

    for unit in sorted(deps):
        if unit not in state and (found := walk(unit, [])):
            return found
    return []


def test_the_c_units_depend_on_each_other_one_way():
    deps = c_units(ROOT / "hostlib", "fp_*.[ch]")
    assert c_cycle(deps) == [], "C units that include each other"
    for strategy in ("fp_dense", "fp_sparse"):  # each sees the loop through fp_run.h only
        assert "fp_loop" not in deps[strategy] and strategy not in deps["fp_loop"]


def test_the_c_loop_names_no_round_strategy():
    for path in (ROOT / "hostlib/fp_loop.c", ROOT / "hostlib/fp_loop.h"):
        text = path.read_text()
        assert not re.search(r"sparse|fp_dense|DenseRun", text, re.I), path


def test_the_unit_check_sees_a_cycle(tmp_path):
    (tmp_path / "a.c").write_text('#include "a.h"\n#include "b.h"\n')
    (tmp_path / "b.h").write_text('#include "c.h"\n')
    (tmp_path / "c.c").write_text('#include "a.h"\n')
    assert c_cycle(c_units(tmp_path)) == ["a", "b", "c", "a"]
