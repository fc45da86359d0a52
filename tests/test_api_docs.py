"""The API reference of hostlib and hostlib.pt (docs/api, `make docs`): Sphinx builds it from the
docstrings with -W, so a warning fails, and every public class and function is on the page."""

import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_api_reference_builds_without_a_warning(tmp_path):
    out = tmp_path / "html"
    r = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
        + ["-d", str(tmp_path / "doctrees"), str(ROOT / "docs" / "api"), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    page = (out / "index.html").read_text()
    for name in ("hostlib", "hostlib.pt"):
        module = importlib.import_module(name)
        public = [
            n
            for n in module.__all__
            if inspect.isclass(getattr(module, n)) or inspect.isfunction(getattr(module, n))
        ]
        assert public, f"{name} exports no class or function"
        missing = [n for n in public if f'id="{name}.{n}"' not in page]
        assert not missing, f"not in the API reference of {name}: {missing}"
