"""``torchverity --help`` lists the commands from ``COMMANDS`` without importing any command
module; the table is what the commands' own parsers register, the listing is the golden one,
and every command's own ``--help`` still runs."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import redirect_stderr
from pathlib import Path

import pytest

from torchverity.cli import COMMANDS, _listing_parser, build_parser


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torchverity", *args],
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "80"})


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def test_the_table_is_what_the_commands_register() -> None:
    """Adding, removing or renaming a command, or changing its one-line help, fails here
    until ``COMMANDS`` follows."""
    registered = [(a.dest, a.help) for a in _subcommands(build_parser())._choices_actions]
    assert list(COMMANDS.items()) == registered


def _usage_error(parser: argparse.ArgumentParser, args: list[str]) -> str:
    err = io.StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit) as exited:
        parser.parse_args(args)
    assert exited.value.code == 2
    return err.getvalue()


@pytest.mark.parametrize("columns", ["50", "80", "200"])
def test_the_listing_reads_as_the_full_parser(columns: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", columns)
    full, listing = build_parser(), _listing_parser()
    assert listing.format_help() == full.format_help()
    for args in (["nope"], ["--json"], ["-x"]):
        assert _usage_error(listing, args) == _usage_error(full, args)


def test_top_level_help_is_the_golden_one(golden: Callable[[str, str], None]) -> None:
    helped = _cli("--help")
    assert helped.returncode == 0 and helped.stderr == ""
    golden("help.txt", helped.stdout)
    short = _cli("-h")
    assert (short.returncode, short.stdout, short.stderr) == (0, helped.stdout, "")
    bare = _cli()  # no command: the same list on stderr, and a usage exit
    assert (bare.returncode, bare.stdout, bare.stderr) == (2, "", helped.stdout)


# ``python -m torchverity ARGS`` that writes, as it exits, the command modules it imported
# (-X importtime would not show them: importlib.import_module bypasses its log).
_RECORD_IMPORTS = """
import atexit, runpy, sys
def record(path):
    with open(path, "w") as fh:
        fh.write(" ".join(m for m in sys.modules if m.startswith("torchverity.cli.")))
atexit.register(record, sys.argv[1])
sys.argv = ["torchverity", *sys.argv[2:]]
runpy.run_module("torchverity", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("args", [["--help"], ["-h"], [], ["--version"], ["nope"], ["hash"]])
def test_the_top_level_imports_no_command_module(args: list[str], tmp_path: Path) -> None:
    record = tmp_path / "modules"
    subprocess.run([sys.executable, "-c", _RECORD_IMPORTS, str(record), *args],
                   capture_output=True, check=False)
    imported = record.read_text().split()
    assert "torchverity.cli._command" in imported  # the record is the CLI's
    commands = [m for m in imported if m.startswith("torchverity.cli._cmd_")]
    assert commands == (["torchverity.cli._cmd_hash"] if args == ["hash"] else [])


def _command_paths(parser: argparse.ArgumentParser,
                   path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield (*path, name)
                yield from _command_paths(child, (*path, name))


@pytest.mark.parametrize("path", list(_command_paths(build_parser())), ids=" ".join)
def test_every_command_help_runs(path: tuple[str, ...]) -> None:
    result = _cli(*path, "--help")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.startswith(f"usage: torchverity {' '.join(path)}"), result.stdout
