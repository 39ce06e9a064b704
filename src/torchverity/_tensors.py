"""Tensors as bytes: flattening a checkpoint into named leaves, canonical byte views, dtype
names.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from torchverity._leaves import iter_tree
from torchverity.errors import FormatError


def iter_leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Flatten a checkpoint into ``(dotted name, tensor or plain value)`` pairs."""
    return iter_tree(obj, _leaf, prefix)


def _leaf(obj: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
        yield from iter_leaves(obj.state_dict(), prefix)
    elif isinstance(obj, (torch.dtype, torch.device)):
        yield prefix, str(obj)
    else:
        raise FormatError(
            f"cannot fingerprint '{prefix or '<root>'}': unsupported type {type(obj).__name__}",
            hint="fingerprint a state_dict (tensors, dicts, lists and plain values)",
        )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's canonical bytes as a flat uint8 tensor on its own device.

    A view (no copy) when the tensor is already contiguous.
    """
    t = tensor.detach()
    if t.layout != torch.strided:
        raise FormatError(f"cannot fingerprint a {t.layout} tensor",
                          hint="convert it with .to_dense()")
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous().reshape(-1).view(torch.uint8)


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy memoryview of a CPU tensor's canonical bytes."""
    flat = byte_view(tensor if tensor.device.type == "cpu" else tensor.cpu())
    return memoryview(flat.numpy()) if flat.numel() else memoryview(b"")  # type: ignore[arg-type]


def numel_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes a tensor of ``shape`` and ``dtype`` occupies (used to validate headers)."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()
