"""A folder scan of a Hugging Face hub cache judges each real file once, under the snapshot
path a user knows, and still judges blobs no snapshot reaches."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from provenance_helpers import hub_cache_from_folder
from safetensors.torch import save_file

from torchverity.pickles._scan import scan

_A, _B = "a" * 40, "b" * 40


def _revision(folder: Path, scale: float) -> Path:
    folder.mkdir()
    save_file({"w": torch.full((4,), scale)}, folder / "model.safetensors")
    torch.save({"w": torch.ones(3)}, folder / "pytorch_model.bin")  # the same in both
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    return folder


def test_each_file_of_a_hub_cache_is_scanned_once(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    cache = tmp_path / "hub"
    hub_cache_from_folder(cache, "org/tiny", _A, _revision(tmp_path / "r1", 1.0), "v1")
    storage = hub_cache_from_folder(cache, "org/tiny", _B, _revision(tmp_path / "r2", 2.0))
    snap_a, snap_b = storage / "snapshots" / _A, storage / "snapshots" / _B
    report = scan(cache)
    judged = {Path(r.path).relative_to(storage).as_posix(): r for r in report.results}
    assert sorted(judged) == [f"snapshots/{_A}/model.safetensors",
                              f"snapshots/{_A}/pytorch_model.bin",
                              f"snapshots/{_B}/model.safetensors"]
    assert all(r.verdict == "safe" for r in report.results)
    assert judged[f"snapshots/{_A}/pytorch_model.bin"].aliases == (
        str(snap_b / "pytorch_model.bin"),)
    assert not any("/blobs/" in s.path for s in report.skipped)
    assert sum(s.path.endswith("config.json") for s in report.skipped) == 1

    res = run_cli("scan", cache)
    assert res.code == 0, res.err
    assert f"  same file as: {snap_b / 'pytorch_model.bin'}" in res.out
    assert "/blobs/" not in res.out and "scanned 3 files: 3 safe" in res.err

    # A blob that no snapshot reaches any more (its revision's folder was removed) is
    # still judged, under its blob path.
    shutil.rmtree(snap_a)
    report = scan(cache)
    names = sorted(Path(r.path).relative_to(storage).parts[0] for r in report.results)
    assert names == ["blobs", "snapshots", "snapshots"]
    orphan = next(r for r in report.results if "/blobs/" in r.path)
    assert orphan.format == "safetensors" and orphan.aliases == ()
