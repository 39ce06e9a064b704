"""What each pickle opcode does to the walker's symbolic stack (:mod:`._ops`): one small
handler per opcode, and the table the walker dispatches on, indexed by the opcode byte.
Nothing here imports or calls what a pickle names."""

from __future__ import annotations

import codecs
import pickletools
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torchverity.pickles._source import PickleError, Truncated
from torchverity.pickles._text_pids import TEXT_PID_UNKNOWN, TextModuleId, read_text_pid
from torchverity.pickles._values import (
    KEEP_BYTES,
    MAX_NOTED,
    MISSING,
    OPAQUE,
    Build,
    GlobalRef,
    Item,
    Value,
    const_str,
    ref_of,
)

if TYPE_CHECKING:
    from torchverity.pickles._ops import Walker

OPS: dict[int, pickletools.OpcodeInfo] = {ord(op.code): op for op in pickletools.opcodes}


def _proto(w: Walker) -> None:
    w.report.protocol = w.src.read(1)[0]
    if w.report.protocol > 5:
        raise PickleError(f"unsupported protocol {w.report.protocol}", w._op_offset)


def _int_text(w: Walker) -> None:
    text = w._text().strip()
    if text in ("00", "01"):
        w.push(text == "01")
        return
    # LONG's suffix (INT would refuse it: lenient is safe); an empty INT line is _pickle's 0.
    digits = text.removesuffix("L") or "0"
    try:
        w.push(int(digits, 0))  # both unpicklers read base prefixes: 0x1f, 0o17, 1_000
    except ValueError:
        try:
            w.push(int(digits))  # _pickle's strtol also takes a leading zero ("017")
        except ValueError:
            raise PickleError(f"bad integer literal {text[:40]!r}", w._op_offset) from None


def _float_text(w: Walker) -> None:
    try:
        w.push(float(w._text()))
    except ValueError:
        raise PickleError("bad float literal", w._op_offset) from None


def _long_n(size: int) -> Callable[[Walker], None]:
    def handler(w: Walker) -> None:
        (n,) = struct.unpack("<B" if size == 1 else "<i", w.src.read(size))
        if n < 0:
            raise PickleError("negative length", w._op_offset)
        if n > 64:  # a huge integer is data, never a name or a length we need
            w.src.skip(n)
            w.push(OPAQUE)
            return
        w.push(int.from_bytes(w.src.read(n), "little", signed=True))

    return handler


def _sized(fmt: str, *, text: bool) -> Callable[[Walker], None]:
    size = struct.calcsize(fmt)

    def handler(w: Walker) -> None:
        (n,) = struct.unpack(fmt, w.src.read(size))
        w.push(w._payload(n, text=text))

    return handler


def _fixed(fmt: str) -> Callable[[Walker], None]:
    size = struct.calcsize(fmt)
    if fmt == "<B":
        return lambda w: w.push(w.src.read(1)[0])
    return lambda w: w.push(struct.unpack(fmt, w.src.read(size))[0])


def _string_text(w: Walker) -> None:
    raw = w._text()
    if len(raw) < 2 or raw[0] != raw[-1] or raw[0] not in "'\"":
        raise PickleError("STRING literal is not quoted", w._op_offset)
    try:  # the unpicklers' own decoding: unknown escapes such as \\u stay as they are
        w.push(codecs.escape_decode(raw[1:-1].encode("latin-1"))[0].decode("latin-1"))
    except ValueError:
        raise PickleError("bad escape in STRING literal", w._op_offset) from None


def _unicode_text(w: Walker) -> None:
    try:
        w.push(w.src.readline(w.limits.max_line).decode("raw_unicode_escape"))
    except UnicodeDecodeError:
        raise PickleError("bad escape in UNICODE literal", w._op_offset) from None


def _binstring(fmt: str) -> Callable[[Walker], None]:
    size = struct.calcsize(fmt)

    def handler(w: Walker) -> None:
        (n,) = struct.unpack(fmt, w.src.read(size))
        v = w._payload(n, text=False)
        # Protocol 0-2 strings load as str under the default ASCII/latin-1 encodings.
        w.push(v.decode("latin-1") if isinstance(v, bytes) else v)

    return handler


def _name_lines(w: Walker, opcode: str) -> tuple[str, str]:
    """GLOBAL/INST's module and name lines. A line the end of the stream cuts is still
    imported by pickle.py (minus its last byte, as for a whole line): noted as cut_global."""
    module: str | None = None
    try:
        module = w._text()
        return module, w._text()
    except Truncated as exc:
        cut = exc.partial[:-1].decode("latin-1")
        names = (cut, "") if module is None else (module, cut)
        w.report.cut_global = GlobalRef(*names, w._op_offset, opcode)
        raise


def _global_op(w: Walker) -> None:
    module, name = _name_lines(w, "GLOBAL")
    w.push(w._global(module, name, "GLOBAL"))


def _stack_global(w: Walker) -> None:
    name_v, module_v = w.pop(), w.pop()
    module, name = const_str(module_v), const_str(name_v)
    if module is None or name is None:
        w.push(w._global(module or "?", name or "?", "STACK_GLOBAL", dynamic=True))
        return
    w.push(w._global(module, name, "STACK_GLOBAL"))


def _inst(w: Walker) -> None:
    module, name = _name_lines(w, "INST")
    cls = w._global(module, name, "INST")
    args = w.container("tuple", w.pop_mark())
    w.push(w._made("INST", cls, args))


def _obj(w: Walker) -> None:
    items = w.pop_mark()
    if not items:
        raise PickleError("OBJ without a class", w._op_offset)
    w.push(w._made("OBJ", items[0], w.container("tuple", items[1:])))


def _ext(size: int) -> Callable[[Walker], None]:
    fmt = {1: "<B", 2: "<H", 4: "<i"}[size]

    def handler(w: Walker) -> None:
        (code,) = struct.unpack(fmt, w.src.read(size))
        # Resolved through copyreg's runtime registry: the name is not in the file.
        w.push(w._global("copyreg.extension", str(code), f"EXT{size}", dynamic=True))

    return handler


def _reduce(w: Walker) -> None:
    args, func = w.pop(), w.pop()
    w.push(w._made("REDUCE", func, args))


def _newobj(w: Walker) -> None:
    args, cls = w.pop(), w.pop()
    w.push(w._made("NEWOBJ", cls, args))


def _newobj_ex(w: Walker) -> None:
    w.pop()  # kwargs
    args, cls = w.pop(), w.pop()
    w.push(w._made("NEWOBJ_EX", cls, args))


def _build(w: Walker) -> None:
    state = w.pop()
    inst = w.top()
    w.called("BUILD")  # __setstate__ or attribute writes, before any check of the object
    if type(inst) is not Value:
        if _empty_state(state):
            return  # the default __setstate__ has nothing to set: both unpicklers read on
        raise PickleError("BUILD on a constant", w._op_offset)
    if inst.ref is not None and len(w.report.global_builds) < MAX_NOTED:
        w.report.global_builds.append((w._op_offset, inst.ref))
    inst.state = state
    if type(state) is Value and state.depth >= inst.depth:
        inst.depth = w._check_depth(state.depth + 1)
    event = Build(w._op_offset, inst, state)
    w.report.builds.append(event)
    if w.on_build is not None:
        w.on_build(event, w.src)


def _empty_state(state: Item) -> bool:
    """A BUILD state that sets nothing (pickle.py skips a false one, _pickle a None one)."""
    if type(state) is not Value:
        return not state
    if state.kind == "tuple" and len(state.items) == 2 and not state.truncated:
        return all(_empty_state(part) for part in state.items)  # (state, slot state)
    return state.kind in ("tuple", "list", "dict", "set") and not state.items \
        and not state.truncated


def _persid(w: Walker) -> None:
    # Protocol 0 spells torch's id tuple as its repr: read with the inert loader's grammar.
    pid = read_text_pid(w._text().removesuffix("\n"))
    kind = (TEXT_PID_UNKNOWN if pid is None else
            "module" if isinstance(pid, TextModuleId) else "storage")
    w.report.persistent_ids.setdefault(kind, w._op_offset)
    _halt(w)
    if isinstance(pid, TextModuleId):  # torch's legacy loader returns the class it names
        w.push(w._global(pid.module, pid.name, "PERSID"))
        return
    w.push(OPAQUE)


def _halt(w: Walker) -> None:
    """A persistent id: loaders of a file's first pickle define no persistent_load."""
    if w.report.halt is None:
        w.report.halt = w._op_offset


def _binpersid(w: Walker) -> None:
    pid = w.pop()
    # Torch pickles ('storage', ...) ids; legacy whole-module files also ('module', ...).
    kind = const_str(pid.items[0]) if type(pid) is Value and pid.items else None
    w.report.persistent_ids.setdefault(kind or "?", w._op_offset)
    _halt(w)
    if kind == "module" and len(pid.items) > 1 and ref_of(pid.items[1]) is not None:
        w.push(pid.items[1])  # torch's legacy loader returns the module's class, a global
        return
    w.push(OPAQUE)


def _mark(w: Walker) -> None:
    if len(w.marks) >= w.limits.max_depth:  # each open MARK is a container being built
        raise PickleError(f"more than {w.limits.max_depth} nested MARKs", w._op_offset,
                          limit=True)
    w.marks.append(len(w.stack))


def _pop(w: Walker) -> None:
    if w.marks and len(w.stack) == w.marks[-1]:
        w.marks.pop()  # POP of a bare MARK, as CPython does
        return
    w.pop()


def _pop_mark(w: Walker) -> None:
    w.pop_mark()


def _to_seq(kind: str) -> Callable[[Walker], None]:
    return lambda w: w.push(w.container(kind, w.pop_mark()))


def _tuple_n(n: int) -> Callable[[Walker], None]:
    def handler(w: Walker) -> None:
        stack = w.stack
        if len(stack) - n < (w.marks[-1] if w.marks else 0):
            raise PickleError("stack underflow", w._op_offset)
        items = stack[-n:]
        del stack[-n:]
        stack.append(w.container("tuple", items))

    return handler


def _add_to_top(w: Walker, opcode: str, items: list[Item]) -> None:
    target = w.top()
    if type(target) is not Value:
        raise PickleError(f"{opcode} into a constant", w._op_offset)
    plain = "dict" if opcode.startswith("SETITEM") else "set" if opcode == "ADDITEMS" else "list"
    if target.kind != plain:
        w.report.odd_targets.append((w._op_offset, opcode, target))
        if target.kind not in ("list", "dict", "set", "tuple"):
            w.called(opcode)  # the object's own append/extend/__setitem__/add method
    w.extend(target, items)


def _append(w: Walker) -> None:
    item = w.pop()
    _add_to_top(w, "APPEND", [item])


def _appends(w: Walker) -> None:
    items = w.pop_mark()
    _add_to_top(w, "APPENDS", items)


def _additems(w: Walker) -> None:
    items = w.pop_mark()
    _add_to_top(w, "ADDITEMS", items)


def _setitem(w: Walker) -> None:
    value, key = w.pop(), w.pop()
    _add_to_top(w, "SETITEM", [key, value])


def _setitems(w: Walker) -> None:
    items = w.pop_mark()
    # pickle.py sets the complete pairs before it fails on the odd item.
    _add_to_top(w, "SETITEMS", items[: len(items) - len(items) % 2])
    if len(items) % 2:
        raise PickleError("SETITEMS with an odd number of items", w._op_offset)


def _memo_text(action: str) -> Callable[[Walker], None]:
    def handler(w: Walker) -> None:
        text = w._text()
        try:
            key = int(text)
        except ValueError:
            raise PickleError(f"bad memo key {text[:20]!r}", w._op_offset) from None
        w.put(key) if action == "put" else w.get(key)

    return handler


def _memo_bin(fmt: str, action: str) -> Callable[[Walker], None]:
    size = struct.calcsize(fmt)

    def handler(w: Walker) -> None:
        data = w.src.read(size)
        key = data[0] if size == 1 else struct.unpack(fmt, data)[0]
        w.put(key) if action == "put" else w.get(key)

    return handler


def _binunicode(w: Walker) -> None:
    # Every key and name in a torch pickle: the generic sized reader, unrolled.
    n = int.from_bytes(w.src.read(4), "little")
    if n > KEEP_BYTES:
        w.src.skip(n)
        w.push(OPAQUE)
        return
    try:
        w.push(w.src.read(n).decode("utf-8", "surrogatepass"))
    except UnicodeDecodeError:
        raise PickleError("invalid UTF-8 in a string", w._op_offset) from None


def _binput(w: Walker) -> None:
    # The most frequent opcode of torch pickles, kept short.
    key = w.src.read(1)[0]
    memo, stack = w.memo, w.stack
    if key not in memo and len(memo) >= w.limits.max_memo:
        raise PickleError(f"memo larger than {w.limits.max_memo} entries", w._op_offset, limit=True)
    if len(stack) <= (w.marks[-1] if w.marks else 0):
        raise PickleError("stack underflow", w._op_offset)
    memo[key] = stack[-1]


def _binget(w: Walker) -> None:
    value = w.memo.get(w.src.read(1)[0], MISSING)
    if value is MISSING:
        raise PickleError("memo key was never stored", w._op_offset)
    if w.report.watched:
        w.pushed_again(value)
    w.push(value)


def _dup(w: Walker) -> None:
    value = w.top()
    if w.report.watched:
        w.pushed_again(value)
    w.push(value)


def _frame(w: Walker) -> None:
    w.src.start_frame(struct.unpack("<Q", w.src.read(8))[0])


def _push(const: Any) -> Callable[[Walker], None]:
    return lambda w: w.push(const)


_HANDLERS: dict[str, Callable[[Walker], None]] = {
    "PROTO": _proto,
    "FRAME": _frame,
    "NONE": _push(None),
    "NEWTRUE": _push(True),
    "NEWFALSE": _push(False),
    "INT": _int_text,
    "LONG": _int_text,
    "BININT": _fixed("<i"),
    "BININT1": _fixed("<B"),
    "BININT2": _fixed("<H"),
    "LONG1": _long_n(1),
    "LONG4": _long_n(4),
    "FLOAT": _float_text,
    "BINFLOAT": _fixed(">d"),
    "STRING": _string_text,
    "BINSTRING": _binstring("<i"),
    "SHORT_BINSTRING": _binstring("<B"),
    "BINBYTES": _sized("<I", text=False),
    "SHORT_BINBYTES": _sized("<B", text=False),
    "BINBYTES8": _sized("<Q", text=False),
    "BYTEARRAY8": _sized("<Q", text=False),
    "UNICODE": _unicode_text,
    "BINUNICODE": _binunicode,
    "SHORT_BINUNICODE": _sized("<B", text=True),
    "BINUNICODE8": _sized("<Q", text=True),
    "EMPTY_LIST": lambda w: w.push(Value("list")),
    "EMPTY_DICT": lambda w: w.push(Value("dict")),
    "EMPTY_TUPLE": lambda w: w.push(Value("tuple")),
    "EMPTY_SET": lambda w: w.push(Value("set")),
    "LIST": _to_seq("list"),
    "TUPLE": _to_seq("tuple"),
    "FROZENSET": _to_seq("set"),
    "DICT": _to_seq("dict"),
    "TUPLE1": _tuple_n(1),
    "TUPLE2": _tuple_n(2),
    "TUPLE3": _tuple_n(3),
    "APPEND": _append,
    "APPENDS": _appends,
    "ADDITEMS": _additems,
    "SETITEM": _setitem,
    "SETITEMS": _setitems,
    "MARK": _mark,
    "POP": _pop,
    "POP_MARK": _pop_mark,
    "DUP": _dup,
    "PUT": _memo_text("put"),
    "BINPUT": _binput,
    "LONG_BINPUT": _memo_bin("<I", "put"),
    "MEMOIZE": lambda w: w.put(len(w.memo)),
    "GET": _memo_text("get"),
    "BINGET": _binget,
    "LONG_BINGET": _memo_bin("<I", "get"),
    "GLOBAL": _global_op,
    "STACK_GLOBAL": _stack_global,
    "INST": _inst,
    "OBJ": _obj,
    "EXT1": _ext(1),
    "EXT2": _ext(2),
    "EXT4": _ext(4),
    "REDUCE": _reduce,
    "NEWOBJ": _newobj,
    "NEWOBJ_EX": _newobj_ex,
    "BUILD": _build,
    "PERSID": _persid,
    "BINPERSID": _binpersid,
    "NEXT_BUFFER": lambda w: w.push(OPAQUE),
    "READONLY_BUFFER": lambda w: None,
}


def STOP(w: Walker) -> None:
    """Marks STOP in the table; the loop ends there."""


# Opcode byte -> handler (None: not a pickle opcode), indexed by the byte itself.
HANDLER_TABLE: list[Callable[[Walker], None] | None] = [
    STOP if code in OPS and OPS[code].name == "STOP"
    else _HANDLERS.get(OPS[code].name) if code in OPS else None
    for code in range(256)
]
