"""docs/options.md, written from the argument parser itself, so the reference cannot drift from
`--help`: `python3 -m specpipe.entrypoints.options_reference` rewrites it, and
tests/docs/test_options_reference.py fails when the file differs from what the parser gives."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterator

from specpipe.entrypoints.cli import build_parser

OUT = Path(__file__).resolve().parents[2] / "docs" / "options.md"

HEADER = """# Every option of every command

Generated from the argument parser by `python3 -m specpipe.entrypoints.options_reference`; do not edit
by hand (tests/docs/test_options_reference.py checks that this file is what the parser gives). What
the options do together: [generating](generating.md), [serving](serving.md),
[several machines](cluster.md), [measuring](measuring.md). Back to the [README](../README.md).
"""


def commands(parser: argparse.ArgumentParser, name: str = "specpipe") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every command and subcommand with its parser, depth first, in the parser's order."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from commands(sub, f"{name} {sub_name}")


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's own arguments (no -h, no subcommand dispatcher)."""
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def undocumented() -> list[str]:
    """`command option` for every argument without help text."""
    return [f"{name} {'/'.join(a.option_strings) or a.dest}" for name, parser in commands(build_parser())
            for a in options(parser) if not a.help or a.help == argparse.SUPPRESS]


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _row(parser: argparse.ArgumentParser, a: argparse.Action) -> str:
    formatter = parser._get_formatter()
    if a.option_strings:
        metavar = "" if a.nargs == 0 else " " + formatter._format_args(a, a.dest.upper())
        flag = ", ".join(f"`{s}{metavar}`" for s in a.option_strings)
    else:
        flag = f"`{a.metavar or a.dest}`"
    text = formatter._expand_help(a) if a.help else ""
    if a.choices is not None and not isinstance(a.choices, dict):
        text += f" (one of: {', '.join(str(c) for c in a.choices)})"
    show = (a.default is not None and a.default is not False and a.default is not argparse.SUPPRESS
            and a.nargs != 0 and a.option_strings)
    default = f"`{a.default}`" if show else ""
    return f"| {_cell(flag)} | {_cell(default)} | {_cell(text)} |"


def render() -> str:
    out = [HEADER]
    for name, parser in commands(build_parser()):
        own = options(parser)
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        out.append(f"## `{name}`\n")
        if name != "specpipe" and parser.description:
            out.append(_cell(parser.description) + "\n")
        if own:
            out.append("| option | default | meaning |\n|---|---|---|")
            out.extend(_row(parser, a) for a in own)
            out.append("")
        if subs:
            out.append("Commands: " + ", ".join(f"`{name} {c}`" for s in subs for c in s.choices) + ".\n")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when docs/options.md differs instead of writing it")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        same = OUT.is_file() and OUT.read_text() == text
        print("docs/options.md is up to date" if same else "docs/options.md differs from the parser: "
              "run python3 -m specpipe.entrypoints.options_reference")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
