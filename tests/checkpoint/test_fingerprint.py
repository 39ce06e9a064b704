"""Content fingerprints: equal for equal content in any format or layout, different otherwise."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import torchverity
from torchverity.checkpoint._file_fingerprint import fingerprint_file
from torchverity.checkpoint._fingerprint import (
    DEVICE,
    EXACT,
    Fingerprint,
    checksum_tensors,
    device_checksum,
)
from torchverity.errors import FormatError, UsageError

ALL_DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.complex64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool,
]


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    state = {f"t_{str(d).removeprefix('torch.')}": (base * 7).to(d) for d in ALL_DTYPES}
    state["scalar"] = torch.tensor(3.5)
    state["empty"] = torch.zeros(0, 4)
    return state


def test_equal_across_formats_mmap_and_sharding(tmp_path: Path) -> None:
    state = _state()
    expected = torchverity.fingerprint(state).root
    pt, st = tmp_path / "m.pt", tmp_path / "m.safetensors"
    torch.save(state, pt)
    torchverity.save(state, st)
    torchverity.save(state, tmp_path / "shards", shard_bytes=256)
    assert fingerprint_file(pt).root == expected
    assert fingerprint_file(st).root == expected
    assert fingerprint_file(tmp_path / "shards").root == expected
    assert torchverity.fingerprint(torch.load(pt, mmap=True, weights_only=True)).root == expected
    loaded = torchverity.load(st)
    assert torchverity.fingerprint(loaded).root == expected


def test_independent_of_key_order_and_memory_layout() -> None:
    w = torch.randn(8, 6)
    a = {"w": w, "b": torch.arange(4)}
    strided = w.t().contiguous().t()  # same values, column-major storage
    assert not strided.is_contiguous()
    b = {"b": torch.arange(4), "w": strided}
    assert torchverity.fingerprint(a) == torchverity.fingerprint(b)
    sliced = torch.randn(8, 12)[:, ::2]
    assert torchverity.fingerprint({"w": sliced}).root == torchverity.fingerprint(
        {"w": sliced.contiguous()}).root
    neg = torch.randn(3, 2, dtype=torch.complex64)
    assert torchverity.fingerprint({"c": neg.conj()}).root == torchverity.fingerprint(
        {"c": neg.conj().resolve_conj()}).root


def test_every_dtype_works_where_the_numpy_recipe_crashes() -> None:
    bf16 = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(TypeError):
        bf16.numpy()  # the usual tensor.numpy().tobytes() recipe
    fp = torchverity.fingerprint(_state())
    assert fp.algo == EXACT and len(fp.entries) == len(ALL_DTYPES) + 2
    assert fp.tensors["t_bfloat16"].dtype == "bfloat16"


def test_name_dtype_shape_and_bytes_all_matter() -> None:
    t = torch.arange(12, dtype=torch.int32)
    base = torchverity.fingerprint({"a": t}).root
    variants = [
        {"b": t},
        {"a": t.view(torch.float32)},  # same bytes, other dtype
        {"a": t.reshape(3, 4)},  # same bytes, other shape
        {"a": t + 0 * t + torch.eye(12, dtype=torch.int32)[0]},
    ]
    roots = {torchverity.fingerprint(v).root for v in variants}
    assert base not in roots and len(roots) == len(variants)


def test_every_sampled_single_bit_flip_changes_the_fingerprint() -> None:
    rng = random.Random(5)
    state = _state()
    base = torchverity.fingerprint(state)
    for name in rng.sample(sorted(state), 8):
        t = state[name]
        if t.numel() == 0:
            continue
        raw = t.view(-1).view(torch.uint8)
        pos, bit = rng.randrange(raw.numel()), rng.randrange(8)
        raw[pos] ^= 1 << bit
        after = torchverity.fingerprint(state)
        assert base.differing(after) == [name]
        raw[pos] ^= 1 << bit
    assert torchverity.fingerprint(state) == base


def test_nested_checkpoint_with_plain_values() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = {"model": model, "optimizer": opt, "epoch": 4, "lr": 0.1, "tags": ["a", None]}
    fp = torchverity.fingerprint(ckpt)
    assert {"model.weight", "model.bias", "epoch", "lr", "tags.0", "tags.1"} <= set(fp.tensors)
    ckpt["epoch"] = 5
    assert torchverity.fingerprint(ckpt).differing(fp) == ["epoch"]
    with pytest.raises(FormatError, match="unsupported type"):
        torchverity.fingerprint({"x": object()})


def test_record_round_trip_and_tamper_detection() -> None:
    fp = torchverity.fingerprint(_state())
    data = json.loads(json.dumps(fp.to_dict()))
    assert Fingerprint.from_dict(data) == fp
    data["tensors"]["t_float32"]["digest"] = "0" * 64
    with pytest.raises(FormatError, match="root does not match"):
        Fingerprint.from_dict(data)


def test_device_mode_catches_every_single_bit_flip() -> None:
    t = torch.randn(1000)
    base = device_checksum(t).clone()
    words = t.view(torch.int32)
    for pos in (0, 1, 500, 999):
        for bit in range(32):
            words[pos] ^= 1 << bit if bit < 31 else -(1 << 31)
            changed = device_checksum(t)
            assert bool((changed != base).all()), (pos, bit)
            words[pos] ^= 1 << bit if bit < 31 else -(1 << 31)
    assert torch.equal(device_checksum(t), base)
    assert checksum_tensors([t, t]).shape == (2, 2)
    dev = torchverity.fingerprint({"t": t}, mode="device")
    assert dev.algo == DEVICE
    with pytest.raises(UsageError, match="cannot compare"):
        dev.differing(torchverity.fingerprint({"t": t}))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_mode_equals_cpu_device_mode() -> None:
    state = {k: v for k, v in _state().items() if v.dtype not in (torch.uint16, torch.uint32)}
    on_gpu = {k: v.cuda() for k, v in state.items()}
    assert torchverity.fingerprint(on_gpu).algo == DEVICE
    assert torchverity.fingerprint(on_gpu, mode="device") == torchverity.fingerprint(
        state, mode="device")
    assert torchverity.fingerprint(on_gpu, mode="exact") == torchverity.fingerprint(state)


class _Evil:
    def __init__(self, sentinel: str) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.sentinel}",))


def test_fingerprint_file_never_runs_pickle_code(tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    torch.save({"w": torch.ones(2), "x": _Evil(str(sentinel))}, tmp_path / "evil.pt")
    # Read inertly: the payload stays a placeholder, the tensor is fingerprinted.
    assert fingerprint_file(tmp_path / "evil.pt") == torchverity.fingerprint({"w": torch.ones(2)})
    assert not sentinel.exists()


def test_cli_prints_root_and_tensors(tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    state = {"w": torch.ones(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}
    torchverity.save(state, tmp_path / "m.safetensors")
    torch.save(state, tmp_path / "m.pt")
    root = torchverity.fingerprint(state).root
    r = run_cli("fingerprint", tmp_path / "m.pt")
    assert r.code == 0 and r.out.startswith(f"{root}  ") and "2 entries" in r.out
    r = run_cli("fingerprint", "--tensors", tmp_path / "m.safetensors")
    assert r.code == 0 and root in r.out
    assert torchverity.fingerprint(state).tensors["w"].digest in r.out
    assert "bfloat16" in r.out
    r = run_cli("fingerprint", "--json", tmp_path / "m.safetensors")
    data = json.loads(r.out)
    assert data["root"] == root and set(data["tensors"]) == {"w", "b"}
    old = torchverity.fingerprint(state, mode="sha256").root
    for name, fmt in (("m.pt", "pt"), ("m.safetensors", "safetensors")):
        r = run_cli("fingerprint", "--mode", "sha256", tmp_path / name)
        assert r.code == 0 and r.out.startswith(f"{old}  ")
        assert f"({fmt}, sha256, 2 entries)" in r.out
    r = run_cli("fingerprint", tmp_path / "absent.pt")
    assert r.code == 2 and "no such file" in r.err


def test_exact_mode_is_blake3_of_the_documented_layout() -> None:
    import blake3

    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    fp = torchverity.fingerprint({"w": w.t().contiguous().t()})  # non-contiguous
    header = b"torchverity-tensor-v1\0w\0float32\0[2, 3]\0" + b"24\0"
    assert fp.algo == EXACT == "blake3"
    assert fp.entries[0].digest == blake3.blake3(header + w.numpy().tobytes()).hexdigest()


def test_large_tensors_spread_over_cores_give_the_same_digest() -> None:
    big = torch.randn(3 << 20)  # 12 MiB: hashed by one blake3 spread over every core
    one = torchverity.fingerprint({"big": big, "x": torch.ones(2)}, workers=1)
    assert torchverity.fingerprint({"big": big, "x": torch.ones(2)}) == one
    flipped = big.clone()
    flipped.view(torch.int32)[(3 << 20) - 1] ^= 1
    assert one.differing(torchverity.fingerprint({"big": flipped, "x": torch.ones(2)})) == ["big"]


def test_old_sha256_records_rebuild_with_their_algorithm() -> None:
    state = _state()
    old = Fingerprint.from_dict(json.loads(json.dumps(
        torchverity.fingerprint(state, mode="sha256").to_dict())))
    assert old.algo == "sha256" and old.root != torchverity.fingerprint(state).root
    assert torchverity.fingerprint(state, mode=old.algo).differing(old) == []
    state["t_int8"][0, 0] += 1
    assert torchverity.fingerprint(state, mode=old.algo).differing(old) == ["t_int8"]
    with pytest.raises(UsageError, match="cannot compare a sha256 fingerprint with a blake3"):
        old.differing(torchverity.fingerprint(state))


def test_cli_names_the_format_and_that_torchscript_holds_code(tmp_path: Path,
                                                              run_cli: Callable[..., Any]) -> None:
    from safetensors.torch import save_file

    state = {"w": torch.randn(3, 4), "b": torch.randn(3)}
    torch.save(state, tmp_path / "m.pt")
    save_file(state, tmp_path / "m.safetensors")
    module = torch.nn.Linear(4, 3)
    module.load_state_dict({"weight": state["w"], "bias": state["b"]})
    torch.jit.save(torch.jit.script(module), tmp_path / "scripted.pt")
    root = torchverity.fingerprint(state).root
    for name, fmt in (("m.pt", "pt"), ("m.safetensors", "safetensors")):
        r = run_cli("fingerprint", "--json", tmp_path / name)
        doc = json.loads(r.out)
        assert (doc["format"], doc["file"], doc["root"]) == (fmt, str(tmp_path / name), root)
        assert "TorchScript" not in r.err
    r = run_cli("fingerprint", tmp_path / "scripted.pt")
    shown = f"  {tmp_path / 'scripted.pt'}  (torchscript, blake3, 2 entries)"
    assert r.code == 0 and shown in r.out
    assert "TorchScript archive" in r.err and "holds code" in r.err
    assert "covers its tensors only" in r.err and "torchverity scan" in r.err
    doc = json.loads(run_cli("fingerprint", "--json", tmp_path / "scripted.pt").out)
    assert doc["format"] == "torchscript"
    assert set(doc["tensors"]) == {"weight", "bias"}


def test_cli_names_the_file_of_a_folder_and_why_when_it_holds_two(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    from safetensors.torch import save_file

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    save_file({"w": torch.ones(2)}, folder / "model.safetensors")
    r = run_cli("fingerprint", folder)
    assert r.code == 0 and f"  {folder / 'model.safetensors'}  (safetensors," in r.out
    assert "note" not in r.err  # one weights file: nothing to choose
    torch.save({"w": torch.zeros(2)}, folder / "pytorch_model.bin")  # different tensors
    r = run_cli("fingerprint", folder)
    assert f"  {folder / 'model.safetensors'}  (safetensors," in r.out
    assert "holds model.safetensors and pytorch_model.bin" in r.err
    assert "prefers safetensors" in r.err
    assert f"torchverity fingerprint {folder / 'pytorch_model.bin'}" in r.err
    doc = json.loads(run_cli("fingerprint", "--json", folder).out)
    assert doc["file"] == str(folder / "model.safetensors") and doc["path"] == str(folder)
    assert doc["root"] == torchverity.fingerprint({"w": torch.ones(2)}).root


def test_cli_names_where_a_damaged_pickle_breaks(tmp_path: Path,
                                                 run_cli: Callable[..., Any]) -> None:
    import zipfile

    path = tmp_path / "cut.pt"
    with zipfile.ZipFile(path, "w") as z:  # torch.save's layout, its pickle cut after 5 bytes
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00")
        z.writestr("archive/version", b"3")
    with pytest.raises(FormatError, match=r"archive/data\.pkl: stream 0 at offset 5") as caught:
        fingerprint_file(path)
    assert "restore the file" in (caught.value.hint or "")
    r = run_cli("fingerprint", path)
    assert r.code == 2 and "offset 5" in r.err and "EOFError" not in r.err
    assert f"torchverity fingerprint {path}" not in r.err
