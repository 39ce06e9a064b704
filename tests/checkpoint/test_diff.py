"""diff: every injected change is classified exactly, and clean copies compare equal."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import torchverity
from torchverity.checkpoint._diff import diff


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(16, 8, generator=g),
        "h": torch.randn(10, generator=g).half(),
        "bf": torch.randn(10, generator=g).bfloat16(),
        "i": torch.arange(-5, 5, dtype=torch.int32),
        "u": torch.arange(10, dtype=torch.uint8),
        "m": torch.tensor([True, False, True]),
        "c": torch.randn(4, generator=g, dtype=torch.complex64),
    }


def _copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def _flip(t: torch.Tensor, index: int, bit: int) -> None:
    """Flip ``bit`` (0 = least significant) of element ``index`` of a contiguous tensor."""
    size = t.element_size()
    raw = t.view(-1).view(torch.uint8)
    raw[index * size + bit // 8] ^= 1 << (bit % 8)


@pytest.mark.parametrize(
    ("name", "index", "bit", "field"),
    [
        ("w", 37, 31, "sign"),
        ("w", 37, 30, "exponent"),
        ("w", 37, 23, "exponent"),
        ("w", 127, 0, "mantissa"),
        ("h", 3, 15, "sign"),
        ("h", 3, 12, "exponent"),
        ("h", 3, 9, "mantissa"),
        ("bf", 9, 7, "exponent"),
        ("bf", 0, 6, "mantissa"),
        ("i", 2, 31, "sign"),
        ("i", 2, 4, "value"),
        ("u", 7, 7, "value"),
        ("m", 1, 0, "value"),
        ("c", 2, 63, "imaginary sign"),
        ("c", 2, 5, "real mantissa"),
    ],
)
def test_single_bit_flip_is_located_exactly(name: str, index: int, bit: int, field: str) -> None:
    a = _state()
    b = _copy(a)
    _flip(b[name], index, bit)
    result = diff(a, b)
    assert not result.equal
    changed = result.changed
    assert [e.name for e in changed] == [name]
    e = changed[0]
    assert (e.status, e.kind, e.bit, e.field) == ("values_changed", "bit-flip", bit, field)
    assert e.differing == 1 and e.flipped_bits == 1
    expected_index = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), a[name].shape))
    assert e.first_index == expected_index
    assert result.counts["identical"] == len(a) - 1


def test_few_bits_drift_and_large_changes() -> None:
    a = _state()
    few = _copy(a)
    _flip(few["w"], 1, 3)
    _flip(few["w"], 1, 4)
    _flip(few["w"], 90, 0)
    e = diff(a, few).by_name["w"]
    assert (e.kind, e.differing, e.flipped_bits, e.first_index) == ("few-bits", 2, 3, (0, 1))

    drift = _copy(a)
    drift["w"] += 1e-6
    exact = diff(a, drift).by_name["w"]
    assert exact.kind == "large" and not exact.ok and exact.differing == 128
    tolerant = diff(a, drift, atol=1e-5)
    assert tolerant.by_name["w"].kind == "drift" and tolerant.equal
    assert tolerant.by_name["w"].max_abs == pytest.approx(1e-6, rel=0.5)
    assert not diff(a, drift, atol=1e-8).equal

    large = _copy(a)
    large["w"] *= 3
    e = diff(a, large, rtol=1e-3).by_name["w"]
    assert e.kind == "large" and e.max_rel == pytest.approx(2.0, rel=1e-6) and not e.ok


def test_structure_changes() -> None:
    a = _state()
    b = _copy(a)
    b["w"] = b["w"].reshape(8, 16)
    b["h"] = b["h"].float()
    del b["u"]
    b["new"] = torch.zeros(2)
    r = diff(a, b).by_name
    assert r["w"].status == "shape_changed"
    assert r["w"].describe() == "float32[16, 8] -> float32[8, 16]"
    assert r["h"].status == "dtype_changed"
    assert r["u"].status == "only_in_a" and r["new"].status == "only_in_b"


def test_nan_bits_and_plain_values() -> None:
    nan = torch.tensor([float("nan"), 1.0])
    assert diff({"x": nan}, {"x": nan.clone()}).equal  # equal bits are equal, even NaN
    other = torch.tensor([2.0, 1.0])
    e = diff({"x": nan}, {"x": other}).by_name["x"]
    assert e.max_abs == float("inf") and not diff({"x": nan}, {"x": other}, atol=10).equal
    w = torch.ones(1)
    r = diff({"epoch": 3, "lr": 0.1, "w": w}, {"epoch": 4, "lr": 0.1, "w": w})
    assert [(e.name, e.kind) for e in r.changed] == [("epoch", "value")]


def test_large_tensor_spanning_chunks() -> None:
    a = {"big": torch.zeros(5_000_000)}
    b = {"big": a["big"].clone()}
    _flip(b["big"], 4_999_999, 30)
    e = diff(a, b).by_name["big"]
    assert (e.first_index, e.kind, e.bit, e.field) == ((4_999_999,), "bit-flip", 30, "exponent")


def test_mixed_formats_compare_equal(tmp_path: Path) -> None:
    state = _state()
    torch.save(state, tmp_path / "a.pt")
    torchverity.save(state, tmp_path / "b.safetensors")
    torchverity.save(state, tmp_path / "shards", shard_bytes=100)
    assert diff(tmp_path / "a.pt", tmp_path / "b.safetensors").equal
    assert diff(tmp_path / "b.safetensors", tmp_path / "shards").equal


def test_cli_shows_the_flipped_bit_and_exit_codes(
    tmp_path: Path, run_cli: Callable[..., Any],
) -> None:
    state = _state()
    torchverity.save(state, tmp_path / "good.pt")
    bad = _copy(state)
    _flip(bad["w"], 10, 30)
    torchverity.save(bad, tmp_path / "bad.safetensors")
    r = run_cli("diff", tmp_path / "good.pt", tmp_path / "good.pt")
    assert r.code == 0 and "equal: 7 entries (7 identical)" in r.out
    r = run_cli("diff", tmp_path / "good.pt", tmp_path / "bad.safetensors")
    assert r.code == 1
    assert "w       bit-flip" in r.out
    assert "1 of 128 elements differ, first at [1, 2]; bit-flip: bit 30 (exponent)" in r.out
    assert "DIFFERENT: 7 entries (6 identical, 1 values changed)" in r.out
    r = run_cli("diff", "--json", tmp_path / "good.pt", tmp_path / "bad.safetensors")
    data = json.loads(r.out)
    assert data["ok"] is False and data["entries"][0]["bit"] == 30
    assert data["entries"][0]["first_index"] == [1, 2]
    r = run_cli("diff", tmp_path / "good.pt", tmp_path / "nope.pt")
    assert r.code == 2 and "no such file" in r.err


@pytest.mark.parametrize(
    ("dtype", "bit", "field"),
    [(torch.float8_e4m3fn, 3, "exponent"), (torch.float8_e5m2, 1, "mantissa"),
     (torch.float64, 52, "exponent"), (torch.uint16, 15, "value"), (torch.int8, 7, "sign"),
     (torch.complex128, 127, "imaginary sign")],
)
def test_bit_fields_of_narrow_and_wide_dtypes(dtype: torch.dtype, bit: int, field: str) -> None:
    a = {"t": (torch.arange(6, dtype=torch.float32) / 4).to(dtype)}
    b = {"t": a["t"].clone()}
    _flip(b["t"], 4, bit)
    e = diff(a, b).by_name["t"]
    assert (e.kind, e.bit, e.field, e.first_index) == ("bit-flip", bit, field, (4,))


def test_cli_all_lists_identical_entries(tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    torchverity.save(_state(), tmp_path / "a.pt")
    r = run_cli("diff", "--all", tmp_path / "a.pt", tmp_path / "a.pt")
    assert r.code == 0 and r.out.count("identical") == 8  # 7 rows and the summary


def test_a_changed_plain_value_shows_both_values(tmp_path: Path) -> None:
    # Two checkpoints of consecutive epochs: the line for a changed counter says from what
    # to what, not only that it changed.
    model = torch.nn.Linear(2, 2)
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"model": model.state_dict(), "epoch": 3, "tag": "warmup"}, a)
    torch.save({"model": model.state_dict(), "epoch": 4, "tag": "x" * 200}, b)
    result = diff(a, b)
    epoch, tag = result.by_name["epoch"], result.by_name["tag"]
    assert epoch.describe() == "value changed: 3 -> 4"
    assert tag.describe().startswith("value changed: 'warmup' -> 'xxx")
    assert tag.value_b is not None and len(tag.value_b) <= 60 and tag.value_b.endswith("...")
    entries = {e["name"]: e for e in json.loads(json.dumps(result.to_dict()))["entries"]}
    assert (entries["epoch"]["value_a"], entries["epoch"]["value_b"]) == ("3", "4")
    assert result.by_name["model.weight"].status == "identical"
