"""Running a model for a check: eval mode, no autograd, inputs on the model's device, outputs
as named tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from torchverity._tensors import iter_leaves


def output_leaves(outputs: Any) -> list[tuple[str, torch.Tensor]]:
    """Flatten model outputs (tensor, tuple, dict, HF ModelOutput) to named tensors."""
    leaves = [(n or "output", v) for n, v in iter_leaves(outputs)]
    return [(n, v) for n, v in leaves if isinstance(v, torch.Tensor)]


def call_model(model: Any, inputs: Any) -> Any:
    """``model(x)`` for a tensor, ``model(*x)`` for a tuple/list, ``model(**x)`` for a dict."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


@contextmanager
def inference_mode(model: Any) -> Iterator[None]:
    """Eval mode and no autograd; restores every submodule's previous training flag."""
    modules = list(model.modules()) if isinstance(model, torch.nn.Module) else []
    flags = [m.training for m in modules]
    try:
        for m in modules:
            m.training = False
        with torch.no_grad():
            yield
    finally:
        for m, flag in zip(modules, flags, strict=True):
            m.training = flag


def model_device(model: Any) -> torch.device:
    if isinstance(model, torch.nn.Module):
        first = next(itertools.chain(model.parameters(), model.buffers()), None)
        if first is not None:
            return first.device
    return torch.device("cpu")


def _to_device(inputs: Any, device: torch.device) -> Any:
    if isinstance(inputs, torch.Tensor):
        return inputs.to(device)
    if isinstance(inputs, Mapping):
        return {k: _to_device(v, device) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_to_device(v, device) for v in inputs)
    return inputs
