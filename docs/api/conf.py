"""Sphinx configuration of the API reference of hostlib and hostlib.pt (`make docs`).

The pages are generated from the docstrings (autodoc); tests/test_api_docs.py builds them with
-W, so a docstring Sphinx cannot read fails the tests. The output goes to build/docs (ignored).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's hostlib

# torch first: importing it runs hostlib.pt's entry point (the "xdpagg" backend), which must not
# start while autodoc is half-way through importing hostlib.pt's own modules
import torch  # noqa: E402, F401

project = "xdp-agg"
extensions = ["sphinx.ext.autodoc"]
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"


# The docstrings are plain text (indented examples, "- " lists, `names` in back quotes), not
# reStructuredText: each is shown as written, a literal block, instead of being parsed as markup
# it is not (which would warn, and -W fails the build).
def _as_written(app, what, name, obj, options, lines):
    if any(line.strip() for line in lines):
        lines[:] = ["::", ""] + ["    " + line for line in lines]


def setup(app):
    app.connect("autodoc-process-docstring", _as_written)


html_theme = "alabaster"
exclude_patterns = ["_build"]
