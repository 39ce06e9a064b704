"""The ``torchverity`` command.

Each command lives in its own module ``torchverity.cli._cmd_<name>`` that
defines ``register(subparsers, common)``; ``COMMANDS`` lists them with their one-line
help. A command imports only its own module, and that module imports heavy libraries
(torch, fastapi, ray) inside its handler; ``torchverity --help`` imports none of them.

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
from typing import Any

from torchverity.cli._command import Parser
from torchverity.cli._output import Output, reader_may_leave
from torchverity.errors import EXIT_INTERNAL, EXIT_USAGE, TorchVerityError


def _common_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    common.add_argument(
        "--json", action="store_true", help="write the result as one JSON document on stdout"
    )
    return common


def _top_parser() -> tuple[argparse.ArgumentParser, Any]:
    """The ``torchverity`` parser and its (still empty) subcommand action."""
    from torchverity import __version__

    parser = Parser(
        prog="torchverity",
        description="Make silent data corruption in PyTorch loud, located and recoverable.",
    )
    parser.add_argument("--version", action="version", version=f"torchverity {__version__}")
    return parser, parser.add_subparsers(dest="command", metavar="COMMAND")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or (``command``) one with only that command's module registered:
    a command's start-up then pays for its own options, not every command's."""
    parser, subparsers = _top_parser()
    common = _common_parser()
    # A named command imports its own module only: another command's imports (asyncio,
    # sqlite3...) stay off its start-up.
    modules = (_command_module(command),) if command in COMMANDS else _command_modules()
    for module in modules:
        module.register(subparsers, common)
    return parser


def _listing_parser() -> argparse.ArgumentParser:
    """The top level alone (``--help``, ``--version``, no or an unknown command): its
    command list comes from ``COMMANDS``, so no command module is imported."""
    parser, subparsers = _top_parser()
    for name, line in COMMANDS.items():
        subparsers.add_parser(name, help=line, add_help=False)
    return parser


# Every command and the line ``torchverity --help`` shows for it, in that order. Each line
# is the ``help=`` its module registers; tests/cli/test_command_table.py compares the two.
COMMANDS: dict[str, str] = {
    "hash": "print file digests like b3sum or sha256sum; --write sidecars",
    "manifest": "write a manifest of every file in a folder",
    "verify": "check files and folders against their records",
    "inject": "fault drills: flip a bit or truncate a file",
    "fingerprint": "content fingerprint of a checkpoint (same for .pt, .safetensors, shards)",
    "diff": "compare two checkpoints tensor by tensor (bit flips, drift, shape changes)",
    "inspect": "tensors, sizes, fingerprint, meta.json, sidecar and scan verdict of a checkpoint",
    "scan": "check checkpoints/pickles for code without running them",
    "migrate": "convert a legacy checkpoint to a weights_only-loadable state_dict",
    "explain": "explain a checkpoint save/load error message",
    "report": "summarise a TrainingGuard event log",
    "golden": "record and check golden outputs of a model",
    "selftest": "test that a device computes and stores correctly",
    "doctor": "check this environment for silent-corruption risks",
    "sign": "sign a model folder or file (OpenSSF model signing)",
    "attest": "write an in-toto attestation for a checkpoint (optionally signed)",
    "serve": "serve a model from verified weights (extra: serve)",
    "batch": "run batch inference with a crash-safe journal; verify its outputs",
    "run": "run a command with every checkpoint load and save verified",
    "demo": "run the end-to-end demo on built-in data",
}


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
    with reader_may_leave():
        return _main(list(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(first) if first in COMMANDS else _listing_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    out = Output(json_mode=bool(getattr(args, "json", False)))
    debug = os.environ.get("TORCHVERITY_DEBUG") == "1"
    return _run(args, out, debug)


def _run(args: argparse.Namespace, out: Output, debug: bool) -> int:
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
