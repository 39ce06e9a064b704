"""The event log as documented in docs/formats/protect.md, and where a catch is located."""

from __future__ import annotations

import contextlib
import json
import re
import typing
from pathlib import Path

import torch
from protect_helpers import flip_tensor_bit

import torchverity
from torchverity.cli._cmd_run import _read_log
from torchverity.protection import protected
from torchverity.protection._state import EventKind

DOC = Path(__file__).resolve().parents[2] / "docs" / "formats" / "protect.md"
COMMON = {"time": str, "pid": int, "kind": str, "api": str, "message": str}


def _session(tmp_path: Path) -> list[dict]:
    good, bad, plain = tmp_path / "good.pt", tmp_path / "bad.pt", tmp_path / "plain.pt"
    log = tmp_path / "log.jsonl"
    torch.save({"w": torch.ones(8)}, plain)
    with protected("warn", log=log):
        torch.save({"w": torch.ones(8)}, good)
        torchverity.save({"w": torch.ones(8)}, bad)
        flip_tensor_bit(bad)
        torch.load(good)
        torch.load(bad)
        torch.load(plain, weights_only=False)
        torch.nn.Linear(2, 2).load_state_dict({}, strict=False)
        with contextlib.suppress(FileNotFoundError):
            torch.load(tmp_path / "missing.pt")
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_every_record_has_the_documented_fields_and_kinds(tmp_path: Path) -> None:
    records = _session(tmp_path)
    kinds_table = DOC.read_text().split("## Kinds", 1)[1]
    documented = set(re.findall(r"^\| `([a-z-]+)` \|", kinds_table, re.MULTILINE))
    assert documented == set(typing.get_args(EventKind))
    for record in records:
        assert all(isinstance(record[k], t) for k, t in COMMON.items()), record
        assert record["kind"] in documented
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "started" and kinds[-1] == "summary"
    for kind in ("saved", "verified", "mismatch", "unsafe-load", "partial-load",
                 "load-failure", "swallowed"):
        assert kind in kinds, kind
    summary = records[-1]
    counted = {k: kinds.count(k) for k in set(kinds) - {"summary"}}
    assert {k: v for k, v in summary["counts"].items() if k != "summary"} == counted
    assert summary["swallowed"] == 1 and summary["policy"] == "warn"


def test_a_catch_by_contextlib_suppress_is_located_at_its_with_line(tmp_path: Path) -> None:
    [swallowed] = [r for r in _session(tmp_path) if r["kind"] == "swallowed"]
    source = Path(__file__).read_text().splitlines()
    line = next(i for i, text in enumerate(source, 1)
                if "contextlib.suppress(FileNotFoundError)" in text)
    assert swallowed["caught_in"] == f"{__file__}:{line} (_session)"
    assert swallowed["error"].startswith("FileNotFoundError: [Errno 2]")


def test_a_torn_last_line_is_skipped_by_readers(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text('{"kind": "started", "pid": 1}\n{"kind": "verif')
    assert _read_log(log) == [{"kind": "started", "pid": 1}]
