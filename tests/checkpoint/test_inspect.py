"""inspect: contents, integrity and safety of a checkpoint, without running code from it."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import torchverity
from torchverity.checkpoint._inspect import inspect


def _ckpt() -> dict[str, Any]:
    return {
        "model": {"w": torch.ones(4, 3), "b": torch.zeros(4, dtype=torch.bfloat16)},
        "epoch": 2,
    }


def test_clean_checkpoint_reports_everything(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    saved = torchverity.save(_ckpt(), path, meta={"step": 9}, seed=3)
    r = inspect(path)
    assert r.format == "pt" and r.size == path.stat().st_size
    assert r.sidecar.status == "ok" and r.sidecar.actual == saved.digest
    assert r.scan is not None and r.scan.verdict == "safe"
    assert r.fingerprint == saved.fingerprint and r.fingerprint_matches_meta is True
    assert [(t.name, t.dtype, t.shape, t.nbytes) for t in r.tensors] == [
        ("model.b", "bfloat16", (4,), 8), ("model.w", "float32", (4, 3), 48)]
    assert r.parameters == 16 and r.bytes_by_dtype == {"float32": 48, "bfloat16": 8}
    assert r.values == {"epoch": "2"}
    assert r.meta is not None and r.meta["seed"] == 3 and r.meta["user"] == {"step": 9}



def test_meta_with_an_old_sha256_fingerprint_still_matches(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torchverity.save(_ckpt(), path)
    mp = tmp_path / "m.pt.meta.json"
    meta = json.loads(mp.read_text())
    meta["fingerprint"] = torchverity.fingerprint(_ckpt(), mode="sha256").to_dict()
    mp.write_text(json.dumps(meta))
    r = inspect(path)
    assert r.fingerprint == meta["fingerprint"]["root"] and r.fingerprint_matches_meta is True
    changed = _ckpt()
    changed["model"]["w"][0, 0] = 2
    meta["fingerprint"] = torchverity.fingerprint(changed, mode="sha256").to_dict()
    mp.write_text(json.dumps(meta))
    assert inspect(path).fingerprint_matches_meta is False

def test_cli_clean_and_json(tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    path = tmp_path / "m.pt"
    torchverity.save(_ckpt(), path, meta={"step": 9})
    r = run_cli("inspect", path)
    assert r.code == 0, r.err
    assert f"matches {path}.blake3" in r.out
    assert "scan        safe (weights_only loads it as is)" in r.out
    assert "matches meta.json" in r.out and 'user meta   {"step": 9}' in r.out
    assert "2 tensors, 16 elements (float32 48 B, bfloat16 8 B)" in r.out
    assert "model.w  float32   4x3" in r.out and "epoch = 2" in r.out
    data = json.loads(run_cli("inspect", "--json", path).out)
    assert data["ok"] is True and data["parameters"] == 16
    assert data["sidecar"]["status"] == "ok" and data["scan"]["verdict"] == "safe"


def test_damaged_file_fails(tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    path = tmp_path / "m.safetensors"
    torchverity.save(_ckpt()["model"], path)
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x10
    path.write_bytes(bytes(data))
    r = inspect(path)
    assert r.sidecar.status == "mismatched" and r.fingerprint_matches_meta is False
    cli = run_cli("inspect", path)
    assert cli.code == 1 and "DOES NOT MATCH" in cli.out


def test_meta_from_another_save_fails(tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torchverity.save({"w": torch.ones(2)}, a)
    torchverity.save({"w": torch.zeros(2)}, b)
    shutil.copy(f"{b}.meta.json", f"{a}.meta.json")
    r = inspect(a)
    assert r.sidecar.status == "ok" and r.fingerprint_matches_meta is False
    assert run_cli("inspect", a).code == 1


def test_plain_torch_file_without_records(tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    path = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(3)}, path)
    r = run_cli("inspect", path)
    assert r.code == 0 and "no sidecar" in r.out and "meta.json" not in r.out


class _Evil:
    def __init__(self, sentinel: str) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.sentinel}",))


def test_malicious_pickle_is_listed_inertly_and_never_run(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    sentinel = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": _Evil(str(sentinel))}, path)
    r = inspect(path)
    assert r.scan.verdict == "unsafe" and r.not_loaded is None
    assert [(t.name, t.shape) for t in r.tensors] == [("w", (2,))]
    cli = run_cli("inspect", path)
    assert cli.code == 1 and "scan        unsafe: loading would resolve posix.system" in cli.out
    assert "damaged" not in cli.err
    assert not sentinel.exists()


def test_sharded_folder(tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    state = {f"layer{i}.w": torch.full((64,), float(i)) for i in range(4)}
    torchverity.save(state, tmp_path / "shards", shard_bytes=600)
    r = inspect(tmp_path / "shards")
    assert r.format == "sharded" and len(r.shards) == 2 and len(r.tensors) == 4
    assert r.sidecar.status == "ok" and r.fingerprint_matches_meta is True
    assert run_cli("inspect", tmp_path / "shards").code == 0


def test_bad_input_exit_2(tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    r = run_cli("inspect", empty)
    assert r.code == 2 and "file is empty" in r.err
    r = run_cli("inspect", tmp_path / "absent.pt")
    assert r.code == 2 and "no such file" in r.err


def test_json_for_an_unsafe_file(tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    sentinel = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"x": _Evil(str(sentinel))}, path)
    r = run_cli("inspect", "--json", path)
    data = json.loads(r.out)
    assert r.code == 1 and data["ok"] is False and data["scan"]["verdict"] == "unsafe"
    assert data["tensors"] == [] and data["not_loaded"] is None  # read: it holds no tensor
    assert not sentinel.exists()


def test_limit_caps_plain_values_too(tmp_path, run_cli):
    import torch

    import torchverity

    state = {"w": torch.ones(2), **{f"hparam_{i:02d}": i for i in range(30)}}
    torchverity.save(state, tmp_path / "c.pt")
    capped = run_cli("inspect", tmp_path / "c.pt", "--limit", "5")
    assert capped.code == 0
    assert sum(line.startswith("  hparam_") for line in capped.out.splitlines()) == 5
    assert "25 more values (--limit 0 lists all)" in capped.out
    full = run_cli("inspect", tmp_path / "c.pt", "--limit", "0")
    assert sum(line.startswith("  hparam_") for line in full.out.splitlines()) == 30
    with pytest.raises(SystemExit) as exited:  # argparse's exit for bad usage
        run_cli("inspect", tmp_path / "c.pt", "--limit", "-1")
    assert exited.value.code == 2


@pytest.mark.parametrize("algo", ["sha256", "blake3", "xxh128"])
def test_safetensors_digest_comes_from_the_fingerprint_read(tmp_path: Path, algo: str) -> None:
    """The file's digest, taken while its tensors are hashed, is the file's whole digest."""
    from safetensors.torch import save_file

    from torchverity.digest import digest_file, write_sidecar

    path = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(300, 70), "b": torch.ones(3, dtype=torch.bfloat16)}, path,
              metadata={"format": "pt"})
    want = digest_file(path, algo).hexdigest
    assert inspect(path).sidecar.actual == digest_file(path).hexdigest  # the default: blake3
    write_sidecar(path, digest_file(path, algo))
    r = inspect(path)
    assert (r.sidecar.status, r.sidecar.algo, r.sidecar.actual) == ("ok", algo, want)
