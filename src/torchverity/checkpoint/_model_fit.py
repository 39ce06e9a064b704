"""Does a checkpoint fit a model: keys, shapes and dtypes, all reported at once."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from torchverity._tensors import dtype_name
from torchverity.errors import (
    FormatError,
    StateDictMismatchError,
)


def state_dict_of(obj: Any) -> Mapping[str, Any]:
    """The model weights inside a checkpoint: the object itself or its
    ``state_dict`` / ``model`` / ``model_state_dict`` entry."""
    if isinstance(obj, Mapping):
        if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            return obj
        for key in ("state_dict", "model_state_dict", "model"):
            inner = obj.get(key)
            if isinstance(inner, Mapping):
                return inner
        return obj
    raise FormatError(f"checkpoint holds a {type(obj).__name__}, not a state_dict",
                      hint="save model.state_dict() instead of the model object")


def check_against_model(obj: Any, model: torch.nn.Module, path: Path) -> None:
    """Report every missing, unexpected, reshaped or retyped key at once, then load."""
    state = state_dict_of(obj)
    want = model.state_dict()
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want))
    mismatched = []
    for name in sorted(set(want) & set(state)):
        w, g = want[name], state[name]
        if not isinstance(g, torch.Tensor):
            mismatched.append({"name": name, "expected": "tensor", "actual": type(g).__name__})
        elif w.shape != g.shape or w.dtype != g.dtype:
            mismatched.append({"name": name,
                               "expected": f"{dtype_name(w.dtype)}{list(w.shape)}",
                               "actual": f"{dtype_name(g.dtype)}{list(g.shape)}"})
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing: {', '.join(missing[:10])}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected: {', '.join(unexpected[:10])}")
        for m in mismatched[:10]:
            parts.append(f"'{m['name']}' is {m['actual']}, model expects {m['expected']}")
        raise StateDictMismatchError(
            f"{path}: checkpoint does not fit {type(model).__name__}: " + "; ".join(parts),
            path=path, missing=missing, unexpected=unexpected, mismatched=mismatched,
            hint=f"check the model config matches the one that saved it; "
                 f"torchverity inspect {path} lists the checkpoint's tensors",
        )
    model.load_state_dict(state, strict=True)
