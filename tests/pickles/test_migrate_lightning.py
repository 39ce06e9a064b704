"""``migrate`` of a real Lightning Trainer checkpoint whose hyper-parameters are an omegaconf
``DictConfig`` (nested dicts, a ``ListConfig``, an interpolation, a missing value, an Enum),
trained 2 steps with the Trainer's default ModelCheckpoint: the hyper-parameters keep the
config's order; ``--nested`` counts every tensor it writes; every tensor the meta names is
found in the output, flat or nested (a whole pickled model and optimizer too)."""

from __future__ import annotations

import enum
import functools
import json
import operator
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import torchverity
from torchverity.pickles import migrate

DOC = Path(__file__).parents[2] / "docs/formats/migrate.md"


class Act(enum.Enum):
    RELU = 1
    GELU = 2


def _config() -> Any:
    import omegaconf

    return omegaconf.OmegaConf.create({
        "model": {"width": 4, "layers": [2, 3], "act": Act.GELU, "ref": "${model.width}"},
        "optim": {"lr": 0.01, "betas": [0.9, 0.99]},
        "tags": ["a", "b"],
        "missing": {"seed": "???", "note": None},
    })


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from torch_zip_artifacts import lightning_checkpoint, lightning_net

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("lightning")
    return lightning_checkpoint(lightning_net(_config()), root / "run.ckpt", 2,
                                checkpointing=True)


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A whole pickled model and optimizer beside a numpy array, as older scripts saved."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    path = tmp_path_factory.mktemp("whole") / "legacy.pt"
    torch.save({"model": model, "optimizer": opt, "hist": np.arange(3.0)}, path)
    return path


def _key_order(tree: Any) -> Any:
    if isinstance(tree, dict) and "$class" not in tree:  # "$class": the Enum, a leaf
        return [(k, _key_order(v)) for k, v in tree.items()]
    if isinstance(tree, list):
        return [_key_order(v) for v in tree]
    return None


def test_hyper_parameters_keep_the_config_order(ckpt: Path, tmp_path: Path) -> None:
    import omegaconf

    result = migrate(ckpt, tmp_path / "run.safetensors")
    hyper = json.loads(Path(result.meta_path or "").read_text())["user"]["content"][
        "hyper_parameters"]
    source = omegaconf.OmegaConf.to_container(torch.load(ckpt, weights_only=False)[
        "hyper_parameters"], resolve=False)
    assert _key_order(hyper) == _key_order(source)
    assert list(hyper) == ["model", "optim", "tags", "missing"]
    assert list(hyper["model"]) == ["width", "layers", "act", "ref"]
    # docs/formats/migrate.md: an Enum member is its class, named, called with its value
    act = {"$class": f"{Act.__module__}.{Act.__qualname__}", "args": [2]}
    assert '{"$class": "mod.Act", "args": [2]}' in DOC.read_text()
    assert hyper == {"model": {"width": 4, "layers": [2, 3], "act": act,
                               "ref": "${model.width}"},
                     "optim": {"lr": 0.01, "betas": [0.9, 0.99]},
                     "tags": ["a", "b"], "missing": {"seed": "???", "note": None}}


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


def test_nested_output_counts_every_tensor_it_writes(
        ckpt: Path, tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    dst = tmp_path / "nested.pt"
    res = run_cli("migrate", "--json", "--nested", ckpt, dst)
    assert res.code == 0, res.err
    written = len(list(_tensors(torchverity.load(dst, sidecar="require"))))
    assert written == 2 + 6  # the layer's weight and bias, Adam's 3 per parameter
    assert json.loads(res.out)["result"]["tensors"] == written
    res = run_cli("migrate", "--nested", ckpt, tmp_path / "again.pt")
    assert f": {written} tensors, read back bit for bit" in res.out, res.out


def _names(tree: Any) -> Iterator[str]:
    """Every tensor name the meta's content refers to."""
    if isinstance(tree, dict):
        for key in ("$tensor", "$ndarray"):
            if isinstance(tree.get(key), str):
                yield tree[key]
        yield from tree.get("$nested", [])
        for v in tree.values():
            yield from _names(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _names(v)


@pytest.mark.parametrize("source", ["ckpt", "whole"])
def test_every_tensor_the_meta_names_is_in_the_output(
        source: str, request: pytest.FixtureRequest, tmp_path: Path,
        run_cli: Callable[..., Any]) -> None:
    src: Path = request.getfixturevalue(source)
    flat = migrate(src, tmp_path / "flat.safetensors")
    flat_user = json.loads(Path(flat.meta_path or "").read_text())["user"]
    flat_out = torchverity.load(flat.target, sidecar="require")
    # a pickled module's buffers are not referred to: they are its state_dict() names
    assert set(_names(flat_user["content"])) <= set(flat_out)
    names = set(flat_out)

    nested = migrate(src, tmp_path / "nested.pt", nested=True)
    user = json.loads(Path(nested.meta_path or "").read_text())["user"]
    assert user["content"] == flat_user["content"]
    documented = {key for key in user if f"| `{key}` |" in DOC.read_text()}
    assert documented == set(user)
    out = torchverity.load(nested.target, sidecar="require")
    for name in names & set(user["locations"]):
        found = functools.reduce(operator.getitem, user["locations"][name], out)
        assert isinstance(found, torch.Tensor), name
        assert found.dtype == flat_out[name].dtype and torch.equal(found, flat_out[name]), name
    assert len(user["locations"]) == nested.tensors == len(list(_tensors(out)))
    # the rest are named as not written, and migrate says so
    left_out = sorted(names - set(user["locations"]))
    assert left_out == sorted(item.split(": tensor not in the nested output")[0]
                              for item in user["skipped"])
    assert left_out == {"ckpt": [n for n in names if n.endswith(".kth_value")],
                        "whole": ["hist"]}[source] and len(left_out) == 1
    res = run_cli("migrate", "--nested", src, tmp_path / "again.pt")
    assert f"not migrated: {left_out[0]}: tensor not in the nested output" in res.err
