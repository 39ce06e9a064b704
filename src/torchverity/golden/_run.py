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
from torchverity.errors import FormatError, InputError


def output_leaves(outputs: Any) -> list[tuple[str, torch.Tensor]]:
    """Flatten model outputs (tensor, tuple, dict, HF ModelOutput) to named tensors."""
    try:
        leaves = [(n or "output", v) for n, v in iter_leaves(outputs)]
    except FormatError as exc:  # an object among the outputs, such as transformers' KV cache
        raise InputError(
            f"the model's outputs hold what a golden record cannot: {exc.message}",
            hint="return tensors (or tuples and dicts of them); a transformers model also "
                 "returns its key/value cache unless built with use_cache=False") from None
    return [(n, v) for n, v in leaves if isinstance(v, torch.Tensor)]


def call_model(model: Any, inputs: Any) -> Any:
    """``model(x)`` for a tensor, ``model(*x)`` for a tuple/list, ``model(**x)`` for a dict.

    A model that raises on the inputs (token ids given as floats, a wrong shape) raises
    :class:`InputError` naming it, with the model's exception as its cause."""
    try:
        if isinstance(inputs, Mapping):
            return model(**inputs)
        if isinstance(inputs, (tuple, list)):
            return model(*inputs)
        return model(inputs)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise InputError(
            f"{type(model).__name__} raised {type(exc).__name__} on the inputs "
            f"{_describe(inputs)}: {first}",
            hint="give inputs the model takes: --inputs FILE (a .pt or .safetensors of them, "
                 "e.g. {'input_ids': ...} for a language model), or --shape with --dtype "
                 "(int64 draws token ids) for one random tensor; the same call in Python "
                 "shows the traceback") from exc


def _describe(inputs: Any) -> str:
    leaves = [v for _, v in iter_leaves(inputs) if isinstance(v, torch.Tensor)]
    return ", ".join(f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
                     for v in leaves[:4]) or type(inputs).__name__


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
