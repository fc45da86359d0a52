"""The TNA variant (p4/tna/): p4c's front end type-checks it against the public tna.p4 that p4c
ships with its Tofino back end (every error but the last one, the bmv2 back end refusing a
non-v1model program, would be a mistake in our code), and p4c's open Tofino back end (bf-p4c,
p4c's backends/tofino) compiles it for Tofino and Tofino 2 wherever it is installed: on PATH, or
named by XDP_AGG_BF_P4C (p4/README.md, "The toolchain", says which versions were tested)."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import xdp_agg.targets.bmv2 as bm

pytestmark = [pytest.mark.p4]

TNA_MAIN = bm.P4_DIR / "tna" / "switchml.p4"


def _tna_include() -> Path | None:
    """The directory holding tna.p4: p4c's installed p4include (with its Tofino headers)."""
    p4c = shutil.which(bm.TOOLS["p4c"])
    if p4c is None:
        return None
    for d in (
        Path(p4c).resolve().parent.parent / "share" / "p4c" / "p4include",
        Path("/usr/share/p4c/p4include"),
    ):
        if (d / "tna.p4").exists():
            return d
    return None


@pytest.mark.parametrize("tofino", [1, 2])
def test_tna_variant_passes_the_p4c_front_end(tmp_path, tofino):
    """Both builds: Tofino's (dense jobs) and Tofino 2's (sparse jobs too: TNA_SPARSE)."""
    inc = _tna_include()
    if inc is None:
        pytest.skip(
            "p4c-bm2-ss with p4c's Tofino headers (tna.p4 in share/p4c/p4include) is not installed"
        )
    r = subprocess.run(
        [
            shutil.which(bm.TOOLS["p4c"]),
            "--std",
            "p4-16",
            "--Wdisable",
            f"-D__TARGET_TOFINO__={tofino}",
            "-I",
            str(inc),
            "-o",
            str(tmp_path / "tna.json"),
            str(TNA_MAIN),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [ln for ln in r.stderr.splitlines() if re.search(r"\berror\b", ln)]
    assert r.returncode != 0
    assert len(errors) == 1, r.stderr  # the front end found nothing
    assert "Target model error" in errors[0] and "package Switch" in errors[0], r.stderr


def _bf_p4c() -> str | None:
    return os.environ.get("XDP_AGG_BF_P4C") or shutil.which("bf-p4c")


STAGES = {"tofino": 12, "tofino2": 20}  # MAU stages a pipe of the chip has


def bfa_stages(bfa: str) -> dict[str, int]:
    """Stages each gress uses in an assembly file of bf-p4c: its `stage N ingress:` sections."""
    used: dict[str, int] = {}
    for n, gress in re.findall(r"^stage (\d+) (ingress|egress):", bfa, re.M):
        used[gress] = max(used.get(gress, 0), int(n) + 1)
    return used


def test_bfa_stages_counts_each_gress():
    bfa = "version:\nstage 0 ingress:\n  x\nstage 3 ingress:\nstage 1 egress:\n  stage 9 ingress:\n"
    assert bfa_stages(bfa) == {"ingress": 4, "egress": 2}


def bfa_parser_selects(bfa: str, gress: str) -> int:
    """The `match:` lines (a state's select) in an assembly file's `parser <gress>:` section."""
    section = re.search(rf"^parser {gress}:\n(.*?)(?=^\S)", bfa, re.M | re.S)
    return 0 if section is None else len(re.findall(r"^ +match: ", section.group(1), re.M))


def test_bfa_parser_selects_counts_one_gress():
    bfa = (
        "parser ingress:\n  states:\n    s:\n      match: [ half ]\n      0x0800:\n"
        "    t:\n      *:\n        next: end\n"
        "deparser ingress:\n  x\nparser egress:\n  states:\n    e:\n      match: [ byte0 ]\n"
    )
    assert bfa_parser_selects(bfa, "ingress") == 1
    assert bfa_parser_selects(bfa.replace("match: [ half ]", "*:"), "ingress") == 0


def _assemble_after_driver_bug(bf: str, r, pipe: Path) -> None:
    """bf-p4c's driver at p4c 34b86e9 dies in its assembler step (barefoot.py: 'PosixPath' object
    has no attribute 'find') after the back end wrote the .bfa: run the assembler, bfas, as the
    driver would have."""
    if r.returncode == 0 or "PosixPath" not in r.stderr or not (pipe / "switchml.bfa").exists():
        return
    bfas = Path(bf).resolve().parent / "bfas"
    a = subprocess.run(
        [str(bfas), "switchml.bfa"], capture_output=True, text=True, timeout=600, cwd=pipe
    )
    assert a.returncode == 0, a.stdout[-4000:] + a.stderr[-4000:]
    r.returncode, r.stderr = 0, r.stderr + a.stderr


@pytest.mark.parametrize(
    ("target", "arch"),
    [("tofino", "tna"), ("tofino2", "t2na")],
)
def test_tna_variant_compiles_for_tofino(tmp_path, target, arch):
    """bf-p4c to the end: no error, an assembled pipe (the .bfa and the binary), and the ingress
    pipeline (checks, bitmap, counter, 32 accumulator pairs, 2 exponents) within the chip's
    stages."""
    bf = _bf_p4c()
    if bf is None:
        pytest.skip(
            "bf-p4c (p4c's Tofino back end, github.com/p4lang/p4c backends/tofino) is not "
            "installed: put it on PATH or set XDP_AGG_BF_P4C"
        )
    out = tmp_path / "out"
    r = subprocess.run(
        [bf, "--target", target, "--arch", arch, "-o", str(out), str(TNA_MAIN.resolve())],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    if "ModuleNotFoundError" in r.stderr and r.returncode != 0:
        pytest.skip(f"bf-p4c's driver does not start (its Python modules): {r.stderr[-300:]}")
    _assemble_after_driver_bug(bf, r, out / "pipe")
    errors = [ln for ln in (r.stdout + r.stderr).splitlines() if re.search(r"\berror\b", ln)]
    assert r.returncode == 0 and not errors, r.stdout[-4000:] + r.stderr[-4000:]
    bfa = out / "pipe" / "switchml.bfa"
    assert bfa.exists() and bfa.stat().st_size > 0, "the assembler had nothing to assemble"
    assert list((out / "pipe").glob("*.bin")), "no binary: the assembler did not finish"
    text = bfa.read_text()
    # p4c before PR #5753 (p4lang/p4c, merged 2026-09-04) lost every parser select on saved
    # packet data: each state took its first transition, and the program still assembled.
    # Ours selects on the port, EtherType, IPv4 header, UDP port, message type and size, and
    # the fold's step and size; bf-p4c merges some (6 matching states for Tofino, 9 for
    # Tofino 2 at p4c 34b86e9 with that PR applied).
    assert bfa_parser_selects(text, "ingress") >= 5, "bf-p4c lost the parser's selects"
    used = bfa_stages(text)
    assert 0 < used.get("ingress", 0) <= STAGES[target], used
    assert used.get("egress", 0) <= STAGES[target], used
    for f in out.rglob("resources.json"):  # written with -g (backends/tofino/scripts)
        assert int(json.loads(f.read_text())["resources"]["mau"]["nStages"]) <= STAGES[target]
