"""The TNA variant (p4/tna/) cannot be compiled for Tofino here (that needs Intel's SDE), but
p4c's front end can type-check it against the public tna.p4 that p4c ships with its Tofino back
end: every error but the last one (the bmv2 back end refusing a non-v1model program) would be a
mistake in our code."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import bmv2_switch as bm

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


def test_tna_variant_passes_the_p4c_front_end(tmp_path):
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
            "-D__TARGET_TOFINO__=1",
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
