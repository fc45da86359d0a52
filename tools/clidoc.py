"""docs/cli.md from the click tree: every command of `xdp-agg` and `netns-testbed` with its help.

`make cli-doc` writes the file; tests/house/test_docs.py checks that the committed one is current,
so a changed option shows up in review as a changed page. The help text is click's own, rendered at
a fixed width so that the page does not depend on the terminal it was made in.
"""

import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "cli.md"
WIDTH = 100


def _programs():
    """(program name, root click group) for both console scripts."""
    from netns_testbed.cli import main as testbed_main
    from xdp_agg.app.cli import main as agg_main

    return [("xdp-agg", agg_main), ("netns-testbed", testbed_main)]


def walk(command: click.Command, ctx: click.Context):
    """Yield (context, command) for a command and every subcommand below it, depth first."""
    yield ctx, command
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            sub_ctx = click.Context(
                sub, info_name=name, parent=ctx, max_content_width=WIDTH, terminal_width=WIDTH
            )
            yield from walk(sub, sub_ctx)


def render() -> str:
    """The whole page."""
    out = [
        "# Command-line reference\n",
        "Generated from the click tree by `make cli-doc` (`tools/clidoc.py`); do not edit by hand.",
        "Every command also takes `-h`/`--help`, which prints the same text.\n",
    ]
    for prog, group in _programs():
        root = click.Context(
            group,
            info_name=prog,
            max_content_width=WIDTH,
            terminal_width=WIDTH,
            **group.context_settings,
        )
        for ctx, command in walk(group, root):
            out.append(f"## {ctx.command_path}\n")
            out.append("```text\n" + command.get_help(ctx).rstrip() + "\n```\n")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    """Write the page, or with --check say whether the committed one is current."""
    text = render()
    if "--check" in argv:
        current = PAGE.exists() and PAGE.read_text() == text
        print("docs/cli.md is current" if current else "docs/cli.md is stale: run make cli-doc")
        return 0 if current else 1
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
