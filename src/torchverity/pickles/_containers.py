"""Find every pickle stream in a file, the way each loader that may open it reads it.

A file is read as every loader reads it, not by one guess from its magic bytes:

- ``torch.load``: zip (entry names matched case-insensitively, the archive
  prefix taken from the first entry, TorchScript recognised by
  ``constants.pkl``), else the pre-1.0 tar format (``storages``, ``tensors``
  and ``pickle`` members unpickled, raw storages skipped by size), else the
  legacy magic-number format or a plain pickle;
- Python's ``zipfile`` and numpy: ``.npz`` members by their NUMPY magic, the
  directory found from the end record; ``.npy`` object dtypes by numpy's parser;
- joblib: compressed by magic, inline array bytes skipped by item size;
- ``pickle.load`` on the raw bytes, also when the file is safetensors or tar
  or spells a compression magic (those readings are *alternates*: their parse
  errors are expected and ignored, what they would resolve still counts).

A file that every unpickler gives up on before it calls anything (text whose first
byte happens to be an opcode, such as ``cfg:`` or ``import``) holds no pickle at all
(:func:`_runs_nothing`).

Each stream is walked by :mod:`torchverity.pickles._ops`; container anomalies
are reported as ``problems``. Tensor data is never read.
"""

from __future__ import annotations

import io
import struct
import tarfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import BinaryIO

from torchverity._formats import open_regular
from torchverity.pickles import _sniff
from torchverity.pickles._imports import import_effect, lookup
from torchverity.pickles._numpy_fmt import (
    JOBLIB_WRAPPERS,
    NPY_MAGIC,
    joblib_array,
    npy_header,
    wrapper_class,
)
from torchverity.pickles._ops import (
    Build,
    ByteSource,
    GlobalRef,
    Item,
    Limits,
    PickleError,
    StreamReport,
    Value,
    first_arg,
    ref_of,
    walk_stream,
)
from torchverity.pickles._zip import (
    Inflating,
    ZipMember,
    ZipView,
    check_member,
    data_start,
    head_of,
    member_reader,
    region,
    stacked_archives,
    zip_views,
)

TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_TORCH_KNOWN_RECORDS = ("byteorder", "version", ".data/version", ".data/serialization_id")


@dataclass
class Entry:
    """One pickle-bearing part of a file (a zip entry, a tar member, or the file itself)."""

    name: str
    streams: list[StreamReport] = field(default_factory=list)
    base: int | None = None  # where the entry's bytes start in the file (None: compressed)
    alternate: bool = False  # a reading some loader may do; its parse errors are expected


@dataclass
class Nested:
    """A call of a nested loader (``torch.storage._load_from_bytes``) and what it loads."""

    entry: str
    ref: GlobalRef
    offset: int
    via: str
    container: Container | None  # None: the bytes are not in the file, or cannot be scanned


@dataclass
class Container:
    """What the file is and where its pickles are."""

    format: str
    entries: list[Entry] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    torch_entry: str | None = None  # the entry torch.load unpickles (zip checkpoints)
    nested: list[Nested] = field(default_factory=list)
    # Nested loaders pushed without being called on bytes of the file: (entry, ref, uses).
    escaped: list[tuple[str, GlobalRef, int]] = field(default_factory=list)
    code_files: int = 0  # TorchScript source files in the archive
    bounds: list[str] = field(default_factory=list)  # problems that are bounds of the scan
    # The file is read by no loader but as a pickle stream from its first byte, and every
    # unpickler gives up on that stream before it calls anything (_runs_nothing).
    runs_nothing: bool = False


# ------------------------------------------------------------------ walking


BuildHook = Callable[[Build, ByteSource], None]


def _walk_all(src: ByteSource, limits: Limits, entry: Entry, hook: BuildHook | None) -> None:
    """Walk every stream until the source ends: appended pickles are found too."""
    while True:
        report = walk_stream(src, limits, hook)
        entry.streams.append(report)
        if report.error is not None or src.at_end():
            return


def _joblib_hook(limits: Limits, entry: Entry) -> BuildHook:
    """joblib reads array bytes right after a NumpyArrayWrapper's BUILD: skip or walk them."""

    def hook(build: Build, src: ByteSource) -> None:
        if build.inst.kind != "made" or wrapper_class(build.inst) not in JOBLIB_WRAPPERS:
            return
        if joblib_array(build, src) == "object":
            nested = walk_stream(src, limits)  # a fresh plain unpickler, as joblib uses
            entry.streams.append(nested)
            if nested.error:
                raise PickleError(f"object array pickle: {nested.error}", src.offset,
                                  limit=nested.error_limit)

    return hook


def _is_joblib(entry: Entry) -> bool:
    return any(g.qualname in JOBLIB_WRAPPERS for s in entry.streams for g in s.globals)


# ---------------------------------------------------------------------- zip


def _base_name(name: str) -> str:
    return name.split("/", 1)[1].lower() if "/" in name else name.lower()


def _is_storage(name: str) -> bool:
    parts = name.split("/")
    return len(parts) >= 3 and parts[-2].lower() == "data" and not name.lower().endswith(".pkl")


def _walk_member(
    fh: BinaryIO, member: ZipMember, limits: Limits, container: Container, label: str
) -> None:
    entry = Entry(label)
    if member.method == 0:
        entry.base = data_start(fh, member, [])
    container.entries.append(entry)
    reader = member_reader(fh, member, container.problems, limits)
    _walk_all(ByteSource(reader), limits, entry, _joblib_hook(limits, entry))
    if entry.streams[-1].error is None:
        reader.drain()
        if reader.crc != member.crc:
            container.problems.append(
                f"{member.name}: CRC-32 mismatch (recorded {member.crc:08x}, data "
                f"{reader.crc:08x}): the pickle was changed after the archive was written"
            )
    if len(entry.streams) > 1:
        container.problems.append(
            f"{member.name}: {len(entry.streams)} pickle streams in one entry "
            "(data appended after the first STOP)"
        )


def _walk_npy_member(
    fh: BinaryIO, member: ZipMember, limits: Limits, container: Container, label: str
) -> None:
    reader = member_reader(fh, member, container.problems, limits)
    _scan_npy_stream(ByteSource(reader), limits, Entry(label), container)


def _torch_entry(members: tuple[ZipMember, ...], container: Container) -> None:
    """The record torch unpickles: ``<prefix>/data.pkl``, matched case-insensitively."""
    prefix = members[0].name.split("/")[0]
    wanted = f"{prefix}/data.pkl".lower()
    hits = [m.name for m in members if m.name.lower() == wanted]
    container.torch_entry = hits[0] if hits else f"{prefix}/data.pkl"
    if len(hits) > 1:
        container.problems.append(
            f"{len(hits)} entries match {wanted!r} case-insensitively ({', '.join(hits)}): "
            "which one torch unpickles depends on its reader"
        )
    if any(m.name == f"{prefix}/constants.pkl" for m in members):
        container.format = "torchscript"
        container.code_files = sum(
            1 for m in members if _base_name(m.name).startswith("code/")
            and m.name.endswith(".py")
        )


def _scan_view(
    fh: BinaryIO, members: tuple[ZipMember, ...], limits: Limits, container: Container, tag: str
) -> None:
    lowered = [m.name.lower() for m in members]
    if len(set(lowered)) != len(lowered):
        container.problems.append(
            "duplicate entry names in the zip central directory (torch matches names "
            "case-insensitively)"
        )
    for member in members:
        if not check_member(member, container.problems):
            continue
        label = tag + member.name
        head = head_of(fh, member, limits)
        if head.startswith(NPY_MAGIC):  # numpy loads it as an array whatever its name
            _walk_npy_member(fh, member, limits, container, label)
        elif member.name.lower() == (container.torch_entry or "").lower() or (
            member.name.lower().endswith(".pkl")
            or (not _is_storage(member.name) and head[:1] == b"\x80" and head[1:2] <= b"\x05")
        ):
            _walk_member(fh, member, limits, container, label)


def _torch_save_records(names: list[str]) -> bool:
    """Entries in one folder, with the records torch.save writes besides the pickle."""
    folders = {n.split("/", 1)[0] for n in names}
    return (len(folders) == 1 and all("/" in n for n in names)
            and any(_base_name(n) in _TORCH_KNOWN_RECORDS for n in names))


def scan_zip(fh: BinaryIO, size: int, limits: Limits) -> Container:
    stack = stacked_archives(fh, size)
    if stack is not None and all(_torch_save_records([m.name.lower() for m in v.members])
                                 for v in stack):
        return _scan_stack(fh, size, stack, limits)
    problems: list[str] = []
    views = zip_views(fh, size, problems)
    if not views:
        raise PickleError(problems[-1] if problems else "zip archive cannot be read", 0)
    first = views[0].members
    names = [m.name.lower() for m in first]
    pickled = any(n.endswith("/data.pkl") for n in names)
    is_torch = pickled or _torch_save_records(names)
    if first and all(n.endswith(".npy") for n in names):
        fmt = "npz"
    else:
        fmt = "torch-zip" if is_torch else "zip"
    container = Container(fmt, problems=problems)
    if first and is_torch:
        _torch_entry(first, container)
        if not pickled:
            container.problems.append(
                f"no {container.torch_entry!r}, only torch.save's version/byteorder records: "
                "a torch.save that failed while pickling leaves such a file (data.pkl is "
                "written once the whole object is pickled), and torch.load fails on it "
                "('failed locating file data.pkl'); save the checkpoint again")
        elif container.torch_entry and container.torch_entry.lower() not in names:
            container.problems.append(f"torch reads {container.torch_entry!r} (prefix of the "
                                      "first entry) and it is absent")
    for view in views:
        _scan_view(fh, view.members, limits, container,
                   "zipfile:" if view.reader == "zipfile" else "")
    return container


def _scan_stack(fh: BinaryIO, size: int, views: list[ZipView], limits: Limits) -> Container:
    """torch.save archives one after another (a distributed checkpoint's data file): its
    reader torch.loads each from its own offset, so each archive's pickle is walked; and
    the whole file as torch.load and zipfile would read it, where they can."""
    container = Container("torch-zip-stack")
    for view in views:
        _scan_view(fh, view.members, limits, container, f"{view.reader}: ")
    # The whole file's readings disagree by construction (each archive counts its offsets
    # from its own start): what they can read is walked, and their disagreement is the
    # stack itself, not a problem of it.
    try:
        whole = zip_views(fh, size, [])
    except (PickleError, struct.error, OverflowError, EOFError):
        whole = []  # they fail before reading any member: nothing of theirs runs
    for view in whole:
        _scan_view(fh, view.members, limits, container, f"whole file ({view.reader}): ")
    return container


# ---------------------------------------------------------------------- npy


def _scan_npy_stream(src: ByteSource, limits: Limits, entry: Entry, container: Container) -> None:
    dtype = npy_header(src, limits, entry.name)
    if dtype.hasobject:  # object fields are stored as one pickle; numpy reads no further
        container.entries.append(entry)
        entry.streams.append(walk_stream(src, limits))


# ------------------------------------------------------------------- pickles


def _scan_pickle(container: Container, src: ByteSource, limits: Limits, entry: Entry,
                 *, joblib: bool = True) -> None:
    """Torch's legacy loader and pickle.load: the first stream, then what follows it."""
    container.entries.append(entry)
    hook = _joblib_hook(limits, entry) if joblib else None
    first = walk_stream(src, limits, hook)
    entry.streams.append(first)
    if first.error is None and first.result == TORCH_LEGACY_MAGIC and not entry.alternate:
        container.format = "torch-legacy"
        container.torch_entry = entry.name
        # protocol version, sys info, the object, the storage keys; raw storages follow.
        for _ in range(4):
            report = walk_stream(src, limits)
            entry.streams.append(report)
            if report.error is not None:
                break
        return
    if first.error is None and not src.at_end():
        _walk_all(src, limits, entry, hook)
        if not entry.alternate:
            container.problems.append(f"{len(entry.streams)} pickle streams in one file "
                                      "(data appended after the first STOP)")
    if _is_joblib(entry) and not entry.alternate:
        container.format = "joblib" if container.format == "pickle" else container.format


# Element sizes of the storage classes the pre-1.0 tar format names.
_STORAGE_SIZES = {
    **dict.fromkeys(("Byte", "Char", "Bool", "QUInt8", "QInt8", "QUInt4x2", "QUInt2x4"), 1),
    **dict.fromkeys(("Short", "Half", "BFloat16"), 2),
    **dict.fromkeys(("Int", "Float", "QInt32"), 4),
    **dict.fromkeys(("Long", "Double", "ComplexFloat"), 8),
    "ComplexDouble": 16,
}


def _parsed(report: StreamReport, what: str) -> None:
    if report.error is not None:
        raise PickleError(f"{what}: {report.error}", report.error_offset or 0,
                          limit=report.error_limit)


def _count(report: StreamReport, what: str) -> int:
    _parsed(report, what)
    n = report.result
    if not isinstance(n, int) or not 0 <= n <= 10_000_000:
        raise PickleError(f"{what}: the record count is not a plain number", 0, limit=True)
    return n


def _tar_storage_size(report: StreamReport) -> int:
    args = report.result
    items = args.items if type(args) is Value and args.kind == "tuple" else []
    ref = ref_of(items[2]) if len(items) == 3 else None
    kind = ref.name.removesuffix("Storage") if ref is not None and ref.module == "torch" else ""
    if kind not in _STORAGE_SIZES:
        raise PickleError("tar 'storages' record names no known storage type", 0, limit=True)
    return _STORAGE_SIZES[kind]


def _tar_records(src: ByteSource, limits: Limits, entry: Entry, kind: str) -> None:
    """The 'storages' / 'tensors' members: pickled headers with raw bytes between them."""
    count = walk_stream(src, limits)
    entry.streams.append(count)
    for _ in range(_count(count, f"tar member {kind!r}")):
        header = walk_stream(src, limits)
        entry.streams.append(header)
        _parsed(header, f"tar member {kind!r}")
        if kind == "storages":
            elsize = _tar_storage_size(header)
            (numel,) = struct.unpack("<q", src.read(8))
            src.skip(max(numel, 0) * elsize)
        else:
            (ndim,) = struct.unpack("<i", src.read(4))
            src.skip(4 + 16 * max(ndim, 0) + 8)
    if kind == "storages":
        entry.streams.append(walk_stream(src, limits))  # the storage views


def _scan_tar(
    fh: BinaryIO, members: dict[str, tarfile.TarInfo], limits: Limits, container: Container
) -> None:
    """torch's pre-1.0 tar checkpoint: storages, tensors, then the pickle, in that order."""
    container.format = "torch-tar"
    for name in ("storages", "tensors", "pickle"):
        info = members.get(name)
        if info is None or not info.isreg():
            container.problems.append(f"tar checkpoint: member {name!r} is missing or not a "
                                      "regular file (torch reads it)")
            return
        entry = Entry(f"tar:{name}", base=info.offset_data)
        container.entries.append(entry)
        src = ByteSource(region(fh, info.offset_data, info.size), info.size)
        try:
            if name == "pickle":
                entry.streams.append(walk_stream(src, limits))
                container.torch_entry = entry.name
            else:
                _tar_records(src, limits, entry, name)
        except PickleError as exc:
            container.problems.append(f"tar member {name!r}: {exc}")
            return


# ------------------------------------------------------------------ dispatch


@contextmanager
def _opened(path: str) -> Iterator[tuple[BinaryIO, int]]:
    with open_regular(path) as fh:  # a pipe is refused (InputError), never waited on
        fh.seek(0, io.SEEK_END)
        size = fh.tell()
        fh.seek(0)
        yield fh, size


def scan_container(path: str, limits: Limits) -> Container:
    """Identify the file's format by its bytes (never its name) and walk every pickle in it."""
    with _opened(path) as (fh, size):
        try:
            return scan_fh(fh, size, limits, path, 0)
        except (struct.error, OverflowError, EOFError) as exc:  # a field beyond what it names
            raise PickleError(f"container field out of range: {exc}", 0) from None


def _text_format(head: bytes) -> str | None:
    if _sniff.lfs_pointer(head):
        return "git-lfs-pointer"
    if _sniff.html_page(head):
        return "html"
    if _sniff.onnx_model(head):
        return "onnx"
    return None


def _raw_reading(fh: BinaryIO, size: int, limits: Limits, container: Container,
                 name: str, alternate: bool) -> Entry:
    fh.seek(0)
    entry = Entry(name if not alternate else f"{name} (read as a pickle)", base=0,
                  alternate=alternate)
    _scan_pickle(container, ByteSource(fh, size), limits, entry)
    if _is_joblib(entry):
        # pickle.load on a joblib file runs its inline array bytes as opcodes.
        fh.seek(0)
        plain = Entry(f"{name} (read by pickle.load)", base=0, alternate=True)
        _scan_pickle(container, ByteSource(fh, size), limits, plain, joblib=False)
    return entry


def _compressed_reading(fh: BinaryIO, limits: Limits, container: Container, name: str,
                        packed: tuple[str, object], *, alternate: bool = False) -> Entry:
    kind, dec = packed
    fh.seek(0)
    raw = io.BufferedReader(Inflating(fh, dec, limits.max_inflate))
    entry = Entry(f"{name} ({kind}-decompressed)", alternate=alternate)
    _scan_pickle(container, ByteSource(raw), limits, entry)
    if alternate:
        return entry
    if _is_joblib(entry):
        container.format = f"joblib+{kind}"
    elif entry.streams[-1].error is None:
        container.format = f"pickle+{kind}"
    return entry


def _readings(fh: BinaryIO, size: int, head: bytes, limits: Limits, name: str) -> Container:
    """Every reading of a file that is not a zip or .npy (several may apply at once)."""
    fmt = _text_format(head)
    if fmt is not None:
        container = Container(fmt)
        _raw_reading(fh, size, limits, container, name, alternate=True)
        return container
    for magic, what in _sniff.UNSUPPORTED_COMPRESSED.items():
        if head.startswith(magic):  # joblib would decompress and unpickle it
            return Container("pickle", problems=[f"{what}: the scan cannot decompress it, so "
                                                 "what joblib would unpickle is unknown"])
    header = _sniff.safetensors_header(head, size)
    tar = _sniff.tar_members(fh) if header is None else None
    packed = _sniff.compressed(head)
    primary = header is None and tar is None and packed is None
    container = Container("safetensors" if header is not None else "pickle")
    decompressed = None
    if header is not None:
        _check_safetensors(fh, header, size, limits, container)
    elif tar is not None:
        _scan_tar(fh, tar, limits, container)
    elif packed is not None:
        decompressed = _compressed_reading(fh, limits, container, name, packed)
    if packed is not None and decompressed is None:  # joblib would still try to decompress
        _compressed_reading(fh, limits, container, name, packed, alternate=True)
    raw = _raw_reading(fh, size, limits, container, name, alternate=not primary)
    if decompressed is not None:
        _settle_compressed(container, decompressed, raw)
        # Text that starts like a compression magic ("x" is zlib's to joblib): every
        # reading fails before it runs anything.
        if _sniff.text_file(head) and all(_runs_nothing(e.streams[0])
                                          for e in (decompressed, raw)):
            _no_pickle(container, "text")
    elif primary:
        _not_a_pickle(container, raw, head, size)
    return container


def _runs_nothing(report: StreamReport) -> bool:
    """Whether every unpickler of a file's first pickle stops inside this stream before it
    calls anything, having imported only modules not known to act when imported.

    It stops at the first global no installed module provides (find_class fails after its
    imports), at a persistent id, or where the walk fails as the unpicklers do (not at a
    bound of ours, where a loader may read on)."""
    if report.halt is None and (report.error is None or report.error_limit):
        return False
    if report.first_call is not None:
        return False
    stop = report.halt if report.halt is not None else report.error_offset or 0
    refs = [g for g in report.globals if g.offset <= stop]
    if report.halt is None and report.cut_global is not None:
        refs.append(report.cut_global)
    return not any(ref.dynamic or import_effect(lookup(ref, report.protocol).modules)
                   for ref in refs)


def _no_pickle(container: Container, fmt: str) -> None:
    """The file is no pickle to any loader: its readings are no pickle streams either."""
    container.format = fmt
    container.entries.clear()
    container.problems.clear()


def no_pickle(container: Container, fmt: str) -> None:
    """Name a file :attr:`Container.runs_nothing` by what it is, known from beside it (an
    ONNX model's external data)."""
    if not container.runs_nothing:
        raise ValueError("only a file no unpickler runs anything in is no pickle")
    _no_pickle(container, fmt)


def _not_a_pickle(container: Container, entry: Entry, head: bytes, size: int) -> None:
    """A file every unpickler gives up on before it runs anything is not a pickle at all."""
    first = entry.streams[0]
    if not _runs_nothing(first):
        return
    container.runs_nothing = True
    broken = _sniff.broken_safetensors(head, size)
    known = _sniff.no_pickle_format(head)
    if size == 0:
        _no_pickle(container, "empty")
    elif broken is not None:
        _no_pickle(container, "safetensors")
        container.problems.append(broken)
    elif _sniff.text_file(head):
        _no_pickle(container, "text")
    elif known is not None:
        # An HDF5, msgpack or sentencepiece file by its own structure. The walk above, not
        # the name, is what clears it: every unpickler (CPython's, pickle.py's that joblib
        # uses, torch's weights_only one) dispatches on each opcode byte and raises at the
        # first it does not know or cannot apply (HDF5's 0x89 'H', a sentencepiece model's
        # 0x0a, msgpack's 0x81 NEWOBJ on an empty stack), before any call. The name only
        # says it is a file of its own format, not a weights download gone wrong. A zip,
        # a tar or a compressed stream, which loaders read further, never reaches here.
        _no_pickle(container, known)
    elif first.ops <= 2 and first.error is not None:
        _no_pickle(container, "data")
        container.problems.append(f"not a pickle: {first.error} at offset {first.error_offset}")


def _settle_compressed(container: Container, decompressed: Entry, raw: Entry) -> None:
    """Compressed magic: the decompressed and the raw reading are both real; one must parse."""
    if decompressed.streams[-1].error is None:
        raw.alternate = True
        return
    if raw.streams[-1].error is None:
        decompressed.alternate = True
        container.format = "joblib" if _is_joblib(raw) else "pickle"
        return
    raw.alternate = True  # both failed: the decompressed reading's error is the verdict


def _check_safetensors(fh: BinaryIO, length: int, size: int, limits: Limits,
                       container: Container) -> None:
    if length > limits.max_header:
        problem = (f"safetensors header of {length} bytes is over the {limits.max_header}-byte "
                   "bound: refused before any reader parses it")
        container.problems.append(problem)
        container.bounds.append(problem)
        return
    import json

    fh.seek(8)
    try:
        header = json.loads(fh.read(length))
    except RecursionError:
        problem = "safetensors header nests too deep for any JSON reader"
        container.problems.append(problem)
        container.bounds.append(problem)
        return
    except ValueError:
        container.problems.append("safetensors header is not valid JSON")
        return
    if not isinstance(header, dict):
        container.problems.append("safetensors header is not a JSON object")
        return
    # A copy or download cut inside the tensor data keeps a whole header: the file is not
    # what was written (safetensors' own loader refuses it), whatever it holds.
    spans = [e.get("data_offsets") for k, e in header.items()
             if k != "__metadata__" and isinstance(e, dict)]
    need = max((s[1] for s in spans if isinstance(s, list) and len(s) == 2
                and type(s[1]) is int), default=0)
    have = size - 8 - length
    if need > have:
        container.problems.append(
            f"safetensors data cut short: the header names {need} bytes of tensor data and "
            f"the file holds {have} after it (a partial copy or download)")


def scan_fh(fh: BinaryIO, size: int, limits: Limits, name: str, depth: int) -> Container:
    head = fh.read(_sniff.HEAD_BYTES)
    fh.seek(0)
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        container = scan_zip(fh, size, limits)
    elif head.startswith(NPY_MAGIC):
        container = Container("npy")
        _scan_npy_stream(ByteSource(fh, size), limits, Entry(name), container)
    elif head.startswith(b"7z\xbc\xaf\x27\x1c"):
        raise PickleError("7z archive: unpack it and scan the files inside", 0)
    else:
        container = _readings(fh, size, head, limits, name)
    _scan_nested(fh, container, limits, depth)
    return container


# ------------------------------------------------------------------ nested


_NESTED_LOADER = "torch.storage._load_from_bytes"
MAX_NESTING = 3


def _scan_nested(fh: BinaryIO, container: Container, limits: Limits, depth: int) -> None:
    """Every call of a nested loader gets its own bytes scanned; escapes are recorded."""
    for entry in container.entries:
        for report in entry.streams:
            called: dict[int, int] = {}
            for offset, via, made in report.calls:
                ref = ref_of(made.callee)
                if ref is None or ref.qualname != _NESTED_LOADER:
                    continue
                called[id(made.callee)] = called.get(id(made.callee), 0) + 1
                inner = _open_nested(fh, entry, via, first_arg(made), limits, depth)
                container.nested.append(Nested(entry.name, ref, offset, via, inner))
            for key, (value, pushes) in report.watched.items():
                extra = pushes - called.get(key, 0)
                if extra > 0 and value.ref is not None and value.ref.qualname == _NESTED_LOADER:
                    container.escaped.append((entry.name, value.ref, extra))


def _open_nested(
    fh: BinaryIO, entry: Entry, via: str, arg: Item, limits: Limits, depth: int
) -> Container | None:
    if depth >= MAX_NESTING or via not in ("REDUCE", "OBJ", "INST"):
        return None
    if isinstance(arg, bytes):
        data: BinaryIO = io.BytesIO(arg)
        size = len(arg)
    elif type(arg) is Value and arg.kind == "blob" and entry.base is not None:
        start, size = arg.const
        data = region(fh, entry.base + start, size)
    else:
        return None
    try:
        return scan_fh(data, size, limits, "nested", depth + 1)
    except PickleError as exc:
        return Container("unknown", problems=[f"nested archive: {exc}"])
