"""Every `hostlib.init(...)` and `HostOptions(...)` call the project shows a user (in the docs,
README, docstrings, comments and messages) binds to the real signature: a renamed or removed
parameter cannot live on in a text. No root."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
from pathlib import Path

import pytest

import hostlib
from hostlib.options import HostOptions

ROOT = Path(__file__).resolve().parents[2]
SIGNATURES = {
    "hostlib.init": inspect.signature(hostlib.init),
    "HostOptions": inspect.signature(HostOptions),
}


def _texts() -> list[Path]:
    """The tracked files a user reads or runs, tests left out (they call what they test)."""
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [
        ROOT / f
        for f in out.stdout.splitlines()
        if f.endswith((".py", ".md")) and not f.startswith("tests/") and (ROOT / f).is_file()
    ]


def _balanced(text: str, start: int) -> str | None:
    """The call text from `start` (at the opening parenthesis) to its closing one, if any."""
    depth = 0
    for i in range(start, min(len(text), start + 400)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start : i + 1]
    return None


def calls_in(text: str):
    """(name, call text, line) of every call of SIGNATURES' names in `text`."""
    for name in SIGNATURES:
        for m in re.finditer(rf"(?<![\w.]){re.escape(name)}\(", text):
            args = _balanced(text, m.end() - 1)
            if args is not None:
                yield name, name + args, text.count("\n", 0, m.start()) + 1


def check_call(name: str, call: str) -> str | None:
    """None when `call` binds to `name`'s signature, else why not."""
    try:
        node = ast.parse(" ".join(call.split()), mode="eval").body
    except SyntaxError:
        return "does not parse as a call"
    assert isinstance(node, ast.Call)
    if any(isinstance(a, ast.Starred) for a in node.args) or any(
        k.arg is None for k in node.keywords
    ):
        return None  # *args / **kwargs: nothing to bind by name
    try:
        # partial: a text may name one parameter (`hostlib.init(on_token=...)`)
        SIGNATURES[name].bind_partial(
            *[None] * len(node.args), **{k.arg: None for k in node.keywords}
        )
    except TypeError as e:
        return str(e)
    return None


def test_every_shown_call_binds_to_the_real_signature():
    bad, seen = [], 0
    for path in _texts():
        for name, call, line in calls_in(path.read_text()):
            seen += 1
            why = check_call(name, call)
            if why:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {call}: {why}")
    assert seen > 20  # the docs show many; none found means the search is broken
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "name, call, ok",
    [
        ("hostlib.init", 'hostlib.init(rank, n, "h:48800", "run-7")', True),
        ("hostlib.init", "hostlib.init(rank, n, [CONTROL, ...], job, opts, token=t)", True),
        ("hostlib.init", "hostlib.init(aggregator=[...])", False),
        ("HostOptions", 'HostOptions(elems="auto")', True),
        ("HostOptions", "HostOptions(window_size=4)", False),
    ],
)
def test_the_check_tells_a_stale_call(name, call, ok):
    assert (check_call(name, call) is None) is ok
