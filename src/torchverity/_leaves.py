"""A checkpoint's tree flattened into dotted names, and the state dict inside it (torch-free).

Shared by the loaded-object readers (:mod:`torchverity._tensors`, with real tensors)
and the inert zip listing (:mod:`torchverity.pickles._listing`, with listed ones), so
both name every entry the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

# What to yield for an object that is not a dict, list, tuple or plain value.
Leaf = Callable[[Any, str], Iterator[tuple[str, Any]]]


def iter_tree(obj: Any, leaf: Leaf, prefix: str = "", key: Callable[[Any], str] = str,
              ) -> Iterator[tuple[str, Any]]:
    """``(dotted name, value)`` for every leaf: dict keys and list/tuple indices joined
    with dots, plain values as they are, anything else as ``leaf`` says."""
    if isinstance(obj, Mapping):
        for k, value in obj.items():
            name = key(k)
            yield from iter_tree(value, leaf, f"{prefix}.{name}" if prefix else name, key)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from iter_tree(value, leaf, f"{prefix}.{i}" if prefix else str(i), key)
    elif obj is None or isinstance(obj, (bool, int, float, str)):
        yield prefix, obj
    else:
        yield from leaf(obj, prefix)


def weights_in(obj: Mapping[Any, Any], is_tensor: Callable[[Any], bool]) -> Mapping[Any, Any]:
    """The model weights inside a checkpoint dict: the dict itself when every value is a
    tensor, else its ``state_dict`` / ``model_state_dict`` / ``model`` entry, else itself."""
    if obj and all(is_tensor(v) for v in obj.values()):
        return obj
    for key in ("state_dict", "model_state_dict", "model"):
        inner = obj.get(key)
        if isinstance(inner, Mapping):
            return inner
    return obj
