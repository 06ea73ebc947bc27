"""The flags docs/command-line.md documents are exactly the flags `pagoda serve` and `pagoda generate`
take (and the top-level `--log-level` / `--log-format`): none missing from the tables, none in them
that the parser does not know."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from api_proc.cli import build_parser

DOC = Path(__file__).resolve().parents[2] / "docs" / "command-line.md"
COMMANDS = ("serve", "generate")
FLAG = re.compile(r"`(--[a-z0-9][a-z0-9-]*)")  # `--max-n N`, `--top-p P` / `--top-k K`: every flag a cell names


def _long_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")} - {"--help"}


def real_flags() -> set[str]:
    parser = build_parser()
    flags = _long_flags(parser)  # --log-level, --log-format
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in COMMANDS:
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
    flags = real_flags()
    assert {"--log-level", "--max-n", "--header-timeout", "--keepalive-timeout", "--top-k", "--model"} <= flags
    assert "--help" not in flags


def test_the_table_parser_reads_cells_that_name_two_flags():
    table = "| flag | default |\n|---|---|\n| `--top-p P` / `--top-k K` | 1.0 / 0 |\n| `--chat` | off |\n"
    assert documented_flags(table) == {"--top-p", "--top-k", "--chat"}
    assert documented_flags("```\n| `--in-a-code-block` |\n```\n| `PAGODA_CACHE` | see `--not-first` |") == set()


def test_every_real_flag_is_documented():
    missing = real_flags() - documented_flags(DOC.read_text())
    assert not missing, f"flags missing from the tables of {DOC.name}: {sorted(missing)}"


def test_every_documented_flag_exists():
    unknown = documented_flags(DOC.read_text()) - real_flags()
    assert not unknown, f"{DOC.name} documents flags that `pagoda serve` / `generate` do not take: {sorted(unknown)}"
