"""Folder scans: a folder with nothing to judge is not a pass."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from torchverity.pickles._scan import scan


def test_an_empty_folder_is_not_a_pass(tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    empty = tmp_path / "downloads ü"
    empty.mkdir()
    res = run_cli("scan", empty)
    assert res.code == 2, (res.out, res.err)
    assert f"{empty}: nothing to scan: the folder holds no file" in res.err
    assert f"next: check the path (ls -la '{empty}')" in res.err
    doc = json.loads(run_cli("scan", "--json", empty).out)
    assert doc["ok"] is False and doc["empty"] == [os.fspath(empty)] and doc["files"] == []
    report = scan(empty)
    assert not report.ok and report.empty == (os.fspath(empty),)


def test_a_folder_of_files_that_hold_no_pickle_says_what_it_skipped(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    (folder / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    res = run_cli("scan", folder)
    assert res.code == 2, (res.out, res.err)
    assert ("nothing to scan: none of its 2 files can hold a pickle (skipped: text file, "
            "no pickle), so this scan vouches for nothing") in res.err
    assert f"{folder / 'vocab.txt'}: skipped (text file, no pickle)" in res.out
    # With a real checkpoint beside them, the folder is judged as before.
    torch.save({"w": torch.ones(2)}, folder / "model.pt")
    save_file({"w": torch.ones(2)}, folder / "model.safetensors")
    res = run_cli("scan", folder)
    assert res.code == 0 and "nothing to scan" not in res.err, res.err
    assert "scanned 2 files: 2 safe; skipped 2 that hold no pickle" in res.err
