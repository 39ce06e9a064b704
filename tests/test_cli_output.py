"""One output path for every command: ``Output.result`` writes ``--json`` documents, a
renderer writes for people; closed-set options offer exactly their ``Literal``'s values."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any, get_args

import torchverity.cli
from torchverity.cli import build_parser
from torchverity.cli._output import Output

CLI = Path(torchverity.cli.__file__).parent


def _outputs(json_mode: bool) -> tuple[Output, io.StringIO, io.StringIO]:
    stdout, stderr = io.StringIO(), io.StringIO()
    return Output(json_mode=json_mode, stdout=stdout, stderr=stderr), stdout, stderr


def test_json_mode_writes_the_document_and_never_renders() -> None:
    out, stdout, stderr = _outputs(json_mode=True)
    rendered: list[str] = []
    code = out.result({"ok": True, "path": Path("a/b"), "n": 2},
                      lambda: rendered.append("drawn") or out.line("for people"))
    assert code == 0 and rendered == [] and stderr.getvalue() == ""
    assert json.loads(stdout.getvalue()) == {"ok": True, "path": "a/b", "n": 2}


def test_people_get_the_renderer_and_no_json() -> None:
    out, stdout, stderr = _outputs(json_mode=False)
    code = out.result({"ok": False, "n": 2}, lambda: (out.line("2 problems"), out.info("fix")))
    assert code == 1
    assert stdout.getvalue() == "2 problems\n" and stderr.getvalue() == "fix\n"


def test_the_exit_code_follows_ok_unless_given() -> None:
    class Report:
        ok = False

    out, stdout, _ = _outputs(json_mode=False)
    assert out.result(Report()) == 1  # an attribute serves as well as a key
    assert out.result({"ok": True}) == 0 and stdout.getvalue() == ""
    assert out.result({"ok": False}, exit_code=137) == 137


def test_command_modules_leave_json_to_output() -> None:
    """A command builds its data once and hands it to Output.result; none prints JSON or
    branches on --json itself."""
    modules = sorted(CLI.glob("_cmd_*.py"))
    assert len(modules) >= 20
    for module in modules:
        assert "json_mode" not in module.read_text(encoding="utf-8"), module.name


def _choice_options() -> dict[tuple[str, ...], tuple[Any, ...]]:
    found: dict[tuple[str, ...], tuple[Any, ...]] = {}

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    walk(child, (*path, name))
            elif action.choices is not None:
                found[(*path, action.option_strings[0])] = tuple(action.choices)

    walk(build_parser(), ())
    return found


def test_every_choice_list_is_its_literal() -> None:
    from torchverity.batch._item import DurabilityMode, EngineName
    from torchverity.checkpoint._fp_record import NamedMode
    from torchverity.cli._cmd_serve import LogLevel
    from torchverity.digest import Algorithm
    from torchverity.golden._compare import CompareMode
    from torchverity.manifest import ManifestFormat
    from torchverity.protection._state import Policy as ProtectPolicy
    from torchverity.serve._digest_fields import Policy as DigestPolicy

    expected = {
        ("hash", "--algo"): get_args(Algorithm),
        ("manifest", "--algo"): get_args(Algorithm),
        ("manifest", "--format"): get_args(ManifestFormat),
        ("fingerprint", "--mode"): get_args(NamedMode),
        ("golden", "check", "--mode"): ("auto", *get_args(CompareMode)),
        ("run", "--policy"): get_args(ProtectPolicy),
        ("serve", "--digest-policy"): get_args(DigestPolicy),
        ("serve", "--log-level"): get_args(LogLevel),
        ("batch", "run", "--engine"): get_args(EngineName),
        ("batch", "run", "--durability"): get_args(DurabilityMode),
    }
    assert _choice_options() == expected
