"""Both command lines, walked whole: help on every option, an example and --json on every
command, and no help text mangled by a backslash at a line end."""

import io
import re
import tokenize
from pathlib import Path

import click
import pytest

from netns_testbed.cli import main as netns_main
from xdp_agg.app import cli as agg_cli

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = {"xdp-agg": agg_cli.main, "netns-testbed": netns_main}
# Commands without --json, each with its reason.
NO_JSON = {
    "netns-testbed exec": "it becomes the command it runs (exec), whose output is its own",
}


def commands():
    """(path, command) of every command below both programs, groups included."""
    found = []

    def walk(cmd, path):
        found.append((path, cmd))
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")

    for prog, root in PROGRAMS.items():
        walk(root, prog)
    return found


LEAVES = [(p, c) for p, c in commands() if not isinstance(c, click.Group)]


def _root_context(prog: str) -> click.Context:
    # with the program's own settings (-h): click caches each command's help option from the
    # first context it sees, and docs/cli.md is rendered with these
    root = PROGRAMS[prog]
    return click.Context(root, info_name=prog, **root.context_settings)


def _help(path: str, cmd: click.Command) -> str:
    words = path.split()
    ctx = _root_context(words[0])
    group = PROGRAMS[words[0]]
    for word in words[1:]:
        group = group.get_command(ctx, word)
        ctx = click.Context(group, info_name=word, parent=ctx)
    return cmd.get_help(ctx)


@pytest.mark.parametrize("path,cmd", commands(), ids=[p for p, _ in commands()])
def test_every_option_has_help(path, cmd):
    bare = [p.opts[0] for p in cmd.params if isinstance(p, click.Option) and not p.help]
    assert not bare, f"{path}: options without help: {bare}"


@pytest.mark.parametrize("path,cmd", LEAVES, ids=[p for p, _ in LEAVES])
def test_every_command_has_an_example_and_json(path, cmd):
    assert "Example" in (cmd.help or ""), f"{path}: its help shows no example"
    names = {o for p in cmd.params for o in getattr(p, "opts", [])}
    assert ("--json" in names) != (path in NO_JSON), (
        f"{path}: --json missing (or listed in NO_JSON)"
    )


def test_job_create_example_keeps_its_continuation_lines():
    text = _help("xdp-agg job create", agg_cli.job_create)
    assert any(line.strip().startswith("--parent-address 198.18.0.1") for line in text.splitlines())


def _continued_strings(path: Path) -> list[int]:
    """Lines of non-raw string literals with a backslash at a line end: Python joins the two
    lines there, which in a --help example silently glues a shell continuation into one line."""
    bad = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type != tokenize.STRING or "r" in tok.string.split(tok.string[-1])[0].lower():
            continue
        # an odd number of backslashes before the newline: the last one escapes it
        if re.search(r"(?<!\\)(\\\\)*\\\n", tok.string):
            bad.append(tok.start[0])
    return bad


@pytest.mark.parametrize("module", ["xdp_agg/app/cli.py", "netns_testbed/cli.py"])
def test_no_help_text_is_glued_by_a_backslash(module):
    assert not _continued_strings(ROOT / module), f"{module}: use r-strings there"


def test_the_glue_check_sees_one(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        'def f():\n    """a \\\n    b"""\n\n\ndef g():\n    r"""a \\\n    b"""\n'
        '\n\ndef h():\n    """a \\\\\n    b"""\n'
    )
    assert _continued_strings(f) == [2]
