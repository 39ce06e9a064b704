"""A nested ``.pt`` layout from an inertly read checkpoint: ``{"model": ..., "optimizer": ...}``.

The optimizer part is what ``torch.optim.Optimizer.state_dict()`` returns
(parameters numbered in the order of their groups), so ``load_state_dict``
accepts it; it is rebuilt from a whole pickled optimizer (an inert
placeholder) or taken from a saved optimizer state dict (Lightning's
``optimizer_states``). A file holding an optimizer alone gives ``{"optimizer": ...}``.
The model part is the state dict under a usual key, else the file's top-level tensors
(a saved ``state_dict()``, with or without scalars such as the epoch beside it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from torchverity.pickles._inert import Inert

_MODEL_KEYS = ("state_dict", "model", "model_state_dict", "net", "module")
_OPT_KEYS = ("optimizer", "optimizer_states", "optimizer_state_dict", "opt")


def _state(obj: Any) -> Any:
    return obj._tv_state if isinstance(obj, Inert) else obj


def _model(obj: Any, tensors: Mapping[str, torch.Tensor],
           names: Mapping[int, str]) -> dict[str, torch.Tensor] | None:
    if not isinstance(obj, Mapping):
        return dict(tensors)
    for key in _MODEL_KEYS:
        if key in obj and isinstance(obj[key], Mapping):
            return _by_identity(obj[key], tensors, names)
        if key in obj:  # a whole model, read inertly: its tensors are named under the key
            prefix = f"{key}."
            return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    # A saved state_dict is the model itself; scalars beside it (epoch) stay in the meta.
    return _by_identity(obj, tensors, names) or None


def _by_identity(state: Mapping[Any, Any], tensors: Mapping[str, torch.Tensor],
                 names: Mapping[int, str]) -> dict[str, torch.Tensor]:
    """A state dict's tensors under its own keys, found by identity, not by name: tied
    weights are one tensor under two keys, extracted once."""
    return {k: tensors[names[id(v)]] for k, v in state.items()
            if isinstance(k, str) and isinstance(v, torch.Tensor) and id(v) in names}


def _optimizer_state(opt: Any) -> dict[str, Any] | None:
    state = _state(opt)
    if not isinstance(state, Mapping) or "param_groups" not in state:
        return None
    groups = state["param_groups"]
    if all(isinstance(p, int) for g in groups for p in g.get("params", [])):
        return {"state": dict(state.get("state", {})), "param_groups": list(groups)}
    index: dict[int, int] = {}
    out_groups = []
    for group in groups:
        ids = []
        for p in group.get("params", []):
            index.setdefault(id(p), len(index))
            ids.append(index[id(p)])
        out_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    per_param = state.get("state", {})
    out_state = {index[id(p)]: dict(v) for p, v in per_param.items() if id(p) in index}
    return {"state": out_state, "param_groups": out_groups}


def _optimizer(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, Mapping):
        return None
    for key in _OPT_KEYS:
        value = obj.get(key)
        if isinstance(value, (list, tuple)) and value:
            value = value[0]
        found = _optimizer_state(value) if value is not None else None
        if found is not None:
            return found
    return None


def nested_checkpoint(obj: Any, tensors: Mapping[str, torch.Tensor],
                      names: Mapping[int, str]) -> dict[str, Any] | None:
    """The nested layout, or None when the file holds neither a model nor an optimizer
    (tensors only in places no state dict lives). ``tensors`` are the extracted tensors by
    name, ``names`` the name of each tensor of ``obj`` by ``id``."""
    alone = _optimizer_state(obj)
    if alone is not None:  # an optimizer's state_dict (or the optimizer) saved on its own
        return {"optimizer": alone}
    model = _model(obj, tensors, names)
    if model is None:
        return None
    out: dict[str, Any] = {"model": model}
    opt = _optimizer(obj)
    if opt is not None:
        out["optimizer"] = opt
    return out


def tensor_paths(out: Mapping[str, Any]) -> dict[int, list[str | int]]:
    """Each tensor of a nested output (by ``id``) with the keys leading to it from the top,
    first in the order they are written; a tensor reached twice keeps its first path."""
    paths: dict[int, list[str | int]] = {}
    todo: list[tuple[Any, list[str | int]]] = [(out, [])]
    while todo:
        item, path = todo.pop()
        if isinstance(item, torch.Tensor):
            paths.setdefault(id(item), path)
            continue
        if isinstance(item, Mapping):
            children = [(v, [*path, k]) for k, v in item.items()]
        elif isinstance(item, (list, tuple)):
            children = [(v, [*path, i]) for i, v in enumerate(item)]
        else:
            continue
        todo.extend(reversed(children))  # popped last-in first: visited in written order
    return paths


def same_tree(a: Any, b: Any) -> bool:
    """Equal structure, and tensors equal bit for bit (dtype and shape included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
