"""Plain values out of inertly unpickled configuration objects (omegaconf, Hydra-style).

An omegaconf ``DictConfig`` / ``ListConfig`` pickles its content as nodes that
point back at their parent; read inertly they are placeholders holding that
state. ``plain`` turns them into the dicts, lists and scalars they hold, so
hyper-parameters reach meta.json as ordinary JSON (no ``_content``, no parent
cycles, no placeholder type objects). A union of types (``int | None``) read
inertly is a placeholder call of ``functools.reduce``; ``union_text`` gives it
the text a real load prints.
"""

from __future__ import annotations

from typing import Any

from torchverity.pickles._inert import Inert

_DICT = "omegaconf.dictconfig.DictConfig"
_LIST = "omegaconf.listconfig.ListConfig"
_NODE_PREFIX = "omegaconf.nodes."
NOT_CONFIG = object()


def is_config(obj: Any) -> bool:
    name = getattr(obj, "_tv_name", "")
    return isinstance(obj, Inert) and (name in (_DICT, _LIST) or name.startswith(_NODE_PREFIX))


def _state(obj: Inert) -> dict[str, Any]:
    state = obj._tv_state
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        state = state[1]  # (dict state, slots state)
    return state if isinstance(state, dict) else {}


def hyper_value(obj: Any) -> Any:
    """The plain value of an omegaconf container or node; NOT_CONFIG for anything else.

    Iterative over containers, so a deep configuration cannot exhaust the stack."""
    if not is_config(obj):
        return NOT_CONFIG
    root: list[Any] = [None]
    todo: list[tuple[Any, Any, Any]] = [(obj, root, 0)]
    while todo:
        item, parent, key = todo.pop()
        if not is_config(item):
            parent[key] = item
            continue
        state = _state(item)
        if item._tv_name.startswith(_NODE_PREFIX):
            todo.append((state.get("_val"), parent, key))
            continue
        content = state.get("_content")
        if isinstance(content, dict):
            out: Any = {}
            # The stack pops last-in first: pushed in reverse, the keys are inserted into
            # `out` (and so written to meta.json) in the config's own order.
            for k, v in reversed(content.items()):
                todo.append((v, out, str(k)))
        elif isinstance(content, list):
            out = [None] * len(content)
            for i, v in enumerate(content):
                todo.append((v, out, i))
        else:
            out = content  # None, "???" (missing) or an interpolation string
        parent[key] = out
    return root[0]


_UNION_REDUCE = ("functools.reduce", "_functools.reduce")
_UNION_OR = ("operator.or_", "_operator.or_")
_GENERIC_CALLS = ("operator.getitem", "_operator.getitem", "types.GenericAlias")
_CONSTANTS = (str, int, float, bool, bytes, type(None))
_DEPTH = 16  # the scan judges no deeper union member as data either


def _name(obj: Any) -> str | None:
    """The inert name of a placeholder class or call, None for anything else."""
    if isinstance(obj, Inert) or (isinstance(obj, type) and issubclass(obj, Inert)):
        return obj._tv_name
    return None


def _class_text(name: str) -> str | None:
    """A placeholder class as a hint reads, when the scan counts it data (typing.List)."""
    from torchverity.pickles._classes import BENIGN, TORCH, classify
    from torchverity.pickles._values import GlobalRef

    module, _, attr = name.rpartition(".")
    if classify(GlobalRef(module, attr, 0, "GLOBAL"), 3)[0] not in (TORCH, BENIGN):
        return None
    return attr if module == "builtins" else name


def _hint(obj: Any, depth: int) -> str | None:
    if obj is None:
        return "None"
    if depth > _DEPTH:
        return None
    if isinstance(obj, type) and not issubclass(obj, Inert):  # resolved for real: int, str
        return obj.__name__ if obj.__module__ == "builtins" else \
            f"{obj.__module__}.{obj.__qualname__}"
    name = _name(obj)
    if name is None:
        return None
    if isinstance(obj, type):
        return _class_text(name)
    args = obj._tv_args
    if name == "builtins.type" and len(args) == 1 and isinstance(args[0], _CONSTANTS):
        return "None" if args[0] is None else type(args[0]).__name__
    if name in _GENERIC_CALLS and len(args) == 2:
        base, inner = _hint(args[0], depth + 1), _hint_argument(args[1], depth + 1)
        return None if base is None or inner is None else f"{base}[{inner}]"
    return union_text(obj, depth)


def _hint_argument(obj: Any, depth: int) -> str | None:
    if isinstance(obj, (tuple, list)) and depth <= _DEPTH:
        parts = [_hint_argument(o, depth + 1) for o in obj]
        if None in parts:
            return None
        joined = ", ".join(p for p in parts if p is not None)
        return joined if isinstance(obj, tuple) else f"[{joined}]"
    if isinstance(obj, _CONSTANTS) and not isinstance(obj, type):
        return repr(obj)
    return _hint(obj, depth)


def union_text(obj: Any, depth: int = 0) -> str | None:
    """``int | None`` for the inert placeholder of a union of types, as the scan judges
    one (reduce(or_, types) or or_ of two types, every member a hint of data classes);
    None for anything else."""
    name = _name(obj)
    if name is None or isinstance(obj, type):
        return None
    args = obj._tv_args
    if (name in _UNION_REDUCE and len(args) == 2 and _name(args[0]) in _UNION_OR
            and isinstance(args[0], type) and isinstance(args[1], tuple) and args[1]):
        members = args[1]
    elif name in _UNION_OR and len(args) == 2:
        members = args
    else:
        return None
    parts = [_hint(m, depth + 1) for m in members]
    return None if None in parts else " | ".join(p for p in parts if p is not None)
