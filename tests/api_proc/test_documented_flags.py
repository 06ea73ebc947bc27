"""The flags the docs document are exactly the flags the commands take: docs/command-line.md for
`pagoda serve` and `pagoda generate` (and the top-level `--log-level` / `--log-format`), docs/router.md
for `pagoda router`. None missing from the tables, none in them that the parser does not know."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from pagoda.api_proc.cli import build_parser

DOCS = Path(__file__).resolve().parents[2] / "docs"
GUIDES = {"command-line.md": ("serve", "generate"), "router.md": ("router",)}  # guide -> the commands it documents
FLAG = re.compile(r"`(--[a-z0-9][a-z0-9-]*)")  # `--max-n N`, `--top-p P` / `--top-k K`: every flag a cell names


# Flags that print and exit, never a setting: the docs name them in prose, not in the tables of settings.
PRINT_AND_EXIT = {"--help", "--version"}


def _long_flags(parser: argparse.ArgumentParser) -> set[str]:
    flags = {flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")}
    return flags - PRINT_AND_EXIT


def real_flags(commands: tuple[str, ...]) -> set[str]:
    parser = build_parser()
    flags = _long_flags(parser)  # --log-level, --log-format
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in commands:
        flags |= _long_flags(subcommands.choices[command])
    return flags


def documented_flags(text: str) -> set[str]:
    """The flags named in the first column of the markdown tables of `text`."""
    flags = set()
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("|"):
            continue
        first_cell = line.strip("|").split("|")[0]
        flags |= set(FLAG.findall(first_cell))
    return flags


def test_the_parser_reports_its_flags():
    flags = real_flags(("serve", "generate"))
    assert {"--log-level", "--max-n", "--header-timeout", "--keepalive-timeout", "--top-k", "--model"} <= flags
    assert not flags & PRINT_AND_EXIT
    assert {"--backend", "--policy", "--eject-after-failures", "--read-timeout"} <= real_flags(("router",))


def test_the_table_parser_reads_cells_that_name_two_flags():
    table = "| flag | default |\n|---|---|\n| `--top-p P` / `--top-k K` | 1.0 / 0 |\n| `--chat` | off |\n"
    assert documented_flags(table) == {"--top-p", "--top-k", "--chat"}
    assert documented_flags("```\n| `--in-a-code-block` |\n```\n| `PAGODA_CACHE` | see `--not-first` |") == set()


@pytest.mark.parametrize("guide", GUIDES)
def test_every_real_flag_is_documented(guide):
    missing = real_flags(GUIDES[guide]) - documented_flags((DOCS / guide).read_text())
    assert not missing, f"flags missing from the tables of {guide}: {sorted(missing)}"


@pytest.mark.parametrize("guide", GUIDES)
def test_every_documented_flag_exists(guide):
    unknown = documented_flags((DOCS / guide).read_text()) - real_flags(GUIDES[guide])
    commands = " / ".join(f"`pagoda {c}`" for c in GUIDES[guide])
    assert not unknown, f"{guide} documents flags that {commands} do not take: {sorted(unknown)}"
