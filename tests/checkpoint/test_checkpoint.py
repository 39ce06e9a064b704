"""torchverity.save / torchverity.load: atomic, verified, refusing every damaged byte."""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import torchverity
from torchverity._formats import file_format
from torchverity.checkpoint._meta import read_meta
from torchverity.checkpoint._results import CheckpointWarning
from torchverity.checkpoint._safetensors import write_tensors
from torchverity.digest import digest_file
from torchverity.errors import (
    FormatError,
    InputError,
    IntegrityError,
    StateDictMismatchError,
    UnsafeFileError,
    UsageError,
)

ROOT = Path(__file__).resolve().parents[2]


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(64, 32, generator=g),
        "layer.bias": torch.randn(64, generator=g),
        "emb": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "mask": torch.rand(10, generator=g) > 0.5,
        "steps": torch.arange(5, dtype=torch.int64),
    }


@pytest.fixture(params=["pt", "safetensors"])
def saved(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    state = _state()
    path = tmp_path / f"model.{request.param}"
    torchverity.save(state, path, meta={"epoch": 3, "metrics": {"loss": 0.25}}, seed=7)
    return path, state


def _flip(path: Path, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ (1 << bit)]))


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
        for k in a
    )


# ------------------------------------------------------------------ clean round trips


def test_round_trip_verifies_everything(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, state = saved
    obj, report = torchverity.load(path, with_report=True, sidecar="require")
    assert _equal(obj, state)
    assert report.digest_source == "sidecar" and report.fingerprint_verified and report.verified
    assert report.weights_only and report.tensors == 5 and report.warnings == ()
    assert report.fingerprint == torchverity.fingerprint(state).root


def test_sidecar_is_sha256sum_compatible(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, state = saved
    torchverity.save(state, path, algo="sha256")
    done = subprocess.run(["sha256sum", "-c", f"{path.name}.sha256"], cwd=path.parent,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_meta_json_records_environment_and_user_data(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, _ = saved
    meta = read_meta(path)
    assert meta["file"] == path.name and meta["seed"] == 7
    assert meta["user"] == {"epoch": 3, "metrics": {"loss": 0.25}}
    assert meta["environment"]["torch"] == torch.__version__
    assert {"torchverity", "cuda", "cudnn", "python", "platform", "git_commit"} <= set(
        meta["environment"])
    assert meta["digest"]["hex"] == (path.parent / f"{path.name}.blake3").read_text().split()[0]
    tensors = meta["fingerprint"]["tensors"]
    assert tensors["emb"]["dtype"] == "bfloat16" and tensors["layer.weight"]["shape"] == [64, 32]
    assert meta["size"] == path.stat().st_size


def test_same_content_same_fingerprint_across_formats(tmp_path: Path) -> None:
    state = _state()
    a = torchverity.save(state, tmp_path / "a.pt")
    b = torchverity.save(state, tmp_path / "b.safetensors")
    assert a.fingerprint == b.fingerprint and a.digest != b.digest


def test_data_digest_of_file_and_folder(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.bin").write_bytes(b"x" * 1000)
    torchverity.save(_state(), tmp_path / "f.pt", data=data / "train.bin")
    torchverity.save(_state(), tmp_path / "d.pt", data=data)
    file_rec = read_meta(tmp_path / "f.pt")["data"]
    folder_rec = read_meta(tmp_path / "d.pt")["data"]
    assert file_rec["kind"] == "file"
    assert file_rec["digest"] == torchverity.digest_file(data / "train.bin").hexdigest
    from torchverity.manifest import build_manifest

    assert folder_rec["kind"] == "manifest" and folder_rec["digest"] == build_manifest(data).root


def test_nested_checkpoint_with_optimizer_state(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 2, "lr": 1e-3}
    torchverity.save(ckpt, tmp_path / "ckpt.pt")
    loaded = torchverity.load(tmp_path / "ckpt.pt", sidecar="require")
    assert torchverity.fingerprint(loaded).root == torchverity.fingerprint(ckpt).root
    fresh = torch.nn.Linear(4, 3)
    torchverity.load(tmp_path / "ckpt.pt", model=fresh)
    assert torch.equal(fresh.weight, model.weight)


def test_overwrite_keeps_permissions_and_leaves_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torchverity.save(_state(0), path)
    os.chmod(path, 0o640)
    torchverity.save(_state(1), path)
    assert path.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt", "m.pt.blake3", "m.pt.meta.json"]
    assert _equal(torchverity.load(path), _state(1))


def test_mmap_and_map_location(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, state = saved
    obj = torchverity.load(path, mmap=True, map_location=torch.device("cpu"))
    assert _equal(obj, state)


# ------------------------------------------------------------------ corruption is refused


def test_every_sampled_bit_flip_is_refused(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = saved
    good = path.read_bytes()
    rng = random.Random(3)
    size = len(good)
    offsets = sorted({0, 8, size // 2, size - 1, *rng.sample(range(size), 24)})
    for offset in offsets:
        bit = rng.randrange(8)
        _flip(path, offset, bit)
        with pytest.raises(IntegrityError) as info:
            torchverity.load(path)
        assert info.value.path == str(path) and "does not match" in info.value.message
        path.write_bytes(good)
    assert torchverity.load(path) is not None  # the clean file still loads


def test_flip_in_tensor_data_names_the_tensor(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, state = saved
    # Find the weight's bytes in the file: unique enough to locate.
    needle = state["layer.weight"].numpy().tobytes()[:64]
    offset = path.read_bytes().index(needle) + 40
    _flip(path, offset, 5)
    with pytest.raises(IntegrityError) as info:
        torchverity.load(path)
    assert info.value.tensors == ["layer.weight"]
    assert "damaged tensor: layer.weight" in info.value.message
    assert "torchverity diff" in (info.value.hint or "")


@pytest.mark.parametrize("algo", ["xxh128", "blake3"])
@pytest.mark.parametrize("suffix", ["pt", "safetensors"])
def test_one_pass_load_refuses_flips_with_every_sidecar_algorithm(
        tmp_path: Path, algo: str, suffix: str) -> None:
    path, state = tmp_path / f"m.{suffix}", _state()
    torchverity.save(state, path, algo=algo)
    _, report = torchverity.load(path, with_report=True, sidecar="require")
    assert (report.algo, report.fingerprint_check, report.verified) == (algo, "bound", True)
    good = path.read_bytes()
    weight = good.index(state["layer.weight"].numpy().tobytes()[:64]) + 16
    # In a tensor (named), in the container's first bytes, in the pickle or header.
    for offset, named in ((weight, ["layer.weight"]), (3, None), (len(good) - 40, None),
                          (100, None)):
        _flip(path, offset, 2)
        with pytest.raises(IntegrityError, match=f"{algo} digest does not match") as info:
            torchverity.load(path)
        if named:
            assert info.value.tensors == named
        path.write_bytes(good)
    assert _equal(torchverity.load(path), state)


@pytest.mark.parametrize("algo", ["sha256", "blake3", "xxh128"])
@pytest.mark.parametrize("suffix", ["pt", "safetensors"])
def test_large_tensors_read_by_two_threads_are_hashed_whole(
        tmp_path: Path, suffix: str, algo: str) -> None:
    # 12 MiB and 1.5 MiB tensors: read in split chunks (this thread's head, a worker's
    # tail) for BLAKE3 and XXH3, hashed beside the read for SHA-256. A flip in either
    # part of any chunk is caught and named.
    g = torch.Generator().manual_seed(2)
    state = {"big": torch.randn(3 << 20, generator=g), "mid": torch.randn(393_216, generator=g),
             "small": torch.arange(7)}
    path = tmp_path / f"m.{suffix}"
    torchverity.save(state, path, algo=algo)
    assert _equal(torchverity.load(path, sidecar="require"), state)
    good = path.read_bytes()
    big = good.index(state["big"].numpy().tobytes()[:64])
    mid = good.index(state["mid"].numpy().tobytes()[:64])
    for offset, name in ((big, "big"), (big + (7 << 20), "big"), (big + (9 << 20) + 5, "big"),
                         (big + (12 << 20) - 1, "big"), (mid + (1 << 20) + 3, "mid")):
        _flip(path, offset, 6)
        with pytest.raises(IntegrityError, match=f"{algo} digest does not match") as info:
            torchverity.load(path)
        assert info.value.tensors == [name]
        path.write_bytes(good)


def test_a_safetensors_file_cut_short_while_read_is_format_damage(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from torchverity.checkpoint._safetensors import read_header, read_tensors

    path = tmp_path / "m.safetensors"
    torchverity.save({"big": torch.ones(3 << 20), "small": torch.ones(3)}, path)
    header = read_header(path)
    with open(path, "r+b") as fh:  # after the header was read: as a concurrent writer would
        fh.truncate(header.data_start + (5 << 20))
    with ThreadPoolExecutor(max_workers=1) as pool:
        for reader in (pool, None):
            with pytest.raises(FormatError, match="file ended inside tensor 'big'"):
                read_tensors(path, header, reader=reader)


def test_meta_digest_catches_damage_without_sidecar(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, _ = saved
    (path.parent / f"{path.name}.blake3").unlink()
    _flip(path, path.stat().st_size - 3)
    with pytest.raises(IntegrityError, match=r"does not match model\.\w+\.meta\.json"):
        torchverity.load(path)


def test_fingerprint_catches_content_swap_when_digest_is_ignored(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torchverity.save(_state(0), a)
    other = _state(0)
    other["layer.bias"][3] += 1
    torchverity.save(other, b)
    shutil.copy(b, a)  # right file name, wrong content, stale sidecar and meta
    with pytest.raises(IntegrityError) as info:
        torchverity.load(a, sidecar="ignore")
    assert info.value.tensors == ["layer.bias"]
    assert "content does not match a.pt.meta.json" in info.value.message


@pytest.mark.parametrize("algo", ["sha256", "blake3"])
@pytest.mark.parametrize("suffix", ["pt", "safetensors"])
def test_pipelined_digest_matches_a_reread_of_the_file(tmp_path: Path, suffix: str,
                                                        algo: str) -> None:
    # Large storages are hashed behind the writes by reference; small writes, and
    # large writes of memory torch owns (the transposed tensor's copy in
    # .safetensors, a 2 MB data.pkl in .pt), are hashed before write() returns.
    g = torch.Generator().manual_seed(1)
    state: dict[str, Any] = {"big": torch.randn(1 << 20, generator=g),
                             "wide": torch.randn(512, 1024, generator=g).t(),
                             "half": torch.randn(600_000, generator=g).to(torch.bfloat16),
                             "small": torch.arange(3)}
    if suffix == "pt":
        state["notes"] = "x" * (2 << 20)
    path = tmp_path / f"m.{suffix}"
    report = torchverity.save(state, path, algo=algo)
    assert report.digest == digest_file(path, algo).hexdigest
    assert read_meta(path)["fingerprint"]["algo"] == "blake3"
    loaded = torchverity.load(path, sidecar="require")
    assert loaded.keys() == state.keys() and loaded.pop("notes", 0) == state.pop("notes", 0)
    assert _equal({k: v.contiguous() for k, v in loaded.items()},
                  {k: v.contiguous() for k, v in state.items()})


def test_old_sha256_fingerprint_records_still_verify(tmp_path: Path) -> None:
    path, state = tmp_path / "old.pt", _state()
    torchverity.save(state, path)
    mp = path.parent / f"{path.name}.meta.json"
    meta = json.loads(mp.read_text())
    meta["fingerprint"] = torchverity.fingerprint(state, mode="sha256").to_dict()
    mp.write_text(json.dumps(meta))
    _, report = torchverity.load(path, with_report=True, sidecar="require")
    assert report.verified and report.fingerprint == meta["fingerprint"]["root"]
    other = _state()
    other["emb"][0, 0] = 9
    meta["fingerprint"] = torchverity.fingerprint(other, mode="sha256").to_dict()
    mp.write_text(json.dumps(meta))
    with pytest.raises(IntegrityError) as info:
        torchverity.load(path, recheck_tensors=True)
    assert info.value.tensors == ["emb"]


def test_file_digest_vouches_for_the_fingerprint_only_when_meta_recorded_it(
        tmp_path: Path) -> None:
    path, state = tmp_path / "m.pt", _state()
    torchverity.save(state, path, algo="xxh128")
    _, report = torchverity.load(path, with_report=True, sidecar="require")
    assert (report.algo, report.fingerprint_check, report.verified) == ("xxh128", "bound", True)
    _, report = torchverity.load(path, with_report=True, recheck_tensors=True)
    assert report.fingerprint_check == "rehashed"
    # Changed tensors with a sidecar re-written to match: the digest no longer
    # is the one meta.json recorded, so the tensors are hashed and the change named.
    state["emb"][1, 2] += 1
    torch.save(state, path)
    _resign_unbound(path)
    with pytest.raises(IntegrityError) as info:
        torchverity.load(path)
    assert info.value.tensors == ["emb"]


def _resign_unbound(path: Path) -> None:
    """Re-sign ``path``'s xxh128 sidecar to its current bytes and drop the file digest from
    its meta.json: the sidecar passes, so only the rehashed fingerprint can find the change."""
    path.with_name(f"{path.name}.xxh128").write_text(
        f"{digest_file(path, 'xxh128').hexdigest}  {path.name}\n")
    meta_path = path.with_name(f"{path.name}.meta.json")
    meta = json.loads(meta_path.read_text())
    meta.pop("digest")
    meta_path.write_text(json.dumps(meta))


def test_bound_load_still_checks_names_shapes_and_values(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torchverity.save({"w": torch.ones(2, 3), "epoch": 3}, path, algo="xxh128")
    mp = tmp_path / "m.pt.meta.json"
    meta = json.loads(mp.read_text())
    meta["fingerprint"] = torchverity.fingerprint({"w": torch.ones(3, 2), "epoch": 4}).to_dict()
    mp.write_text(json.dumps(meta))
    with pytest.raises(IntegrityError, match=r"2 tensor\(s\) differ: epoch, w") as info:
        torchverity.load(path)
    assert "expected int[] digest" in str(info.value)


def test_resave_with_another_algorithm_drops_the_stale_sidecar(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torchverity.save(_state(0), path, algo="sha256")
    stale = (path.parent / f"{path.name}.sha256").read_text()
    torchverity.save(_state(1), path)
    assert not (path.parent / f"{path.name}.sha256").exists()
    assert _equal(torchverity.load(path, sidecar="require"), _state(1))
    # A crash before the old sidecar was removed: meta.json names the algorithm to trust.
    (path.parent / f"{path.name}.sha256").write_text(stale)
    _, report = torchverity.load(path, with_report=True)
    assert report.algo == "blake3" and report.verified

def test_meta_json_that_disagrees_with_sidecar(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = saved
    mp = path.parent / f"{path.name}.meta.json"
    meta = json.loads(mp.read_text())
    meta["digest"]["hex"] = "0" * 64
    mp.write_text(json.dumps(meta))
    with pytest.raises(IntegrityError, match=r"meta\.json disagrees with the sidecar"):
        torchverity.load(path)


def test_damaged_meta_json_is_a_format_error(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = saved
    mp = path.parent / f"{path.name}.meta.json"
    meta = json.loads(mp.read_text())
    meta["fingerprint"]["tensors"]["mask"]["digest"] = "f" * 64  # root no longer matches
    mp.write_text(json.dumps(meta))
    with pytest.raises(FormatError, match="fingerprint record is damaged"):
        torchverity.load(path)
    mp.write_text("{not json")
    with pytest.raises(FormatError, match="not valid JSON"):
        torchverity.load(path)


# ------------------------------------------------------------------ sidecar policy


def test_missing_sidecar_policies(tmp_path: Path) -> None:
    path = tmp_path / "plain.pt"
    torch.save(_state(), path)  # no sidecar, no meta
    with pytest.warns(CheckpointWarning) as caught:
        _, report = torchverity.load(path, with_report=True)
    assert report.digest_source is None and not report.verified
    assert len(caught) == 2 and len(report.warnings) == 2
    assert "no sidecar" in report.warnings[0] and "no meta.json" in report.warnings[1]
    with pytest.raises(IntegrityError, match="sidecar='require'"):
        torchverity.load(path, sidecar="require")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _equal(torchverity.load(path, sidecar="ignore"), _state())


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("suffix", ["pt", "safetensors"])
def test_truncated_empty_and_foreign_files(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"m.{suffix}"
    torchverity.save(_state(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(IntegrityError):
        torchverity.load(path)
    with pytest.raises(FormatError, match=r"truncated"):
        torchverity.load(path, sidecar="ignore")
    path.write_bytes(b"")
    with pytest.raises(FormatError, match="file is empty"):
        torchverity.load(path)
    path.write_text("hello, this is not a checkpoint\n")
    with pytest.raises(IntegrityError):
        torchverity.load(path)  # the sidecar speaks first: these are not the saved bytes
    with pytest.raises(FormatError, match="not a checkpoint"):
        torchverity.load(path, sidecar="ignore")
    with pytest.raises(InputError, match="no such file"):
        torchverity.load(tmp_path / "absent.pt")


def _safetensors_bytes(header: dict[str, object], data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12), "overlaps"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8),
         "needs 12"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(10),
         "unexpected bytes after"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12), "gap of 4"),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8), "truncated"),
        ({"a": {"dtype": "XX", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), "unknown dtype"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8), "shape"),
    ],
)
def test_lying_safetensors_headers(tmp_path: Path, header: dict[str, object], data: bytes,
                                   message: str) -> None:
    path = tmp_path / "lie.safetensors"
    path.write_bytes(_safetensors_bytes(header, data))
    with pytest.raises(FormatError, match=message) as info:
        torchverity.load(path, sidecar="ignore")
    assert info.value.exit_code == 2


def test_safetensors_duplicate_names_and_huge_header(tmp_path: Path) -> None:
    path = tmp_path / "dup.safetensors"
    raw = (b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
           b'"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}')
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0\0")
    with pytest.raises(FormatError, match="appears twice"):
        torchverity.load(path, sidecar="ignore")
    path.write_bytes(struct.pack("<Q", 10**9) + b"{" + bytes(16))
    with pytest.raises(FormatError, match="not a checkpoint"):
        torchverity.load(path, sidecar="ignore")


def test_safetensors_interop_with_the_reference_library(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    state = {k: v for k, v in _state().items()}
    state["f8"] = torch.linspace(-2, 2, 7).to(torch.float8_e4m3fn)
    torchverity.save(state, tmp_path / "ours.safetensors")
    assert _equal(safetensors_torch.load_file(tmp_path / "ours.safetensors"), state)
    safetensors_torch.save_file(state, tmp_path / "theirs.safetensors")
    assert _equal(torchverity.load(tmp_path / "theirs.safetensors", sidecar="ignore"), state)


def test_safetensors_refuses_nested_objects(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match=r"use a \.pt path"):
        torchverity.save({"model": _state(), "epoch": 1}, tmp_path / "x.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_file_format_sniffs_bytes_not_names(tmp_path: Path) -> None:
    st_as_pt = tmp_path / "weights.pt"
    torchverity.save(_state(), tmp_path / "w.safetensors")
    shutil.copy(tmp_path / "w.safetensors", st_as_pt)
    assert file_format(st_as_pt) == "safetensors"
    legacy = tmp_path / "legacy.pt"
    torch.save(_state(), legacy, _use_new_zipfile_serialization=False)
    assert file_format(legacy) == "pt-legacy"
    assert _equal(torchverity.load(legacy, sidecar="ignore"), _state())


# ------------------------------------------------------------------ pickles


class _Custom:
    def __init__(self) -> None:
        self.value = 3


class _Evil:
    def __init__(self, sentinel: str) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.sentinel}",))


def test_never_falls_back_to_full_pickle(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "custom.pt"
    torch.save({"w": torch.ones(2), "obj": _Custom()}, path)
    with pytest.raises(UnsafeFileError, match="refused by the weights_only loader") as info:
        torchverity.load(path, sidecar="ignore")
    assert "trust_sha256" in (info.value.hint or "")
    with pytest.raises(IntegrityError, match="not the trusted"):
        torchverity.load(path, trust_sha256="0" * 64)
    digest = torchverity.digest_file(path, "sha256").hexdigest
    with caplog.at_level(logging.WARNING, logger="torchverity.checkpoint"):
        obj, report = torchverity.load(path, trust_sha256=digest, sidecar="ignore",
                                       with_report=True)
    assert obj["obj"].value == 3 and not report.weights_only
    assert f"caller trusts sha256 {digest}" in caplog.text


def test_malicious_pickle_never_runs(tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": _Evil(str(sentinel))}, path)
    with pytest.raises(UnsafeFileError):
        torchverity.load(path, sidecar="ignore")
    torchverity.digest.write_sidecar(path, torchverity.digest_file(path))
    with pytest.raises(UnsafeFileError):
        torchverity.load(path)  # a matching sidecar proves integrity, not safety
    legacy = tmp_path / "evil.bin"
    with open(legacy, "wb") as fh:
        pickle.dump(_Evil(str(sentinel)), fh, protocol=2)
    with pytest.raises((UnsafeFileError, FormatError)):
        torchverity.load(legacy, sidecar="ignore")
    assert not sentinel.exists()


# ------------------------------------------------------------------ model checks


def test_model_mismatches_are_reported_all_at_once(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    state = model.state_dict()
    state["0.weight"] = torch.zeros(3, 5)
    state["1.bias"] = state["1.bias"].double()
    del state["1.weight"]
    state["extra.weight"] = torch.zeros(1)
    torchverity.save(state, tmp_path / "m.pt")
    with pytest.raises(StateDictMismatchError) as info:
        torchverity.load(tmp_path / "m.pt", model=model)
    err = info.value
    assert err.missing == ["1.weight"] and err.unexpected == ["extra.weight"]
    assert {m["name"] for m in err.mismatched} == {"0.weight", "1.bias"}
    assert "'0.weight' is float32[3, 5], model expects float32[3, 4]" in err.message
    assert err.exit_code == 1


def test_clean_load_into_model(tmp_path: Path) -> None:
    src = torch.nn.Linear(4, 3)
    torchverity.save(src.state_dict(), tmp_path / "m.safetensors")
    dst = torch.nn.Linear(4, 3)
    _, report = torchverity.load(tmp_path / "m.safetensors", model=dst, with_report=True)
    assert report.model_checked and torch.equal(dst.weight, src.weight)


# ------------------------------------------------------------------ failing writes


def _child(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120, check=False)


_SAVE_BIG = """
import resource, signal, torch, torchverity
from torchverity.errors import CheckpointWriteError
{setup}
try:
    torchverity.save({{"w": torch.ones(4_000_000)}}, {path!r})
except CheckpointWriteError as exc:
    print("ERR", exc.previous_intact, exc.message)
"""


def test_disk_full_leaves_previous_file_intact(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torchverity.save(_state(), path)
    setup = ("signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
             "resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))")
    done = _child(_SAVE_BIG.format(setup=setup, path=str(path)))
    assert "ERR True cannot save" in done.stdout, done.stderr
    assert "the previous m.pt is intact" in done.stdout
    assert _equal(torchverity.load(path, sidecar="require"), _state())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt", "m.pt.blake3", "m.pt.meta.json"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to drop privileges)")
def test_read_only_folder_gives_typed_error() -> None:
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="tv-ro-", dir="/tmp"))  # pytest's tmp is 0700
    folder = base / "ro"
    try:
        base.chmod(0o755)
        folder.mkdir()
        torchverity.save(_state(), folder / "m.pt")
        folder.chmod(0o555)
        # Drop to "nobody" after start-up: the interpreter lives in root's home.
        setup = "import os, torchverity.checkpoint._save; os.seteuid(65534)"
        done = _child(_SAVE_BIG.format(setup=setup, path=str(folder / "m.pt")))
        folder.chmod(0o755)
        assert "ERR True cannot save" in done.stdout, done.stdout + done.stderr
        assert "permission denied" in done.stdout
        assert _equal(torchverity.load(folder / "m.pt", sidecar="require"), _state())
    finally:
        shutil.rmtree(base)


# ------------------------------------------------------------------ kill -9 at random moments

_SAVE_LOOP = """
import sys, torch, torchverity
path = sys.argv[1]
state = {{"w": torch.full((16, 1 << 20), 1.0)}}  # 64 MiB
for i in range(1000):
    state["w"].fill_(float(i + 2))
    torchverity.save(state, path, meta={{"i": i}})
    print(i, flush=True)
"""


def _wait_for_partial_write(folder: Path, at_least: int, timeout: float = 60.0) -> bool:
    """Wait until a save's temp file holds ``at_least`` bytes: the save is mid-write."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for tmp in folder.glob(".big.pt.tmp-*"):
            try:
                if tmp.stat().st_size >= at_least:
                    return True
            except FileNotFoundError:
                continue
        time.sleep(0.001)
    return False


def test_kill_9_during_save_never_tears_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "big.pt"
    first = {"w": torch.full((16, 1 << 20), 1.0)}
    torchverity.save(first, path)
    rng = random.Random(11)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    torn = 0
    for trial in range(4):
        proc = subprocess.Popen([sys.executable, "-c", _SAVE_LOOP.format(), str(path)],
                                stdout=subprocess.PIPE, env=env)
        assert proc.stdout is not None
        proc.stdout.readline()  # one save done: the process is warm and writing again
        if trial % 2:
            time.sleep(rng.uniform(0.0, 0.6))  # any moment: writing, fsync, renames, between
        else:  # certainly mid-write, at a random point of the 64 MiB
            assert _wait_for_partial_write(tmp_path, rng.randrange(1, 60 << 20))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        torn += any(tmp_path.glob(".big.pt.tmp-*"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointWarning)  # an interrupted rename is fine
            obj, report = torchverity.load(path, sidecar="require", with_report=True)
        assert report.verified
        value = obj["w"][0, 0].item()
        assert torch.all(obj["w"] == value)
        if not report.warnings:
            assert read_meta(path)["user"] in (None, {"i": int(value) - 2})
    assert torn >= 2  # the mid-write kills really left half-written temp files behind
    # The stale temp files of killed saves are swept (or replaced) by the next save.
    torchverity.save(first, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "big.pt", "big.pt.blake3", "big.pt.meta.json"]


def test_crash_between_renames_is_recovered_from_pending_records(tmp_path: Path) -> None:
    from torchverity.checkpoint._atomic import pending_name

    path, newer = tmp_path / "m.pt", tmp_path / "newer.pt"
    torchverity.save(_state(0), path)
    torchverity.save(_state(1), newer)
    # The state a crash leaves after the checkpoint's rename, before its companions'.
    for suffix in (".blake3", ".meta.json"):
        shutil.copy(f"{newer}{suffix}", pending_name(Path(f"{path}{suffix}")))
    shutil.copy(newer, path)
    with pytest.warns(CheckpointWarning, match="interrupted"):
        obj, report = torchverity.load(path, sidecar="require", with_report=True)
    assert _equal(obj, _state(1)) and report.verified
    _flip(path, path.stat().st_size // 2)
    with pytest.raises(IntegrityError):
        torchverity.load(path)  # pending records that do not match are not an excuse
    torchverity.save(_state(2), path)
    assert not any(p.name.endswith(".pending") for p in tmp_path.iterdir())


# ------------------------------------------------------------------ sharded folders


@pytest.mark.parametrize("shard_format", ["safetensors", "pt"])
def test_sharded_folder_round_trip(tmp_path: Path, shard_format: str) -> None:
    state = _state()
    folder = tmp_path / "sharded"
    report = torchverity.save(state, folder, shard_bytes=4096, shard_format=shard_format,
                              meta={"step": 1})
    index = folder / ("model.safetensors.index.json" if shard_format == "safetensors"
                      else "pytorch_model.bin.index.json")
    weight_map = json.loads(index.read_text())["weight_map"]
    assert set(weight_map) == set(state) and len(set(weight_map.values())) >= 2
    assert report.fingerprint == torchverity.fingerprint(state).root
    obj, loaded = torchverity.load(folder, with_report=True, sidecar="require")
    assert _equal(obj, state) and loaded.verified and len(loaded.shards) >= 2
    assert loaded.format == f"sharded-{'safetensors' if shard_format == 'safetensors' else 'pt'}"
    assert loaded.fingerprint_check == "bound"  # every shard's digest vouched for its part


def test_sharded_recheck_rehashes_every_shard(tmp_path: Path) -> None:
    folder, state = tmp_path / "sharded", _state()
    torchverity.save(state, folder, shard_bytes=4096, algo="xxh128")
    obj, report = torchverity.load(folder, with_report=True, recheck_tensors=True)
    assert _equal(obj, state) and report.fingerprint_check == "rehashed" and report.verified
    # A shard changed, its sidecar re-written to match and its meta.json's digest
    # dropped: only hashing the shard's tensors can see it, and it names the tensor.
    shard = folder / json.loads((folder / "model.safetensors.index.json").read_text())[
        "weight_map"]["steps"]
    changed = torchverity.load(shard)
    changed["steps"][0] = 7
    with open(shard, "wb") as fh:
        write_tensors(changed, fh)
    _resign_unbound(shard)
    with pytest.raises(IntegrityError) as info:
        torchverity.load(folder)
    assert info.value.tensors == ["steps"]


def test_sharded_index_fingerprint_is_checked_against_its_shards(tmp_path: Path) -> None:
    folder, state = tmp_path / "sharded", _state()
    torchverity.save(state, folder, shard_bytes=4096)
    mp = folder / "model.safetensors.index.json.meta.json"
    meta = json.loads(mp.read_text())
    other = _state()
    other["steps"][0] = 7
    meta["fingerprint"] = torchverity.fingerprint(other).to_dict()
    mp.write_text(json.dumps(meta))
    with pytest.raises(IntegrityError, match="1 tensor\\(s\\) differ: steps") as info:
        torchverity.load(folder)
    assert info.value.tensors == ["steps"]


def test_sharded_folder_refuses_damage(tmp_path: Path) -> None:
    folder = tmp_path / "sharded"
    torchverity.save(_state(), folder, shard_bytes=4096)
    index = folder / "model.safetensors.index.json"
    shard = folder / json.loads(index.read_text())["weight_map"]["layer.weight"]
    good = shard.read_bytes()
    _flip(shard, len(good) - 100)
    with pytest.raises(IntegrityError, match=r"damaged tensor: layer\.weight"):
        torchverity.load(folder)
    shard.write_bytes(good)
    shard.rename(tmp_path / "moved")
    with pytest.raises(IntegrityError, match="do not exist") as info:
        torchverity.load(folder)
    assert "layer.weight" in info.value.tensors


def test_sharded_index_that_lies_about_names(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    safetensors_torch = pytest.importorskip("safetensors.torch")
    state = _state()
    names = sorted(state)
    safetensors_torch.save_file({n: state[n] for n in names[:2]}, folder / "a.safetensors")
    safetensors_torch.save_file({n: state[n] for n in names[2:]}, folder / "b.safetensors")
    weight_map = {n: "a.safetensors" if i < 2 else "b.safetensors" for i, n in enumerate(names)}
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    # A plain Hugging Face folder (no sidecars) loads, with one summarised warning.
    with pytest.warns(CheckpointWarning) as caught:
        assert _equal(torchverity.load(folder), state)
    texts = [str(w.message) for w in caught]
    assert len(texts) == 2 and "no sidecar: the index was not verified" in texts[0]
    assert "2 of 2 shards could not be fully verified" in texts[1]
    weight_map[names[0]] = "b.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(IntegrityError, match="does not hold what the index says"):
        torchverity.load(folder, sidecar="ignore")
    weight_map[names[0]] = "../outside.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FormatError, match="not a file in this folder"):
        torchverity.load(folder, sidecar="ignore")


# ------------------------------------------------------------------ torch.distributed

_RANK = """
import json, sys, torch, torch.distributed as dist, torchverity
rank, folder = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank,
                        world_size=2)
shared = torchverity.save({"w": torch.full((4,), float(rank))}, f"{folder}/shared.pt")
own = torchverity.save({"w": torch.full((4,), float(rank))}, f"{folder}/rank{rank}.pt",
                       all_ranks=True)
dist.barrier()
dist.destroy_process_group()
print(json.dumps([shared.written, own.written]))
"""


def test_only_rank_0_writes_unless_all_ranks(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [json.loads(o.strip().splitlines()[-1]) for o, _ in outs] == [[True, True],
                                                                         [False, True]]
    assert torchverity.load(tmp_path / "shared.pt", sidecar="require")["w"][0].item() == 0.0
    assert torchverity.load(tmp_path / "rank1.pt", sidecar="require")["w"][0].item() == 1.0


def test_objects_that_cannot_be_verified_are_refused_before_writing(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match=r"cannot save .*unsupported type _Custom") as info:
        torchverity.save({"w": torch.ones(2), "obj": _Custom()}, tmp_path / "m.pt")
    assert "meta=" in (info.value.hint or "")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(UsageError, match="JSON-ready"):
        torchverity.save({"w": torch.ones(2)}, tmp_path / "m.pt", meta={"t": torch.ones(1)})
    assert list(tmp_path.iterdir()) == []


def test_whole_module_objects_are_refused_with_the_state_dict_recipe(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(FormatError, match=r"'model' is a whole torch\.nn\.Module") as info:
        torchverity.save({"model": model, "step": 1}, tmp_path / "m.pt")
    assert "model.state_dict()" in (info.value.hint or "")
    with pytest.raises(FormatError, match=r"torch\.optim\.Optimizer"):
        torchverity.save([torch.optim.SGD(model.parameters(), lr=0.1)], tmp_path / "m.pt")
    assert list(tmp_path.iterdir()) == []


def test_sweep_removes_only_this_hosts_dead_temps(tmp_path: Path) -> None:
    import socket

    path = tmp_path / "ckpt[1].pt"  # glob characters in the name
    dead = tmp_path / f".ckpt[1].pt.tmp-{socket.gethostname()}-999999999-0000"
    other_host = tmp_path / ".ckpt[1].pt.tmp-another-host-999999999-0000"
    live = tmp_path / f".ckpt[1].pt.tmp-{socket.gethostname()}-{os.getpid()}-0000"
    for p in (dead, other_host, live):
        p.write_bytes(b"half a checkpoint")
    torchverity.save(_state(), path)
    assert not dead.exists() and other_host.exists() and live.exists()
    assert _equal(torchverity.load(path, sidecar="require"), _state())
