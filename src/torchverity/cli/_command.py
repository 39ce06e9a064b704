"""A command's parser: the shared options (``--json``), its help, and its handler."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from torchverity.cli._output import Output

Handler = Callable[[argparse.Namespace, Output], int]


def add_command(subparsers: Any, common: argparse.ArgumentParser, name: str, run: Handler, *,
                help: str, description: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name, parents=[common], help=help, description=description)
    parser.set_defaults(func=run)
    return parser
