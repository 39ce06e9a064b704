"""A bounded, non-executing walker over pickle opcodes (protocols 0-5).

The walker never imports or calls anything: it runs a symbolic stack machine
in which every value is a small inert description (a constant, a container,
a global *name*, "the result of calling X"). That is enough to recover every
global a real unpickler would resolve, including names assembled on the
stack for STACK_GLOBAL from memo entries or STRING opcodes, calls whose result
is popped, INST/OBJ of protocols 0/1, and the objects that BUILD mutates.

Work and memory are bounded: payloads larger than ``KEEP_BYTES`` are skipped
without being read into memory, containers keep at most ``KEEP_ITEMS`` items,
and the opcode count, memo size and stack depth have hard limits. Exceeding a
limit is reported as an error (the file cannot be checked), never ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchverity.pickles._handlers import HANDLER_TABLE, OPS, STOP
from torchverity.pickles._imports import lookup
from torchverity.pickles._source import ByteSource as ByteSource
from torchverity.pickles._source import Limits as Limits
from torchverity.pickles._source import PickleError as PickleError
from torchverity.pickles._source import Truncated as Truncated
from torchverity.pickles._values import KEEP_BYTES, KEEP_ITEMS, MAX_NOTED, weigh, weight
from torchverity.pickles._values import MISSING as MISSING
from torchverity.pickles._values import OPAQUE as OPAQUE
from torchverity.pickles._values import TRUNCATED as TRUNCATED
from torchverity.pickles._values import Build as Build
from torchverity.pickles._values import GlobalRef as GlobalRef
from torchverity.pickles._values import Item as Item
from torchverity.pickles._values import Value as Value
from torchverity.pickles._values import const_str as const_str
from torchverity.pickles._values import dict_get as dict_get
from torchverity.pickles._values import first_arg as first_arg
from torchverity.pickles._values import ref_of as ref_of

# Globals judged per call, by their arguments: the loader of archives pickle.dumps(tensor)
# embeds, and the calls that build typing data (type(None), typing.List[int], int | None:
# functools.reduce(operator.or_, (int, type(None)))).
WATCHED_CALLS = frozenset({"torch.storage._load_from_bytes", "builtins.type", "__builtin__.type",
                           "_operator.getitem", "operator.getitem", "__builtin__.reduce",
                           "functools.reduce", "_functools.reduce", "_operator.or_",
                           "operator.or_"})


@dataclass
class StreamReport:
    """What one pickle stream holds, as far as it could be read."""

    protocol: int = 0
    start: int = 0
    globals: list[GlobalRef] = field(default_factory=list)
    builds: list[Build] = field(default_factory=list)
    # Calls of WATCHED_CALLS globals: (offset, opcode, made); other calls are not kept.
    calls: list[tuple[int, str, Value]] = field(default_factory=list)
    # Each WATCHED_CALLS global value -> times it was pushed (GLOBAL, memo GET, DUP). A push
    # that did not end as the callee of a recorded call let the global escape (passed as an
    # argument, a state, a result): it may then be called on anything (a loader on bytes
    # that are not in the file, type() with three arguments).
    watched: dict[int, list[Any]] = field(default_factory=dict)
    opcodes: dict[str, int] = field(default_factory=dict)  # opcode name -> first offset
    persistent_ids: dict[str, int] = field(default_factory=dict)  # id kind -> first offset
    # Gadget shapes no ordinary pickle has (capped lists of (offset, detail)): a call of an
    # object computed at load time, and BUILD setting attributes on a global itself.
    computed_calls: list[tuple[int, str]] = field(default_factory=list)
    global_builds: list[tuple[int, GlobalRef]] = field(default_factory=list)
    # APPEND/SETITEM-style opcodes applied to something other than a plain list/dict.
    odd_targets: list[tuple[int, str, Value]] = field(default_factory=list)
    # Where an unpickler without persistent_load (pickle.load, joblib, numpy, torch's first
    # legacy pickle: every loader of a file's first pickle) stops at the latest: the first
    # global find_class cannot resolve, or a persistent id. Nothing after it runs.
    halt: int | None = None
    # The first opcode before ``halt`` that calls into something: (offset, opcode).
    first_call: tuple[int, str] | None = None
    # A GLOBAL/INST whose lines the end of the stream cuts: pickle.py still imports it.
    cut_global: GlobalRef | None = None
    error: str | None = None
    error_offset: int | None = None
    error_limit: bool = False  # the error is a bound of ours, not a failure of the loader
    result: Item = None
    ops: int = 0


BuildHook = Callable[[Build, ByteSource], None]


class Walker:
    """Walk one pickle stream symbolically. ``on_build`` may consume inline payloads."""

    def __init__(
        self, src: ByteSource, limits: Limits, on_build: BuildHook | None = None
    ) -> None:
        self.src = src
        self.limits = limits
        self.on_build = on_build
        self.stack: list[Item] = []
        self.marks: list[int] = []
        self.memo: dict[int, Item] = {}
        self.report = StreamReport(start=src.offset)
        self._op_offset = src.offset

    # -- stack helpers
    def push(self, v: Item) -> None:
        if len(self.stack) >= self.limits.max_stack:
            raise PickleError(f"stack deeper than {self.limits.max_stack}", self._op_offset,
                              limit=True)
        self.stack.append(v)

    def _check_weight(self, w: int) -> int:
        if w > self.limits.max_expansion:
            raise PickleError(
                f"object graph expands to more than {self.limits.max_expansion} items through "
                "shared references (memo expansion bomb)", self._op_offset, limit=True,
            )
        return w

    def _check_depth(self, depth: int) -> int:
        if depth > self.limits.max_depth:
            raise PickleError(
                f"containers nested deeper than {self.limits.max_depth} levels (recursive "
                "readers of the loaded object would fail with RecursionError)", self._op_offset,
                limit=True,
            )
        return depth

    def container(self, kind: str, items: list[Item]) -> Value:
        weight_, depth = weigh(items)
        w = self._check_weight(1 + weight_)
        d = self._check_depth(depth + 1)
        if len(items) > KEEP_ITEMS:
            return Value(kind, items=items[:KEEP_ITEMS], truncated=True, weight=w, depth=d)
        return Value(kind, items=items, weight=w, depth=d)

    def extend(self, target: Value, items: list[Item]) -> None:
        weight_, depth = weigh(items)
        target.weight = self._check_weight(target.weight + weight_)
        if depth >= target.depth:
            target.depth = self._check_depth(depth + 1)
        room = KEEP_ITEMS - len(target.items)
        if room > 0:
            target.items.extend(items[:room])
        if len(items) > room:
            target.truncated = True

    def pop(self) -> Item:
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise PickleError("stack underflow", self._op_offset)
        return self.stack.pop()

    def pop_mark(self) -> list[Item]:
        if not self.marks:
            raise PickleError("no MARK on the stack", self._op_offset)
        start = self.marks.pop()
        items = self.stack[start:]
        del self.stack[start:]
        return items

    def top(self) -> Item:
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise PickleError("stack underflow", self._op_offset)
        return self.stack[-1]

    def put(self, key: int) -> None:
        if key < 0:
            raise PickleError("negative memo key", self._op_offset)
        if len(self.memo) >= self.limits.max_memo and key not in self.memo:
            raise PickleError(f"memo larger than {self.limits.max_memo} entries",
                              self._op_offset, limit=True)
        self.memo[key] = self.top()

    def get(self, key: int) -> None:
        value = self.memo.get(key, MISSING)
        if value is MISSING:
            raise PickleError(f"memo key {key} was never stored", self._op_offset)
        if self.report.watched:
            self.pushed_again(value)
        self.push(value)

    # -- argument readers (bounded)
    def _text(self) -> str:
        return self.src.readline(self.limits.max_line).decode("latin-1")

    def _payload(self, n: int, *, text: bool) -> Item:
        if n < 0:
            raise PickleError("negative length", self._op_offset)
        if n > KEEP_BYTES:
            start = self.src.offset
            self.src.skip(n)
            # Where the bytes are, so a nested archive in them can be scanned in place.
            return OPAQUE if text else Value("blob", const=(start, n))
        data = self.src.read(n)
        if not text:
            return data
        try:
            return data.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise PickleError("invalid UTF-8 in a string", self._op_offset) from None

    def _global(self, module: str, name: str, opcode: str, dynamic: bool = False) -> Value:
        ref = GlobalRef(module, name, self._op_offset, opcode, dynamic)
        self.report.globals.append(ref)
        if self.report.halt is None and not dynamic and not lookup(ref,
                                                                   self.report.protocol).found:
            self.report.halt = self._op_offset
        value = Value("global", ref=ref)
        if ref.qualname in WATCHED_CALLS:
            self.report.watched[id(value)] = [value, 1]
        return value

    def pushed_again(self, value: Item) -> None:
        """Count a memo GET or DUP of a watched global, or of a tuple holding one: a union's
        reduce is handed operator.or_ in its argument tuple, which a second reference to
        that tuple would hand on."""
        watched = self.report.watched
        entry = watched.get(id(value))
        if entry is not None:
            entry[1] += 1
        elif type(value) is Value and value.kind == "tuple":
            for item in value.items:
                inner = watched.get(id(item))
                if inner is not None:
                    inner[1] += 1

    def called(self, via: str) -> None:
        """Note a call into a loaded object, unless every loader stopped before it."""
        if self.report.first_call is None and self.report.halt is None:
            self.report.first_call = (self._op_offset, via)

    def _made(self, via: str, callee: Item, args: Item) -> Value:
        self.called(via)
        w = self._check_weight(1 + weight(args))
        d = args.depth if type(args) is Value else 0
        made = Value("made", callee=callee, args=args, via=via, weight=w, depth=d)
        ref = callee.ref if type(callee) is Value else None
        if ref is None and len(self.report.computed_calls) < MAX_NOTED:
            self.report.computed_calls.append((self._op_offset, via))
        if ref is not None and ref.qualname in WATCHED_CALLS:
            self.report.calls.append((self._op_offset, via, made))
        return made

    # -- main loop
    def run(self) -> StreamReport:
        try:
            self._loop()
        except PickleError as exc:
            self.report.error, self.report.error_offset = str(exc), exc.offset
            self.report.error_limit = exc.limit
        return self.report

    def _loop(self) -> None:
        src, report, handlers = self.src, self.report, HANDLER_TABLE
        max_ops, ops = self.limits.max_ops, 0
        first_seen = [-1] * 256
        try:
            while True:
                offset = self._op_offset = src.offset
                pos = src._pos
                if pos < src._end:  # the common case, inlined: the opcode byte is buffered
                    code = src._buf[pos]
                    src._pos = pos + 1
                    src.offset = offset + 1
                else:
                    code = src.read(1)[0]
                handler = handlers[code]
                if handler is None:
                    raise PickleError(f"unknown opcode 0x{code:02x}", offset)
                if first_seen[code] < 0:
                    first_seen[code] = offset
                ops += 1
                if ops > max_ops:
                    raise PickleError(f"more than {max_ops} opcodes", offset, limit=True)
                if handler is STOP:
                    report.result = self.pop()
                    return
                handler(self)
        finally:
            report.ops = ops
            report.opcodes.update(
                (OPS[code].name, off) for code, off in enumerate(first_seen) if off >= 0
            )


def walk_stream(src: ByteSource, limits: Limits, on_build: BuildHook | None = None) -> StreamReport:
    """Walk one pickle stream from the source's current position up to its STOP."""
    return Walker(src, limits, on_build).run()
