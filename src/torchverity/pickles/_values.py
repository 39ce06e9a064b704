"""The symbolic values of the pickle walker: inert descriptions, never real objects.

A value is a constant, a container, a global *name*, or "the result of calling
X with Y"; none of them is ever imported, called or constructed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KEEP_BYTES = 1 << 16  # strings and bytes above this are skipped, not kept
KEEP_ITEMS = 256  # items kept per container (enough for names and small configs)
MAX_NOTED = 100  # gadget-shaped events kept per stream (one is enough for the verdict)


@dataclass(frozen=True)
class GlobalRef:
    """A global the pickle resolves: where, how, and the name it asks for."""

    module: str
    name: str
    offset: int
    opcode: str
    dynamic: bool = False  # the name is computed at load time (not a constant)

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass(eq=False, slots=True)
class Value:
    """A symbolic value. ``kind`` is const|global|tuple|list|dict|set|made|blob|opaque."""

    kind: str
    const: Any = None
    ref: GlobalRef | None = None
    items: list[Item] = field(default_factory=list)
    truncated: bool = False
    callee: Item = None
    args: Item = None
    via: str = ""  # the opcode that made a 'made' value
    state: Item = None  # last BUILD state applied
    weight: int = 1  # items this value expands to when every shared reference is copied
    depth: int = 0  # container nesting below this value (0: no containers inside)


# A stack item: a Value, or a plain constant (str, bytes, int, float, bool, None) as is,
# which keeps the common opcodes cheap.
Item = Any
OPAQUE = Value("opaque")
MISSING = Value("missing")
TRUNCATED = Value("truncated")


def weight(item: Item) -> int:
    return item.weight if type(item) is Value else 1


def weigh(items: list[Item]) -> tuple[int, int]:
    """(expanded weight, deepest nesting) of a list of items."""
    total, depth = len(items), 0
    for item in items:
        if type(item) is Value:
            total += item.weight - 1
            if item.depth > depth:
                depth = item.depth
    return total, depth


def ref_of(item: Item) -> GlobalRef | None:
    """The global an item names, if it is one."""
    return item.ref if type(item) is Value else None


def first_arg(made: Item) -> Item:
    """The first argument of a call (MISSING when there is none)."""
    args = made.args if type(made) is Value else None
    return args.items[0] if type(args) is Value and args.items else MISSING


def const_str(v: Item) -> str | None:
    return v if isinstance(v, str) else None


def dict_get(v: Item, key: str) -> Item:
    """Look up a string key in a symbolic dict as a real dict would: the last value set wins.

    MISSING when absent; TRUNCATED when the dict holds more items than were kept (the key
    may sit among the dropped ones)."""
    if type(v) is not Value or v.kind != "dict":
        return MISSING
    found: Item = MISSING
    for k, val in zip(v.items[0::2], v.items[1::2], strict=False):
        if k == key:
            found = val
    return TRUNCATED if v.truncated else found


@dataclass(frozen=True)
class Build:
    """A BUILD opcode: the object it mutates (with what made it) and where."""

    offset: int
    inst: Value
    state: Item
