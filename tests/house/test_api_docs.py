"""The API reference of hostlib and hostlib.pt (docs/api, `make docs`): Sphinx builds it from the
docstrings with -W, so a warning fails (an unresolved reference to a hostlib object too), every
public class and function is on the page, and the page cross-references: the types of the
signatures and the names in the docstrings link to the objects they mean."""

import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
    # a signature's type (autodoc_typehints="description": the field list under a docstring)
    # and a name in a docstring (its parsed literal block) each link to a hostlib object
    link = re.compile(r'<a class="reference internal" href="#hostlib\.[\w.]+"')
    fields = re.findall(r'<dl class="field-list simple">(.*?)</dl>', page, re.S)
    assert any(link.search(f) for f in fields), "no type of a signature links to hostlib"
    blocks = re.findall(r'<pre class="literal-block">(.*?)</pre>', page, re.S)
    assert any(link.search(b) for b in blocks), "no name in a docstring links to hostlib"
