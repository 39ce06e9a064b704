"""Commands that only list or hash never import torch: fingerprint and inspect of a
.safetensors file, verify of a folder whose changed file is a plain file. A damaged
checkpoint with a meta.json still gets its tensors located (torch imported then).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import torchverity
from torch_free_probe import cli as _cli
from torchverity.manifest import write_manifest


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("torchfree")
    torch.manual_seed(0)
    tensors = {"w": torch.randn(8, 4), "b": torch.zeros(4, dtype=torch.bfloat16)}
    save_file(tensors, root / "model.safetensors")
    (root / "config.json").write_text('{"hidden": 4}\n')
    torchverity.save(tensors, root / "tv.safetensors")
    write_manifest(root)
    return root


def test_fingerprint_and_inspect_of_safetensors_without_torch(folder: Path) -> None:
    want = torchverity.fingerprint(
        torchverity.load(folder / "tv.safetensors"), mode="exact").root
    fp = _cli("fingerprint", folder / "model.safetensors")
    assert fp["code"] == 0 and fp["torch"] is False
    assert str(fp["out"]).split()[0] == want
    shown = _cli("inspect", "--json", folder / "model.safetensors")
    assert shown["code"] == 0 and shown["torch"] is False
    assert json.loads(str(shown["out"]))["fingerprint"] == want


def test_verify_of_a_changed_plain_file_without_torch(folder: Path, tmp_path: Path) -> None:
    import shutil

    copy = Path(shutil.copytree(folder, tmp_path / "copy"))
    intact = _cli("verify", copy)
    assert intact["code"] == 0 and intact["torch"] is False
    (copy / "config.json").write_text('{"hidden": 5}\n')
    changed = _cli("verify", copy)
    assert changed["code"] == 1 and changed["torch"] is False
    with open(copy / "tv.safetensors", "r+b") as fh:  # damage a checkpoint: located
        fh.seek(-2, 2)
        fh.write(b"\x55")
    damaged = _cli("verify", copy)
    assert damaged["code"] == 1 and "damaged tensors (from its meta.json): b" in str(
        damaged["out"])


def test_diff_of_safetensors_files_and_folders_without_torch(folder: Path,
                                                            tmp_path: Path) -> None:
    """Equal tensors, renamed, reshaped and retyped ones are found from headers and hashes;
    torch is imported only to tell how the bytes of a tensor differ."""
    from safetensors.torch import load_file, save_file

    from torchverity.checkpoint import diff

    same = _cli("diff", folder / "model.safetensors", folder / "tv.safetensors")
    assert same["code"] == 0 and same["torch"] is False
    assert "equal: 2 entries (2 identical)" in str(same["out"])
    tensors = load_file(folder / "model.safetensors")
    save_file({"w": tensors["w"].reshape(4, 8), "b": tensors["b"].float(),
               "extra": torch.ones(2)}, tmp_path / "other.safetensors")
    other = _cli("diff", "--json", folder / "model.safetensors", tmp_path / "other.safetensors")
    assert other["code"] == 1 and other["torch"] is False
    got = json.loads(str(other["out"]))
    assert {e["name"]: e["status"] for e in got["entries"]} == {
        "b": "dtype_changed", "extra": "only_in_b", "w": "shape_changed"}
    # The same entries as comparing the loaded tensors.
    want = diff(tensors, load_file(tmp_path / "other.safetensors")).to_dict()
    assert got["entries"] == json.loads(json.dumps(want["entries"]))
    for name in ("a", "b"):
        torchverity.save(tensors, tmp_path / name, shard_bytes=64)
    assert len(list((tmp_path / "a").glob("*.safetensors"))) == 2
    shards = _cli("diff", tmp_path / "a", tmp_path / "b")
    assert shards["code"] == 0 and shards["torch"] is False
    assert "equal: 2 entries (2 identical)" in str(shards["out"])


def test_diff_opens_only_tensors_whose_bytes_differ(folder: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    flipped = {k: v.clone() for k, v in tensors.items()}
    flipped["w"].view(-1).view(torch.int32)[5] ^= 1 << 30
    save_file(flipped, tmp_path / "flipped.safetensors")
    r = _cli("diff", "--json", folder / "model.safetensors", tmp_path / "flipped.safetensors")
    assert r["code"] == 1 and r["torch"] is False  # the changed tensor is read with numpy
    (entry,) = json.loads(str(r["out"]))["entries"]
    assert (entry["name"], entry["kind"], entry["bit"], entry["field"], entry["first_index"]) \
        == ("w", "bit-flip", 30, "exponent", [1, 1])
