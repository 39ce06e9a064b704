"""The ``torchverity`` command.

Each command lives in its own module ``torchverity.cli._cmd_<name>`` that
defines ``register(subparsers, common)``; ``COMMANDS`` lists them. Command modules
import heavy libraries (torch, fastapi, ray) inside their handlers, keeping ``--help`` fast.

Exit codes: 0 ok, 1 a check failed, 2 bad usage or unreadable input, 3 an
internal error (a bug to report). A traceback is printed only when ``TORCHVERITY_DEBUG=1``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from torchverity.cli._command import Parser
from torchverity.cli._output import Output
from torchverity.errors import EXIT_INTERNAL, EXIT_USAGE, TorchVerityError


def _common_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    common.add_argument(
        "--json", action="store_true", help="write the result as one JSON document on stdout"
    )
    return common


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or (``command``) one with only that command's module registered:
    a command's start-up then pays for its own options, not every command's."""
    from torchverity import __version__

    parser = Parser(
        prog="torchverity",
        description="Make silent data corruption in PyTorch loud, located and recoverable.",
    )
    parser.add_argument("--version", action="version", version=f"torchverity {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    common = _common_parser()
    # A named command imports its own module only: another command's imports (asyncio,
    # sqlite3...) stay off its start-up.
    modules = (_command_module(command),) if command in COMMANDS else _command_modules()
    for module in modules:
        module.register(subparsers, common)
    return parser


# Every command, in the order ``--help`` lists them. Each module defines
# ``register(subparsers, common)`` and imports heavy libraries inside its handler.
COMMANDS = (
    "hash", "manifest", "verify", "inject", "fingerprint", "diff", "inspect",
    "scan", "migrate", "explain", "report", "golden", "selftest", "doctor",
    "sign", "attest", "serve", "batch", "run", "demo",
)


@functools.lru_cache(maxsize=1)
def _command_modules() -> tuple[ModuleType, ...]:
    """The command modules, imported once per process (the folder may not stay readable:
    a process that drops privileges still has its commands)."""
    return tuple(_command_module(name) for name in COMMANDS)


@functools.cache
def _command_module(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}._cmd_{name}")


def _report_error(exc: TorchVerityError, out: Output) -> None:
    out.result({"ok": False, **exc.to_dict()})
    out.err.write(f"torchverity: error: {exc.message}\n")
    if exc.hint:
        out.err.write(f"  next: {exc.hint}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return the exit code (the console script exits with it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(first if first and first.isidentifier() else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    out = Output(json_mode=bool(getattr(args, "json", False)))
    debug = os.environ.get("TORCHVERITY_DEBUG") == "1"
    try:
        return int(args.func(args, out))
    except TorchVerityError as exc:
        if debug:
            raise
        _report_error(exc, out)
        return exc.exit_code
    except KeyboardInterrupt:
        out.err.write("torchverity: interrupted\n")
        return 130
    except Exception as exc:
        if debug:
            raise
        out.err.write(
            f"torchverity: internal error: {type(exc).__name__}: {exc}\n"
            "  next: rerun with TORCHVERITY_DEBUG=1 for the traceback and report it\n"
        )
        return EXIT_INTERNAL
