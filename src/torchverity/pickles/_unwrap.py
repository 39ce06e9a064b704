"""Plain values out of inertly unpickled configuration objects (omegaconf, Hydra-style).

An omegaconf ``DictConfig`` / ``ListConfig`` pickles its content as nodes that
point back at their parent; read inertly they are placeholders holding that
state. ``plain`` turns them into the dicts, lists and scalars they hold, so
hyper-parameters reach meta.json as ordinary JSON (no ``_content``, no parent
cycles, no placeholder type objects).
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
