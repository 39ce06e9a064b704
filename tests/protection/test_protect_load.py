"""Watched loads: records checked both ways, unsafe loads and fallbacks named with their line."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from protect_helpers import flip_tensor_bit

import torchverity
from torchverity.errors import IntegrityError
from torchverity.protection import protected

HERE = os.path.abspath(__file__)


def events(log: Path, kind: str | None = None) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    found = [json.loads(line) for line in log.read_text().splitlines()]
    return [e for e in found if kind is None or e["kind"] == kind]


def problems(log: Path) -> list[dict[str, Any]]:
    return [e for e in events(log) if e["kind"] in
            ("mismatch", "refused", "unsafe-load", "fallback", "partial-load", "load-failure")]


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}


def _line_of(text: str) -> str:
    source = Path(HERE).read_text().splitlines()
    return f"{HERE}:{next(i for i, line in enumerate(source, 1) if text in line)}"


@pytest.mark.parametrize("name", ["model.pt", "model.safetensors"])
def test_clean_files_with_records_verify_without_a_single_alarm(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    torchverity.save(_state(), path)
    log = tmp_path / "log.jsonl"
    with protected("refuse", log=log):
        if name.endswith(".pt"):
            got = torch.load(path)
            with open(path, "rb") as fh:  # an open file, as Lightning passes it
                torch.load(fh)
        else:
            got = safetensors.torch.load_file(path)
            with safetensors.safe_open(path, framework="pt") as f:
                assert sorted(f.keys()) == ["b", "w"]
    assert all(torch.equal(got[k], v) for k, v in _state().items())
    assert problems(log) == [] and events(log, "swallowed") == []
    assert len(events(log, "verified")) == 2


def test_a_flipped_bit_in_a_pt_file_is_refused_and_named(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torchverity.save(_state(), path)
    flip_tensor_bit(path)
    log = tmp_path / "log.jsonl"
    with pytest.raises(IntegrityError) as caught, protected("refuse", log=log):
        torch.load(path, map_location="cpu")
    assert caught.value.tensors in (["b"], ["w"])
    refused = events(log, "refused")
    assert len(refused) == 1
    assert refused[0]["where"] == _line_of('torch.load(path, map_location="cpu")')


def test_under_warn_the_damaged_file_loads_and_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torchverity.save(_state(), path)
    flip_tensor_bit(path)
    log = tmp_path / "log.jsonl"
    with protected("warn", log=log):
        got = torch.load(path)
    assert set(got) == {"b", "w"}
    [mismatch] = events(log, "mismatch")
    assert "digest does not match model.pt.blake3" in mismatch["message"]
    assert "damaged tensor" in mismatch["message"]


def test_safetensors_reads_are_checked_through_safe_open(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    torchverity.save(_state(), path)
    flip_tensor_bit(path, bit=3)
    with pytest.raises(IntegrityError), protected("refuse"):
        safetensors.torch.load_file(path)
    with pytest.raises(IntegrityError), protected("refuse"):
        safetensors.safe_open(path, framework="pt")


def test_a_folder_manifest_vouches_for_files_without_sidecars(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    ORIGINAL_SAVE(_state(), folder / "last.pt")
    torchverity.write_manifest(folder)
    log = tmp_path / "log.jsonl"
    with protected("refuse", log=log):
        torch.load(folder / "last.pt")
    assert [e["source"] for e in events(log, "verified")] == ["manifest"]
    flip_tensor_bit(folder / "last.pt")
    with pytest.raises(IntegrityError, match=r"torchverity\.manifest\.json"), protected("refuse"):
        torch.load(folder / "last.pt")


def test_a_hugging_face_cache_blob_is_checked_against_its_name(tmp_path: Path) -> None:
    blobs, snap = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    staged = tmp_path / "staged.safetensors"
    safetensors.torch.save_file(_state(), staged)
    digest = torchverity.digest_file(staged, "sha256").hexdigest
    shutil.move(staged, blobs / digest)
    (snap / "model.safetensors").symlink_to(Path("../../blobs") / digest)
    log = tmp_path / "log.jsonl"
    with protected("refuse", log=log):
        safetensors.torch.load_file(snap / "model.safetensors")
    assert [e["source"] for e in events(log, "verified")] == ["hf-blob"]
    flip_tensor_bit(blobs / digest)
    with pytest.raises(IntegrityError, match="Hugging Face cache blob"), protected("refuse"):
        safetensors.torch.load_file(snap / "model.safetensors")


def test_files_without_records_load_unchecked_and_silently(tmp_path: Path) -> None:
    path = tmp_path / "plain.pt"
    ORIGINAL_SAVE(_state(), path)
    flip_tensor_bit(path)  # nothing recorded it: nothing can tell
    log = tmp_path / "log.jsonl"
    with protected("refuse", log=log):
        torch.load(path)
    assert problems(log) == [] and events(log, "verified") == []


def test_weights_only_false_is_reported_with_the_calling_line(tmp_path: Path) -> None:
    path = tmp_path / "plain.pt"
    ORIGINAL_SAVE(_state(), path)
    log = tmp_path / "log.jsonl"
    with protected("warn", log=log):
        torch.load(path, weights_only=True)
        torch.load(path, weights_only=False)
    [unsafe] = events(log, "unsafe-load")
    assert unsafe["where"] == _line_of("torch.load(path, weights_only=False)")
    assert unsafe["path"] == str(path)


class Config:  # a whole object in a checkpoint: what weights_only=True refuses
    def __init__(self) -> None:
        self.lr = 0.1


def test_a_fallback_to_weights_only_false_after_a_failure_is_named(tmp_path: Path) -> None:
    path = tmp_path / "full.pt"
    ORIGINAL_SAVE({"config": Config(), "w": torch.ones(2)}, path)
    log = tmp_path / "log.jsonl"
    with protected("warn", log=log):
        try:
            ckpt = torch.load(path, weights_only=True)
        except Exception:
            ckpt = torch.load(path, weights_only=False)  # the fallback the articles warn about
    assert ckpt["config"].lr == 0.1
    [fallback] = events(log, "fallback")
    assert fallback["where"] == _line_of("ckpt = torch.load(path, weights_only=False)")
    assert "failed under weights_only=True" in fallback["message"]
    [swallowed] = events(log, "swallowed")
    assert "retried with weights_only=False" in swallowed["message"]
    assert swallowed["caught_in"].startswith(_line_of("        except Exception:"))


def test_load_state_dict_strict_false_reports_missing_and_unexpected_keys(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    partial = {"0.weight": torch.zeros(4, 4), "0.bias": torch.zeros(4), "head.w": torch.ones(1)}
    log = tmp_path / "log.jsonl"
    with protected("warn", log=log):
        result = model.load_state_dict(partial, strict=False)
        model.load_state_dict(model.state_dict())  # complete: nothing to say
    assert result.missing_keys == ["1.weight", "1.bias"]
    [partial_event] = events(log, "partial-load")
    assert partial_event["missing_keys"] == ["1.weight", "1.bias"]
    assert partial_event["unexpected_keys"] == ["head.w"]
    called = _line_of("result = model.load_state_dict(partial, strict=False)")
    assert partial_event["where"] == called
    assert "left at their initial values: 1.weight, 1.bias" in partial_event["message"]


ORIGINAL_SAVE = torch.save


def test_a_truncated_recorded_file_is_refused_as_damage_not_as_a_torch_error(
        tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torchverity.save(_state(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(IntegrityError, match="digest does not match"), protected("refuse"):
        torch.load(path)


def test_records_that_contradict_each_other_are_refused(tmp_path: Path) -> None:
    path, other = tmp_path / "model.pt", tmp_path / "other.pt"
    torchverity.save(_state(), path)
    torchverity.save({"w": torch.zeros(2)}, other)
    shutil.copy(tmp_path / "other.pt.meta.json", tmp_path / "model.pt.meta.json")
    with pytest.raises(IntegrityError, match=r"meta\.json disagrees with the sidecar"), \
            protected("refuse"):
        torch.load(path)


@pytest.mark.parametrize(("env", "kwargs", "safe"), [
    ({}, {}, True),
    ({}, {"weights_only": False}, False),
    ({}, {"pickle_module": __import__("pickle")}, False),
    ({"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}, {}, False),
    ({"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}, {"weights_only": True}, True),
    ({"TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1"}, {"weights_only": False}, True),
])
def test_unsafe_loads_are_judged_as_torch_judges_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
        kwargs: dict[str, Any], safe: bool) -> None:
    path = tmp_path / "plain.pt"
    ORIGINAL_SAVE(_state(), path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    log = tmp_path / "log.jsonl"
    with protected("warn", log=log):
        torch.load(path, **kwargs)
    assert bool(events(log, "unsafe-load")) is not safe


def test_a_repeated_unsafe_call_is_printed_once_and_logged_every_time(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plain.pt"
    ORIGINAL_SAVE(_state(), path)
    log = tmp_path / "log.jsonl"
    with protected("warn", log=log):
        for _ in range(3):
            torch.load(path, weights_only=False)
    assert capsys.readouterr().err.count("torch.load(weights_only=False)") == 1
    assert len(events(log, "unsafe-load")) == 3


@pytest.mark.parametrize("record", ["sidecar", "manifest above"])
def test_a_record_created_after_a_file_was_found_without_one_is_used(
        tmp_path: Path, record: str) -> None:
    folder = tmp_path / "run" / "ckpt"
    folder.mkdir(parents=True)
    path = folder / "model.pt"
    ORIGINAL_SAVE(_state(), path)
    for settled in (folder, folder.parent):  # folders untouched for a while: the lookup is cached
        os.utime(settled, ns=(1_000_000_000, 1_000_000_000))
    log = tmp_path / "log.jsonl"
    with protected("refuse", log=log):
        torch.load(path)
        torch.load(path)  # answered from the cache
    assert events(log, "verified") == []
    from torchverity.protection._records import _negative

    assert str(path) in _negative  # the lookup really was cached
    if record == "sidecar":
        torchverity.write_sidecar(path, torchverity.digest_file(path))
    else:
        torchverity.write_manifest(folder.parent)
    flip_tensor_bit(path)
    with pytest.raises(IntegrityError), protected("refuse"):
        torch.load(path)


def test_mmap_and_legacy_loads_are_checked_before_torch_reads_them(tmp_path: Path) -> None:
    mapped, legacy = tmp_path / "mapped.pt", tmp_path / "legacy.pt"
    torchverity.save(_state(), mapped)
    ORIGINAL_SAVE(_state(), legacy, _use_new_zipfile_serialization=False)
    torchverity.write_sidecar(legacy, torchverity.digest_file(legacy))
    log = tmp_path / "log.jsonl"
    with protected("refuse", log=log):
        assert torch.equal(torch.load(mapped, mmap=True)["w"], _state()["w"])
        assert torch.equal(torch.load(legacy)["w"], _state()["w"])
    assert len(events(log, "verified")) == 2
    flip_tensor_bit(mapped)
    with pytest.raises(IntegrityError), protected("refuse"):
        torch.load(mapped, mmap=True)
