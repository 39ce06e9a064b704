"""diff of tensors whose bytes changed, read from the files with numpy: the same result as
comparing the loaded tensors with torch, for every dtype, views, NaNs and infinities, one
flipped bit or many changed values, with and without tolerances; torch is not imported."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from torch_free_probe import cli
from torch_zip_artifacts import flip, state
from torchverity._jsonable import to_jsonable
from torchverity.checkpoint._diff import diff
from torchverity.checkpoint._diff_result import DiffResult
from torchverity.checkpoint._read import read_unverified

VIEWS = ("rows", "t", "every3")  # views of "base" in the same storage


def _loaded_diff(a: Path, b: Path, **tolerance: float) -> DiffResult:
    """What diff gives for the loaded tensors, compared with torch: the reference."""
    return replace(diff(read_unverified(a), read_unverified(b), **tolerance), a=str(a), b=str(b))


def _damage(t: torch.Tensor, rng: random.Random) -> None:
    """One of the changes diff tells apart, in place: a flipped bit, a few, many changed
    values, or a NaN or an infinity."""
    n = t.numel()
    if n == 0:
        return
    how = rng.choice(["bit", "bits", "values", "nan", "inf"] if t.is_floating_point()
                     else ["bit", "bits"])
    flat = t.view(-1)
    if how == "bit":
        flip(t, rng.randrange(n), rng.randrange(t.element_size() * 8))
    elif how == "bits":
        for _ in range(rng.randrange(2, 12)):
            flip(t, rng.randrange(n), rng.randrange(t.element_size() * 8))
    elif how == "values":
        for i in rng.sample(range(n), min(n, 3)):
            flat[i] = (flat[i].double() * 1.5 + 0.25).to(t.dtype)
    else:
        flat[rng.randrange(n)] = float(how)


def _pair(root: Path, seed: int) -> tuple[Path, Path]:
    """A torch.save checkpoint of every dtype and a copy with each tensor damaged."""
    rng = random.Random(seed)
    a, b = state(), state()
    for name, t in b["model"].items():
        if name not in VIEWS:  # damaged through "base"
            with torch.no_grad():
                _damage(t.data, rng)
    torch.save(a, root / f"a{seed}.pt")
    torch.save(b, root / f"b{seed}.pt")
    return root / f"a{seed}.pt", root / f"b{seed}.pt"


@pytest.mark.parametrize("seed", range(8))
def test_damaged_torch_save_files_diff_as_the_loaded_tensors(tmp_path: Path, seed: int) -> None:
    a, b = _pair(tmp_path, seed)
    got = diff(a, b)
    assert got == _loaded_diff(a, b)
    assert {e.status for e in got.changed} == {"values_changed"}
    drift = diff(a, b, rtol=0.6, atol=0.3)
    assert drift == _loaded_diff(a, b, rtol=0.6, atol=0.3)


def test_a_flipped_bit_in_a_safetensors_file_is_named_without_torch(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    weights = {"w": torch.randn(300, 70, generator=g), "b": torch.randn(70, generator=g),
               "h": torch.randn(33, generator=g).bfloat16(),
               "c": torch.randn(5, generator=g, dtype=torch.complex64)}
    save_file(weights, tmp_path / "a.safetensors")
    flip(weights["w"], 7 * 70 + 3, 29)  # an exponent bit of w[7, 3]
    flip(weights["c"], 4, 63)  # the sign of c[4]'s imaginary part
    save_file(weights, tmp_path / "b.safetensors")
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    got = cli("diff", "--json", a, b)
    assert got["code"] == 1 and got["torch"] is False
    entries = {e["name"]: e for e in json.loads(str(got["out"]))["entries"]}
    w, c = entries["w"], entries["c"]
    assert (w["kind"], w["bit"], w["field"], w["first_index"]) == (
        "bit-flip", 29, "exponent", [7, 3])
    assert (c["kind"], c["bit"], c["field"], c["first_index"]) == (
        "bit-flip", 63, "imaginary sign", [4])
    assert diff(a, b) == _loaded_diff(a, b)


def test_damaged_torch_save_files_diff_without_torch(tmp_path: Path) -> None:
    a, b = _pair(tmp_path, 0)
    got = cli("diff", "--json", a, b)
    assert got["code"] == 1 and got["torch"] is False
    want = to_jsonable(_loaded_diff(a, b).to_dict()["entries"])
    assert json.loads(str(got["out"]))["entries"] == json.loads(json.dumps(want))
