"""The contents of a torch zip checkpoint listed without torch: every tensor's name, dtype,
shape and the span of its bytes in the file, and every plain value.

Only a file laid out as ``torch.save`` writes it is listed: one pickle,
``<prefix>/data.pkl``, whose symbolic walk (:mod:`torchverity.pickles._containers`)
finds no problem, only opcodes torch's weights_only unpickler implements, only
storage persistent ids, and only the globals in ``MODELED`` (each in torch's
weights_only allowlist). Such a file is exactly what ``torch.load(weights_only=True)``
reads, so the listing equals what the loaded object flattens to. The pickle is then
read by an :class:`~torchverity.pickles._placeholders.InertUnpickler` whose table
holds torch-free stand-ins: nothing from the file is imported or run, and any name
outside the table makes the listing give up (``None``), leaving the file to the
loader. Storage records must be stored (not deflated): their bytes are then read in
place, straight from the file.
"""

from __future__ import annotations

import io
import math
import os
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from torchverity._leaves import iter_tree, weights_in
from torchverity.pickles._placeholders import InertUnpickler
from torchverity.pickles._source import Limits
from torchverity.pickles._torch_names import CALLABLES, ITEMSIZE, MODELED, STORAGES

_DEVICES = frozenset({"cpu", "cuda", "mps", "xpu", "meta", "hpu"})


class _Refused(Exception):
    """The pickle holds something the listing does not model: the loader reads it."""


class _NoState:
    """BUILD on a stand-in is refused (torch's loader would set a real tensor's state)."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise _Refused


@dataclass(frozen=True, slots=True)
class _Dtype(_NoState):
    """A dtype leaf of an inert listing."""

    name: str

    def __str__(self) -> str:  # a dtype leaf reads as str(torch.<name>)
        return f"torch.{self.name}"


@dataclass(frozen=True, slots=True)
class _Storage(_NoState):
    """A storage the pickle names, and where its record's bytes are."""

    dtype: str | None  # None: untyped (its tensor names the dtype)
    start: int  # where its record's bytes begin in the file
    nbytes: int


@dataclass(frozen=True, slots=True)
class ListedTensor(_NoState):
    """One tensor: ``begin``/``nbytes`` locate the bytes its elements span in the file
    (``strides`` in elements; ``contiguous`` when those bytes are the tensor's, in order)."""

    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    begin: int
    nbytes: int

    @property
    def contiguous(self) -> bool:
        return self.nbytes == math.prod(self.shape) * ITEMSIZE[self.dtype] and \
            self.strides == _row_major(self.shape)


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _ints(value: Any) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(type(v) is int and v >= 0 for v in value):
        raise _Refused
    return value


def _tensor(storage: Any, offset: Any, size: Any, stride: Any, dtype: str) -> ListedTensor:
    if not isinstance(storage, _Storage) or type(offset) is not int or offset < 0:
        raise _Refused
    shape, strides = _ints(size), _ints(stride)
    if len(shape) != len(strides):
        raise _Refused
    item = ITEMSIZE[dtype]
    span = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    begin, nbytes = offset * item, span * item
    if begin + nbytes > storage.nbytes:
        raise _Refused  # torch's own check fails on it: its error is the one to show
    return ListedTensor(dtype, shape, strides, storage.start + begin, nbytes)


def _hooks_ok(hooks: Any, metadata: tuple[Any, ...]) -> bool:
    return isinstance(hooks, OrderedDict) and not hooks and all(not m for m in metadata)


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
                hooks: Any, *metadata: Any) -> ListedTensor:
    if not isinstance(storage, _Storage) or storage.dtype is None or \
            not _hooks_ok(hooks, metadata) or type(requires_grad) is not bool:
        raise _Refused
    return _tensor(storage, offset, size, stride, storage.dtype)


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
                hooks: Any, dtype: Any, *metadata: Any) -> ListedTensor:
    if not isinstance(storage, _Storage) or storage.dtype is not None or \
            not isinstance(dtype, _Dtype) or not _hooks_ok(hooks, metadata) or \
            type(requires_grad) is not bool:
        raise _Refused
    return _tensor(storage, offset, size, stride, dtype.name)


def _parameter(data: Any, requires_grad: Any, hooks: Any) -> ListedTensor:
    if not isinstance(data, ListedTensor) or not _hooks_ok(hooks, ()) or \
            type(requires_grad) is not bool:
        raise _Refused
    return data


def _size(dims: Any = ()) -> tuple[int, ...]:
    return _ints(dims)


def _device(kind: Any, index: Any = None) -> str:
    """``str(torch.device(kind, index))`` for the device types torch always knows."""
    if not isinstance(kind, str) or (index is not None and (type(index) is not int
                                                            or index < 0 or ":" in kind)):
        raise _Refused
    text = kind if index is None else f"{kind}:{index}"
    base, colon, number = text.partition(":")
    if base not in _DEVICES or (colon and not number.isdigit()):
        raise _Refused
    return text


class _StorageType(_NoState):
    __slots__ = ("dtype",)

    def __init__(self, dtype: str | None) -> None:
        self.dtype = dtype


def _stand_ins() -> dict[str, Any]:
    calls = (OrderedDict, _rebuild_v2, _rebuild_v3, _parameter, _size, _device,
             _StorageType(None))
    table: dict[str, Any] = dict(zip(CALLABLES, calls, strict=True))
    table.update({f"torch.{cls}": _StorageType(dtype) for cls, dtype in STORAGES.items()})
    table.update({f"torch.{name}": _Dtype(name) for name in ITEMSIZE})
    return table


_STAND_INS = _stand_ins()  # keyed by exactly MODELED


def list_torch_zip(path: str | os.PathLike[str], *, weights: bool = False,
                   ) -> dict[str, Any] | None:
    """``{dotted name: ListedTensor or plain value}`` of a torch zip checkpoint, read
    without torch, as the loaded object flattens (:func:`torchverity._tensors.iter_leaves`);
    ``weights``: only its state dict, as a sharded folder's loader takes it from each shard.

    None when the file is not laid out as ``torch.save`` writes a weights_only-loadable
    file, or holds something not modeled here: then the loader reads it.
    """
    from torchverity.pickles._containers import scan_container
    from torchverity.pickles._zip import inflation_problems, zip_views

    limits = Limits()
    try:
        container = scan_container(os.fspath(path), limits)
        if not _plain_torch_zip(container):
            return None
        with open(path, "rb") as fh:
            problems: list[str] = []
            size = os.fstat(fh.fileno()).st_size
            views = zip_views(fh, size, problems)
            # A record the loader's preflight refuses (a bomb) is refused here too, unread.
            if problems or len(views) != 1 or inflation_problems(views[0].members, size, limits):
                return None
            root = _read(fh, views[0].members, container.torch_entry, limits)
        return _unique(iter_listed(_weights_of(root) if weights else root))
    except Exception:  # only stand-ins ran: a pickle they cannot build, or damage
        return None


def _unique(pairs: Iterator[tuple[str, Any]]) -> dict[str, Any]:
    """The pairs as a dict; refused when two flatten to one name (the loaded object's
    fingerprint is an error then, and a diff keeps only one: the loader says which)."""
    found: dict[str, Any] = {}
    for name, value in pairs:
        if name in found:
            raise _Refused
        found[name] = value
    return found


def _plain_torch_zip(container: Any) -> bool:
    from torchverity.pickles._classes import _WEIGHTS_ONLY_OPCODES
    from torchverity.pickles._verdict import problems_of

    if container.format != "torch-zip" or container.nested or container.escaped \
            or container.bounds or problems_of(container):
        return False
    if [e.name for e in container.entries] != [container.torch_entry]:
        return False
    (entry,) = container.entries
    if len(entry.streams) != 1:
        return False
    (report,) = entry.streams
    # NEWOBJ would construct a stand-in class: torch.save writes none.
    opcodes = _WEIGHTS_ONLY_OPCODES - {"NEWOBJ"}
    return (set(report.opcodes) <= opcodes and set(report.persistent_ids) <= {"storage"}
            and all(g.qualname in MODELED and not g.dynamic for g in report.globals))


def _read(fh: BinaryIO, members: Any, entry: str | None, limits: Limits) -> Any:
    from torchverity.pickles._zip import check_member, data_start, member_reader

    lookup = {m.name.lower(): m for m in members}
    pickled = lookup.get((entry or "").lower())
    if pickled is None or not check_member(pickled, []):
        raise _Refused
    prefix = (entry or "").rpartition("/")[0]
    order = lookup.get(f"{prefix}/byteorder".lower())
    if order is not None and member_reader(fh, order, [], limits).read(16) != b"little":
        raise _Refused
    data = member_reader(fh, pickled, [], limits).read(limits.max_inflate)

    def persistent(pid: Any) -> _Storage:
        if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage" or \
                not isinstance(pid[1], _StorageType) or not isinstance(pid[2], str) or \
                type(pid[4]) is not int:
            raise _Refused
        record = lookup.get(f"{prefix}/data/{pid[2]}".lower())
        dtype = pid[1].dtype
        nbytes = pid[4] * (ITEMSIZE[dtype] if dtype is not None else 1)
        if record is None or record.method != 0 or record.usize != nbytes or \
                not check_member(record, []):
            raise _Refused
        return _Storage(dtype, data_start(fh, record, []), nbytes)

    # Any other global would become an inert placeholder: the gate let none through.
    cls: type[InertUnpickler] = type("Unpickler", (InertUnpickler,), {
        "real": _STAND_INS, "placeholders": {}})
    unpickler = cls(io.BytesIO(data))
    unpickler.persistent_load = persistent  # type: ignore[method-assign]
    root = unpickler.load()
    if cls.placeholders:
        raise _Refused
    return root


def _weights_of(obj: Any) -> Mapping[Any, Any]:
    """What :func:`torchverity.checkpoint._model_fit.state_dict_of` takes from a shard.

    Only a flat one: shards are merged before they are flattened, so a nested entry
    of one shard would replace another's whole (the loader shows that)."""
    if not isinstance(obj, Mapping):
        raise _Refused  # the loader's error names the type
    weights = weights_in(obj, lambda v: isinstance(v, ListedTensor))
    if any(isinstance(v, (Mapping, list, tuple)) for v in weights.values()):
        raise _Refused
    return weights


def iter_listed(obj: Any) -> Iterator[tuple[str, Any]]:
    """Flatten as :func:`torchverity._tensors.iter_leaves` does; raises :class:`_Refused`
    on anything it would not flatten the same way."""
    return iter_tree(obj, _leaf, key=_key)


def _leaf(obj: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, ListedTensor):
        yield prefix, obj
    elif isinstance(obj, _Dtype):
        yield prefix, str(obj)
    else:
        raise _Refused


def _key(key: Any) -> str:
    if not (key is None or isinstance(key, (bool, int, float, str))):
        raise _Refused  # str() of a tensor key shows its values
    return str(key)
