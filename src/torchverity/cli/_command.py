"""A command's parser: the shared options (``--json``), its help, and its handler."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from torchverity.cli._output import Output

Handler = Callable[[argparse.Namespace, Output], int]


def _terminal_width() -> int:
    """``shutil.get_terminal_size().columns`` without importing shutil (and with it zlib,
    bz2 and lzma), which argparse would do for every argument it adds."""
    try:
        columns = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


class HelpFormatter(argparse.HelpFormatter):
    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None) -> None:
        super().__init__(prog, indent_increment, max_help_position,
                         _terminal_width() - 2 if width is None else width)


class Parser(argparse.ArgumentParser):
    """argparse's parser with :class:`HelpFormatter`; subcommands' parsers are of its class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def at_least(minimum: int) -> Callable[[str], int]:
    """An argument type for a whole number of at least ``minimum`` (argparse exits 2 below)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is less than {minimum}")
        return value
    return parse


def add_command(subparsers: Any, common: argparse.ArgumentParser, name: str, run: Handler, *,
                help: str, description: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name, parents=[common], help=help, description=description)
    parser.set_defaults(func=run)
    return parser
