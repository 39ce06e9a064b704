"""Watched saves: atomic, with records a later load verifies; streams untouched."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from protect_helpers import SRC

import torchverity
from torchverity.protection import protected


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(32, 32, generator=g), "step": torch.tensor(7)}


class Config:
    def __init__(self) -> None:
        self.lr = 0.5


class Exploding:
    def __reduce__(self) -> tuple[object, ...]:
        raise RuntimeError("cannot pickle this")


def test_torch_save_gets_a_sidecar_and_meta_that_torchverity_load_requires(
        tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    with protected("refuse"):
        assert torch.save(_state(), path) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model.pt", "model.pt.blake3", "model.pt.meta.json"]
    obj, report = torchverity.load(path, sidecar="require", with_report=True)
    assert report.verified and report.fingerprint_check == "bound"
    assert torch.equal(obj["w"], _state()["w"])
    assert torchverity.checkpoint.read_meta(path)["user"] == {"saved_by": "torch.save"}


def test_objects_meta_json_cannot_describe_get_a_sidecar_and_still_load(
        tmp_path: Path) -> None:
    path = tmp_path / "full.pt"
    torchverity.save(_state(), path)  # an older save left a meta.json
    with protected("refuse"):
        torch.save({"config": Config(), "w": torch.ones(3)}, path, pickle_protocol=4)
        again = torch.load(path, weights_only=False)
    assert again["config"].lr == 0.5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.pt", "full.pt.blake3"]
    assert torchverity.verify_file(path).ok


def test_legacy_format_and_streams_pass_through(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with protected("refuse"):
        torch.save(_state(), buffer)
        torch.save(_state(), tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    assert buffer.getvalue()[:4] == b"PK\x03\x04"
    assert (tmp_path / "old.pt").read_bytes()[:2] == b"\x80\x02"
    assert torchverity.verify_file(tmp_path / "old.pt").ok


def test_a_failed_save_leaves_the_previous_checkpoint_and_its_records(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    with protected("refuse"):
        torch.save(_state(), path)
        before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
        with pytest.raises(RuntimeError, match="cannot pickle this"):
            torch.save({"w": torch.zeros(3), "bad": Exploding()}, path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert torchverity.load(path, sidecar="require")["step"] == 7


def test_save_file_keeps_its_metadata_and_records_the_file(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    state = {"w": _state()["w"], "half": torch.ones(4, dtype=torch.bfloat16)}
    with protected("refuse"):
        safetensors.torch.save_file(state, path, metadata={"format": "pt"})
        loaded = safetensors.torch.load_file(path)
    with safetensors.safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert torchverity.load(path, sidecar="require", with_report=True)[1].verified


SAVER = """
import sys, torch
from torchverity.protection import protect
protect("refuse")
torch.save({"w": torch.full((256,), float(sys.argv[2]))}, sys.argv[1])
"""


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
@pytest.mark.parametrize("window", [1, 2, 3, 4])  # file, sidecar, meta.json renamed; done
def test_a_save_killed_at_any_rename_leaves_a_verified_checkpoint(
        tmp_path: Path, window: int) -> None:
    path = tmp_path / "model.pt"
    (tmp_path / "saver.py").write_text(SAVER)
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "saver.py", str(path), "1"], cwd=tmp_path, env=env,
                   check=True, timeout=120)
    calls = "rename,renameat,renameat2"
    subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", "-e", f"trace={calls}",
                    "-e", f"inject={calls}:signal=KILL:when={window}", sys.executable,
                    "saver.py", str(path), "2"], cwd=tmp_path, env=env, timeout=120)
    value = torchverity.load(path, sidecar="require")["w"][0].item()
    assert value in (1.0, 2.0)
    with protected("refuse"):
        assert torch.load(path)["w"][0].item() == value


def test_a_save_through_a_symbolic_link_writes_into_the_linked_file(tmp_path: Path) -> None:
    real = tmp_path / "blobs" / "model.pt"
    real.parent.mkdir()
    torch.save({"w": torch.zeros(2)}, real)
    link = tmp_path / "model.pt"
    link.symlink_to(real)
    with protected("refuse"):
        torch.save({"w": torch.ones(2)}, link)
    assert link.is_symlink() and torch.equal(torch.load(real)["w"], torch.ones(2))
