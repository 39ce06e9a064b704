"""Weights that torch.hub downloaded (``load_state_dict_from_url``, as torchvision's
pretrained models are fetched) carry the first hex digits of their SHA-256 in their name.
``torchverity verify`` and ``torchverity.load`` check a file in torch.hub's checkpoints
folder against them: an intact download verifies and loads with no warning, a flipped bit
is named with the call that fetches the file again, and a hex-looking name elsewhere is
not taken for a record. Under protection, a load through torch.hub itself (code you don't
own) is checked against the same name."""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import torchverity
from torchverity.inject import flip_bit
from torchverity.protection import protected


@pytest.fixture()
def cached(tmp_path: Path) -> Path:
    """A file as torch.hub stores it: downloaded from a URL whose name holds the prefix."""
    source = tmp_path / "source.pth"
    torch.save({"conv.weight": torch.arange(64.0).reshape(4, 16)}, source)
    name = f"tiny-{hashlib.sha256(source.read_bytes()).hexdigest()[:8]}.pth"
    origin = tmp_path / "origin"
    origin.mkdir()
    shutil.copy(source, origin / name)
    home = tmp_path / "torch" / "hub" / "checkpoints"
    torch.hub.load_state_dict_from_url((origin / name).as_uri(), model_dir=str(home),
                                       check_hash=True, progress=False)
    return home / name


def test_an_intact_download_verifies_and_loads_against_its_name(
        cached: Path, run_cli: Callable[..., Any]) -> None:
    done = run_cli("verify", str(cached), "--json")
    assert done.code == 0, done.out + done.err
    result = json.loads(done.out)["results"][0]
    assert result["record"].startswith("the SHA-256 prefix in its name")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no meta.json: no fingerprint to compare
        state, report = torchverity.load(cached, with_report=True)
    assert report.digest_source == "torch-hub"  # its bytes were checked against the name
    assert torch.equal(state["conv.weight"], torch.arange(64.0).reshape(4, 16))


def test_a_flipped_bit_in_a_download_is_named(cached: Path, run_cli: Callable[..., Any]) -> None:
    shown = run_cli("inspect", str(cached))
    assert shown.code == 0 and "matches the SHA-256 prefix in its name" in shown.out, shown.out
    flip_bit(cached, cached.stat().st_size - 400, 3)
    shown = run_cli("inspect", str(cached))
    assert shown.code == 1 and "DOES NOT MATCH the SHA-256 prefix in its name" in shown.out
    done = run_cli("verify", str(cached), "--json")
    assert done.code == 1
    assert json.loads(done.out)["results"][0]["entries"][0]["status"] == "mismatched"
    with pytest.raises(torchverity.IntegrityError) as caught:
        torchverity.load(cached)
    assert "load_state_dict_from_url" in str(caught.value)
    told = run_cli("verify", str(cached))
    assert "load_state_dict_from_url(url, check_hash=True)" in told.out + told.err
    assert caught.value.expected == cached.name.split("-")[1][:8]


def test_a_hex_looking_name_outside_torch_hub_is_no_record(cached: Path,
                                                           tmp_path: Path,
        run_cli: Callable[..., Any]) -> None:
    elsewhere = tmp_path / "models" / cached.name
    elsewhere.parent.mkdir()
    shutil.copy(cached, elsewhere)
    done = run_cli("verify", str(elsewhere), "--json")
    assert done.code == 2
    assert "no sidecar" in json.loads(done.out)["message"]


def _hub_load(cached: Path) -> dict[str, torch.Tensor]:
    """What torchvision's weights=... does: the URL again, answered from the cache."""
    url = (cached.parents[3] / "origin" / cached.name).as_uri()
    state: dict[str, torch.Tensor] = torch.hub.load_state_dict_from_url(
        url, model_dir=str(cached.parent), check_hash=False, progress=False)
    return state


def _events(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_under_protection_a_torch_hub_load_is_verified_against_the_name(
        cached: Path, tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    with protected("refuse", log=log):
        state = _hub_load(cached)
    assert torch.equal(state["conv.weight"], torch.arange(64.0).reshape(4, 16))
    verified = [e for e in _events(log) if e["kind"] == "verified"]
    assert [(e["path"], e["source"]) for e in verified] == [(str(cached), "torch-hub")]


def test_under_protection_a_damaged_torch_hub_download_is_refused(
        cached: Path, tmp_path: Path) -> None:
    flip_bit(cached, cached.stat().st_size - 400, 3)
    log = tmp_path / "events.jsonl"
    with pytest.raises(torchverity.IntegrityError) as caught, protected("refuse", log=log):
        _hub_load(cached)  # check_hash=False: torch.hub itself would load it
    assert "load_state_dict_from_url(url, check_hash=True)" in caught.value.hint
    assert [e["kind"] for e in _events(log)].count("refused") == 1
