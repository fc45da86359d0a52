"""Sphinx configuration of the API reference of hostlib and hostlib.pt (`make docs`).

The pages are generated from the docstrings (autodoc); tests/house/test_api_docs.py builds them with
-W, so a docstring Sphinx cannot read fails the tests. The output goes to build/docs (ignored).
"""

import inspect
import re
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's hostlib

# torch first: importing it runs hostlib.pt's entry point (the "xdpagg" backend), which must not
# start while autodoc is half-way through importing hostlib.pt's own modules
import torch  # noqa: E402, F401

import hostlib  # noqa: E402
import hostlib.pt  # noqa: E402

project = "xdp-agg"
extensions = ["sphinx.ext.autodoc"]
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
# the annotations as each parameter's type, below the docstring: hostlib's types become links
autodoc_typehints = "description"

# Every reference to a hostlib object must resolve (-W fails the build otherwise), whether a
# type of a signature or a name of a docstring (below); those to other libraries' objects
# (numpy, torch, the standard library) have no page here and stay plain text.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(?!hostlib\b).*")]
nitpick_ignore = [
    # HostOptions.faults' type: the tests' loss generator (hostlib.engine), not in the reference
    ("py:class", "hostlib.stream_state.Faults"),
]

MODULES = (hostlib, hostlib.pt)
_MEMBER_TYPES = (types.FunctionType, property, classmethod, staticmethod)


def _documented() -> tuple[set[str], set[str]]:
    """The full names of what the reference documents: the modules, what their __all__ names
    (classes and functions), and the members of those classes that autodoc shows (public,
    defined in the class, with a docstring); and, apart, the classes."""
    names, classes = {m.__name__ for m in MODULES}, set()
    for module in MODULES:
        for name in module.__all__:
            obj, full = getattr(module, name), f"{module.__name__}.{name}"
            if inspect.isfunction(obj):
                names.add(full)
            elif inspect.isclass(obj):
                names.add(full)
                classes.add(full)
                names.update(
                    f"{full}.{member}"
                    for member, value in vars(obj).items()
                    if not member.startswith("_")
                    and isinstance(value, _MEMBER_TYPES)
                    and getattr(value, "__doc__", None)
                )
    return names, classes


DOCUMENTED, CLASSES = _documented()

# `name` in back quotes, or a bare name that can only mean an object: dotted (hostlib.init,
# HostOptions.from_env) or a class's (Communicator); a lone lower-case word only when quoted
_NAME = re.compile(
    r"`(?P<quoted>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)`"
    r"|(?<![\w.`])(?P<bare>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+|[A-Z][a-z]\w*)(?![\w`])"
)
# what inline markup could start with: escaped everywhere but in the references made below
_MARKUP = re.compile(r"([\\`*_|\[\]<>:])")


def _resolve(name: str, scopes: list[str], quoted: bool) -> str | None:
    """The documented object `name` means in a docstring of an object inside `scopes`
    (innermost first): a member of the scope, then of hostlib or hostlib.pt; a dotted name
    that goes past a documented class (HostOptions.lanes, a field) means that class."""
    candidates = [f"{s}.{name}" for s in scopes] if quoted else []
    candidates += [f"{m.__name__}.{name}" for m in MODULES] + [name]
    for full in candidates:
        if full in DOCUMENTED:
            return full
    if "." in name:
        for full in candidates:
            while "." in full:
                full = full.rsplit(".", 1)[0]
                if full in CLASSES:
                    return full
    return None


def _parameters(obj: object) -> set[str]:
    """The parameter names of a documented callable (or of a class's constructor): a back-quoted
    parameter is the parameter, not a member of the same name."""
    try:
        return set(inspect.signature(obj).parameters) if callable(obj) else set()
    except (TypeError, ValueError):
        return set()


def _line(text: str, scopes: list[str], params: set[str]) -> str:
    """A docstring line as parsed-literal content: every name that means a documented object a
    reference to it (:py:obj:), everything else escaped, so it shows as written."""
    out, at = [], 0
    for m in _NAME.finditer(text):
        quoted, name = bool(m["quoted"]), m["quoted"] or m["bare"]
        if quoted and name in params:
            continue  # the parameter, not a member of the same name
        target = _resolve(name, scopes, quoted)
        if target is None or not (quoted or "." in name or target in CLASSES):
            continue  # a bare word is a reference only when it names a class
        out.append(_MARKUP.sub(r"\\\1", text[at : m.start()]))
        # escaped spaces: delimit the role whatever surrounds it, and show as nothing
        out.append(rf"\ :py:obj:`{name} <{target}>`\ ")
        at = m.end()
    out.append(_MARKUP.sub(r"\\\1", text[at:]))
    return "".join(out)


def _scopes(what: str, name: str) -> list[str]:
    """The documented names enclosing `name` (itself first when it is a module or class)."""
    parts = name.split(".")
    scopes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    return scopes if what in ("module", "class", "exception") else scopes[1:]


# The docstrings are plain text (indented examples, "- " lists, `names` in back quotes), not
# reStructuredText: each is shown as written, a parsed literal block (preformatted, markup
# escaped), in which the names of documented objects are references to them.
def _as_written(app, what, name, obj, options, lines):
    if any(line.strip() for line in lines):
        scopes, params = _scopes(what, name), _parameters(obj)
        lines[:] = [".. parsed-literal::", ""] + [
            "    " + _line(line, scopes, params) if line.strip() else "" for line in lines
        ]


def setup(app):
    app.connect("autodoc-process-docstring", _as_written)


html_theme = "alabaster"
exclude_patterns = ["_build"]
