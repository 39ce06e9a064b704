"""A fast walk of the pickles torch writes that checks only the scan's bounds.

:func:`walk_bounds` keeps, per stack item, just what the bounds need: the
number of items it expands to when every shared reference is copied, and its
container nesting, computed exactly as the scanner's walker
(:class:`torchverity.pickles._ops.Walker`) computes them, with the same MARK,
stack, memo and opcode bounds and the same messages. It knows the opcodes of
the protocol-2 pickles ``torch.save`` writes and takes a shortcut through
nothing else: any other opcode, a payload large enough to hold a nested
archive, or a stream the loaders would reject raises :class:`Unsure`, and the
full scan decides. About ten times faster than the full walk, which also
records every global, call and payload for a verdict.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from torchverity.pickles._source import Limits, PickleError

_KEEP_BYTES = 1 << 16  # the walker keeps payloads up to this; larger ones may be archives
_CONST = object()  # a plain constant: expands to 1 item, holds no container, never a target
_PID = object()  # a persistent id's result: as a constant here (mutating it is Unsure)


class Unsure(Exception):
    """The fast walk met something only the full scan models."""


class _Walk:
    __slots__ = ("data", "floor", "limits", "marks", "memo", "op", "stack")

    def __init__(self, data: bytes, limits: Limits) -> None:
        self.data, self.limits = data, limits
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.floor = 0  # the stack below the innermost MARK is out of reach
        self.memo: dict[int, Any] = {}
        self.op = 0  # offset of the opcode being run

    def pop(self) -> Any:
        if len(self.stack) <= self.floor:
            raise Unsure
        return self.stack.pop()

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise Unsure
        start = self.marks.pop()
        self.floor = self.marks[-1] if self.marks else 0
        items = self.stack[start:]
        del self.stack[start:]
        return items

    def target(self) -> list[int]:
        """The mutable top item (a container, global or call result), as BUILD/APPEND need."""
        if len(self.stack) <= self.floor or type(self.stack[-1]) is not list:
            raise Unsure
        top: list[int] = self.stack[-1]
        return top

    def exceeded(self, message: str) -> PickleError:
        return PickleError(message, self.op, limit=True)

    def weight(self, w: int) -> int:
        if w > self.limits.max_expansion:
            raise self.exceeded(
                f"object graph expands to more than {self.limits.max_expansion} items "
                "through shared references (memo expansion bomb)")
        return w

    def depth(self, d: int) -> int:
        if d > self.limits.max_depth:
            raise self.exceeded(
                f"containers nested deeper than {self.limits.max_depth} levels (recursive "
                "readers of the loaded object would fail with RecursionError)")
        return d

    def container(self, items: list[Any]) -> list[int]:
        total, depth = len(items) + 1, 1
        for item in items:
            if type(item) is list:
                total += item[0] - 1
                if item[1] >= depth:
                    depth = item[1] + 1
        if total > self.limits.max_expansion or depth > self.limits.max_depth:
            self.weight(total)
            self.depth(depth)
        return [total, depth]

    def extend(self, target: list[int], items: list[Any]) -> None:
        w, d = _weigh(items)
        target[0] = self.weight(target[0] + w)
        if d >= target[1]:
            target[1] = self.depth(d + 1)

    def made(self, args: Any) -> list[int]:
        if type(args) is list:
            return [self.weight(1 + args[0]), args[1]]
        return [2, 0]

    def put(self, key: int) -> None:
        if len(self.stack) <= self.floor:
            raise Unsure
        if key not in self.memo and len(self.memo) >= self.limits.max_memo:
            raise self.exceeded(f"memo larger than {self.limits.max_memo} entries")
        self.memo[key] = self.stack[-1]

    def get(self, key: int) -> None:
        value = self.memo.get(key, self)
        if value is self:
            raise Unsure
        self.stack.append(value)


def _weigh(items: list[Any]) -> tuple[int, int]:
    total, depth = len(items), 0
    for item in items:
        if type(item) is list:
            total += item[0] - 1
            if item[1] > depth:
                depth = item[1]
    return total, depth


# A handler runs the opcode whose argument starts at ``i`` and returns where the next
# opcode starts (-1 after STOP).
Handler = Callable[[_Walk, bytes, int], int]


def _const(size: int) -> Handler:
    def handler(w: _Walk, data: bytes, i: int) -> int:
        w.stack.append(_CONST)
        return i + size

    return handler


def _sized(fmt: str) -> Handler:
    size = struct.calcsize(fmt)

    def handler(w: _Walk, data: bytes, i: int) -> int:
        (n,) = struct.unpack_from(fmt, data, i)
        if not 0 <= n <= _KEEP_BYTES:
            raise Unsure  # a larger one is kept as a blob the full scan opens (an archive?)
        w.stack.append(_CONST)
        return i + size + n

    return handler


def _long1(w: _Walk, data: bytes, i: int) -> int:
    if data[i] > 64:
        raise Unsure
    w.stack.append(_CONST)
    return i + 1 + data[i]


def _fresh(w: _Walk, data: bytes, i: int) -> int:
    w.stack.append([1, 0])
    return i


def _global(w: _Walk, data: bytes, i: int) -> int:
    for _ in range(2):
        end = data.index(b"\n", i, i + w.limits.max_line)
        i = end + 1
    w.stack.append([1, 0])
    return i


def _stack_global(w: _Walk, data: bytes, i: int) -> int:
    w.pop()
    w.pop()
    w.stack.append([1, 0])
    return i


def _mark(w: _Walk, data: bytes, i: int) -> int:
    if len(w.marks) >= w.limits.max_depth:
        raise w.exceeded(f"more than {w.limits.max_depth} nested MARKs")
    w.floor = len(w.stack)
    w.marks.append(w.floor)
    return i


def _from_mark(w: _Walk, data: bytes, i: int) -> int:
    w.stack.append(w.container(w.pop_mark()))
    return i


def _tuple_n(n: int) -> Handler:
    def handler(w: _Walk, data: bytes, i: int) -> int:
        stack = w.stack
        if len(stack) - n < w.floor:
            raise Unsure
        items = stack[-n:]
        del stack[-n:]
        stack.append(w.container(items))
        return i

    return handler


def _append(w: _Walk, data: bytes, i: int) -> int:
    item = w.pop()
    w.extend(w.target(), [item])
    return i


def _extend(pairs: bool) -> Handler:
    def handler(w: _Walk, data: bytes, i: int) -> int:
        items = w.pop_mark()
        if pairs and len(items) % 2:
            raise Unsure
        w.extend(w.target(), items)
        return i

    return handler


def _setitem(w: _Walk, data: bytes, i: int) -> int:
    value, key = w.pop(), w.pop()
    w.extend(w.target(), [key, value])
    return i


def _call(extra: int) -> Handler:
    def handler(w: _Walk, data: bytes, i: int) -> int:
        for _ in range(extra):
            w.pop()  # NEWOBJ_EX's kwargs
        args = w.pop()
        w.pop()
        w.stack.append(w.made(args))
        return i

    return handler


def _build(w: _Walk, data: bytes, i: int) -> int:
    state = w.pop()
    inst = w.target()
    if type(state) is list and state[1] >= inst[1]:
        inst[1] = w.depth(state[1] + 1)
    return i


def _binpersid(w: _Walk, data: bytes, i: int) -> int:
    w.pop()
    w.stack.append(_PID)
    return i


def _pop(w: _Walk, data: bytes, i: int) -> int:
    if w.marks and len(w.stack) == w.marks[-1]:
        w.pop_mark()  # POP of a bare MARK, as CPython does
    else:
        w.pop()
    return i


def _pop_mark(w: _Walk, data: bytes, i: int) -> int:
    w.pop_mark()
    return i


def _dup(w: _Walk, data: bytes, i: int) -> int:
    if len(w.stack) <= w.floor:
        raise Unsure
    w.stack.append(w.stack[-1])
    return i


def _memo(fmt: str, action: str) -> Handler:
    size = struct.calcsize(fmt)

    def handler(w: _Walk, data: bytes, i: int) -> int:
        (key,) = struct.unpack_from(fmt, data, i)
        w.put(key) if action == "put" else w.get(key)
        return i + size

    return handler


def _memoize(w: _Walk, data: bytes, i: int) -> int:
    w.put(len(w.memo))
    return i


def _proto(w: _Walk, data: bytes, i: int) -> int:
    if data[i] > 5:
        raise Unsure
    return i + 1


def _stop(w: _Walk, data: bytes, i: int) -> int:
    w.pop()
    return -1


_HANDLERS: dict[bytes, Handler] = {
    b"\x80": _proto, b".": _stop, b"N": _const(0), b"\x88": _const(0), b"\x89": _const(0),
    b"J": _const(4), b"K": _const(1), b"M": _const(2), b"G": _const(8), b"\x8a": _long1,
    b"X": _sized("<I"), b"\x8c": _sized("<B"), b"\x8d": _sized("<Q"), b"T": _sized("<i"),
    b"U": _sized("<B"), b"B": _sized("<I"), b"C": _sized("<B"), b"\x8e": _sized("<Q"),
    b"]": _fresh, b"}": _fresh, b")": _fresh, b"\x8f": _fresh,
    b"l": _from_mark, b"t": _from_mark, b"d": _from_mark, b"\x91": _from_mark,
    b"\x85": _tuple_n(1), b"\x86": _tuple_n(2), b"\x87": _tuple_n(3),
    b"a": _append, b"e": _extend(False), b"\x90": _extend(False), b"s": _setitem,
    b"u": _extend(True), b"(": _mark, b"0": _pop, b"1": _pop_mark, b"2": _dup,
    b"q": _memo("<B", "put"), b"r": _memo("<I", "put"), b"\x94": _memoize,
    b"h": _memo("<B", "get"), b"j": _memo("<I", "get"),
    b"c": _global, b"\x93": _stack_global, b"R": _call(0), b"\x81": _call(0),
    b"\x92": _call(1), b"b": _build, b"Q": _binpersid,
}
_TABLE: list[Handler | None] = [_HANDLERS.get(bytes([code])) for code in range(256)]


def walk_bounds(data: bytes, limits: Limits) -> None:
    """Raise PickleError (``limit=True``) where the pickle in ``data`` exceeds a bound.

    Raises :class:`Unsure` when only the full scan can tell, including any stream a
    loader would reject and bytes after the first STOP.
    """
    w = _Walk(data, limits)
    try:
        end = _run(w, data)
    except (IndexError, ValueError, struct.error):
        raise Unsure from None  # truncated or malformed: the loader reports it
    if end != len(data):
        raise Unsure  # more after the STOP


def _run(w: _Walk, data: bytes) -> int:
    """The opcode loop. The opcodes of a torch pickle's tensor entries (about 25 per
    tensor) are inlined; a call per opcode would cost as much as the work itself."""
    stack, memo, marks, table = w.stack, w.memo, w.marks, _TABLE
    limits = w.limits
    max_ops, max_stack, max_memo, max_depth = (limits.max_ops, limits.max_stack,
                                               limits.max_memo, limits.max_depth)
    unpack_from, i, ops, floor = struct.unpack_from, 0, 0, 0
    # Each opcode is at least a byte and pushes at most one item: below these sizes
    # neither bound can be reached, and the loop skips counting.
    counted = len(data) >= min(max_ops, max_stack)
    while True:
        code = data[i]
        if counted:
            ops += 1
            if ops > max_ops or len(stack) >= max_stack:
                w.op = i
                raise w.exceeded(f"more than {max_ops} opcodes" if ops > max_ops
                                 else f"stack deeper than {max_stack}")
        if code == 0x72 or code == 0x71:  # LONG_BINPUT, BINPUT
            if code == 0x72:
                (key,) = unpack_from("<I", data, i + 1)
                i += 5
            else:
                key = data[i + 1]
                i += 2
            if len(stack) <= floor:
                raise Unsure
            if key not in memo and len(memo) >= max_memo:
                raise w.exceeded(f"memo larger than {max_memo} entries")
            memo[key] = stack[-1]
        elif code == 0x68 or code == 0x6A:  # BINGET, LONG_BINGET
            if code == 0x68:
                value = memo.get(data[i + 1], w)
                i += 2
            else:
                value = memo.get(unpack_from("<I", data, i + 1)[0], w)
                i += 5
            if value is w:
                raise Unsure
            stack.append(value)
        elif code == 0x4B or code == 0x89 or code == 0x88:  # BININT1, NEWFALSE, NEWTRUE
            stack.append(_CONST)
            i += 2 if code == 0x4B else 1
        elif code == 0x28:  # MARK
            if len(marks) >= max_depth:
                w.op = i
                raise w.exceeded(f"more than {max_depth} nested MARKs")
            floor = len(stack)
            marks.append(floor)
            i += 1
        elif code == 0x58:  # BINUNICODE
            (n,) = unpack_from("<I", data, i + 1)
            if n > _KEEP_BYTES:
                raise Unsure
            stack.append(_CONST)
            i += 5 + n
        elif code == 0x74:  # TUPLE
            if not marks:
                raise Unsure
            start = marks.pop()
            floor = marks[-1] if marks else 0
            items = stack[start:]
            del stack[start:]
            w.op = i
            stack.append(w.container(items))
            i += 1
        elif code == 0x85 or code == 0x52 or code == 0x51:  # TUPLE1, REDUCE, BINPERSID
            if len(stack) - (2 if code == 0x52 else 1) < floor:
                raise Unsure
            item = stack.pop()
            w.op = i
            if code == 0x85:
                stack.append(w.container([item]))
            elif code == 0x52:
                stack[-1] = w.made(item)
            else:
                stack.append(_PID)
            i += 1
        elif code == 0x29:  # EMPTY_TUPLE
            stack.append([1, 0])
            i += 1
        else:
            handler = table[code]
            if handler is None:
                raise Unsure
            w.op, w.floor = i, floor
            i = handler(w, data, i + 1)
            floor = w.floor
            if i < 0:
                return w.op + 1
