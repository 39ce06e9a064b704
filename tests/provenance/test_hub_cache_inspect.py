"""Files in a Hugging Face hub cache, as hf_hub_download stores them: inspect shows the hub's
own record (an LFS blob is named by its SHA-256) as verify checks it, and a diffusers
pipeline in the cache verifies and scans component by component."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from provenance_helpers import flip_bit, hub_cache_from_folder
from safetensors.torch import save_file

from torch_zip_artifacts import tiny_ldm_pipeline

_REV = "a" * 40


def _model_folder(folder: Path) -> Path:
    folder.mkdir()
    save_file({"w": torch.arange(64, dtype=torch.float32)}, folder / "model.safetensors")
    torch.save({"w": torch.ones(3)}, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    return folder


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
def test_inspect_checks_a_hub_file_against_its_blob_name(
        tmp_path: Path, name: str, run_cli: Callable[..., Any]) -> None:
    storage = hub_cache_from_folder(tmp_path / "hub", "org/tiny", _REV,
                                    _model_folder(tmp_path / "m"))
    file = storage / "snapshots" / _REV / name
    result = run_cli("inspect", file)
    assert result.code == 0, result.err
    assert "matches the hub's record (its blob's name)" in result.out
    assert "no sidecar" not in result.out
    doc = json.loads(run_cli("inspect", "--json", file).out)
    blob = file.resolve()
    assert doc["sidecar"] == {"status": "ok", "algo": "sha256", "actual": blob.name,
                              "expected": blob.name, "sidecar": str(blob), "source": "hub",
                              "entry": None}

    flip_bit(blob, blob.stat().st_size - 2)
    result = run_cli("inspect", file)
    assert result.code == 1 and "Traceback" not in result.err
    assert f"DOES NOT MATCH the hub's record (its blob's name) (expected {blob.name})" \
        in result.out
    doc = json.loads(run_cli("inspect", "--json", file).out)
    assert doc["ok"] is False and doc["sidecar"]["status"] == "mismatched"


def test_a_diffusers_pipeline_in_a_hub_cache_verifies_and_scans(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    pytest.importorskip("diffusers")
    tiny_ldm_pipeline(tmp_path / "pipe")
    storage = hub_cache_from_folder(tmp_path / "hub", "org/ldm", _REV, tmp_path / "pipe")
    snapshot = storage / "snapshots" / _REV

    result = run_cli("verify", "--json", snapshot)
    assert result.code == 0, result.err
    scan = json.loads(run_cli("scan", "--json", snapshot).out)
    assert sorted(Path(f["path"]).relative_to(snapshot).as_posix() for f in scan["files"]) == [
        "unet/diffusion_pytorch_model.safetensors", "vqvae/diffusion_pytorch_model.safetensors"]
    assert all(f["verdict"] == "safe" for f in scan["files"])
    listed = json.loads(run_cli("inspect", "--json", snapshot).out)
    assert sorted(listed["components"]) == ["unet", "vqvae"]
    assert all(c["sidecar"]["status"] == "ok" and c["sidecar"]["source"] == "hub"
               for c in listed["components"].values())

    blob = (snapshot / "unet" / "diffusion_pytorch_model.safetensors").resolve()
    flip_bit(blob, blob.stat().st_size - 2)
    result = run_cli("verify", snapshot)
    assert result.code == 1 and "Traceback" not in result.err
    assert "unet/diffusion_pytorch_model.safetensors" in result.out + result.err
    assert "vqvae/diffusion_pytorch_model.safetensors" not in result.out
    listed = json.loads(run_cli("inspect", "--json", snapshot).out)
    assert listed["ok"] is False
    assert listed["components"]["unet"]["sidecar"]["status"] == "mismatched"
    assert listed["components"]["vqvae"]["sidecar"]["status"] == "ok"


class _Lin(torch.nn.Module):
    input_spec = ("x:float32:-1,4",)

    def __init__(self) -> None:
        super().__init__()
        self.l = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x)


def test_serve_takes_weights_from_a_hub_cache(tmp_path: Path) -> None:
    """The hub's record (the blob's name) vouches for the weights as a sidecar does, as it
    does for load, golden and batch; a changed blob keeps the service from starting."""
    pytest.importorskip("fastapi")
    from torchverity.errors import IntegrityError
    from torchverity.serve import Client, create_app
    from uvicorn_server import start

    torch.manual_seed(0)
    folder = tmp_path / "m"
    folder.mkdir()
    save_file(_Lin().state_dict(), folder / "model.safetensors")
    (folder / "config.json").write_text("{}")
    snapshot = hub_cache_from_folder(tmp_path / "hub", "org/lin", _REV, folder) / "snapshots" \
        / _REV
    svc = start(create_app(_Lin, snapshot, recheck_interval=None))
    try:
        with Client(svc.url) as client:
            weights = client.metadata()["parameters"]["weights"]
    finally:
        svc.stop()
    blob = (snapshot / "model.safetensors").resolve()
    assert weights["verified_by"] == "hub" and weights["digest"] == blob.name
    flip_bit(blob, blob.stat().st_size - 2)
    with pytest.raises(IntegrityError, match="the name the Hugging Face hub gave it"):
        create_app(_Lin, snapshot, recheck_interval=None)
