"""What a checkpoint holds, whether it is intact, and whether it is safe to load.

``inspect(path)`` lists tensors (names, shapes, dtypes, bytes), counts
elements, sums bytes per dtype, computes the content fingerprint, summarises
meta.json and checks the file (and each shard of a sharded folder) against its
record: its sidecar, else its entry in its folder's manifest, else the hub's
name for it, the order ``load`` and ``verify`` look them up in. For pickle-based
files (each pickle shard too) it first asks the scanner
(:func:`torchverity.pickles.scan_file`) for a verdict and the ``weights_only``
load plan. A file judged unsafe is read by the inert reader only (its
code-running globals stay placeholders, never resolved); a malformed one is not
opened, since no reader can account for all of it. Others are read through
PyTorch's restricted ``weights_only`` unpickler with memory-mapped storages, so
nothing from the file executes and large files are not copied into memory.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torchverity.checkpoint._fp_record import EXACT, LEGACY_EXACT
from torchverity.digest import DEFAULT_ALGO, digest_file, find_sidecar, new_hasher, read_sidecar
from torchverity.errors import TorchVerityError

SidecarStatus = Literal["ok", "mismatched", "missing"]
RecordSource = Literal["sidecar", "manifest", "hub", "torch-hub"]


@dataclass(frozen=True)
class TensorRow:
    """One tensor as inspect lists it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class SidecarCheck:
    """The file (or a sharded folder's index, or a shard) against its record; ``actual`` is
    always set."""

    status: SidecarStatus
    algo: str
    actual: str
    expected: str | None = None
    # The sidecar's path, the manifest's, or the hub blob's whose name is the digest.
    sidecar: str | None = None
    source: RecordSource = "sidecar"
    entry: str | None = None  # the manifest's entry for the file


@dataclass(frozen=True)
class _Record:
    """A file's recorded digest and where it is recorded (:class:`SidecarCheck`'s fields)."""

    source: RecordSource
    algo: str
    hexdigest: str
    where: str
    entry: str | None = None


@dataclass(frozen=True)
class InspectResult:
    """What inspect found in a file: its format, the sidecar's verdict, tensors, values,
    fingerprint and meta.json, and for a pickle-based file the scan."""

    path: str
    format: str
    size: int
    sidecar: SidecarCheck
    tensors: tuple[TensorRow, ...] = ()
    values: dict[str, str] = field(default_factory=dict)
    fingerprint: str | None = None
    meta: dict[str, Any] | None = None
    scan: Any = None  # torchverity.pickles.ScanResult for pickle-based files
    not_loaded: str | None = None  # why tensors are not listed
    shards: tuple[str, ...] = ()
    shard_scans: tuple[Any, ...] = ()  # a sharded folder's: each pickle shard's ScanResult
    shard_records: dict[str, SidecarCheck] = field(default_factory=dict)  # shards with one

    @property
    def scans(self) -> tuple[Any, ...]:
        """Every scan made: the file's, or a sharded folder's shards'."""
        return (self.scan,) if self.scan is not None else self.shard_scans

    @property
    def parameters(self) -> int:
        """Elements over all tensors (a state_dict's parameter and buffer count)."""
        return sum(_numel(t.shape) for t in self.tensors)

    @property
    def bytes_by_dtype(self) -> dict[str, int]:
        counted: Counter[str] = Counter()
        for t in self.tensors:
            counted[t.dtype] += t.nbytes
        return dict(counted.most_common())

    @property
    def fingerprint_matches_meta(self) -> bool | None:
        if self.meta is None or self.fingerprint is None:
            return None
        return bool(self.meta.get("fingerprint_root") == self.fingerprint)

    def to_dict(self) -> dict[str, Any]:
        from torchverity._jsonable import to_jsonable

        data = {k: to_jsonable(v) for k, v in vars(self).items()}
        data.update(parameters=self.parameters, bytes_by_dtype=self.bytes_by_dtype,
                    fingerprint_matches_meta=self.fingerprint_matches_meta)
        return data


# The scan's formats of a file read as one pickle stream from its first byte.
def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def inspect(path: str | os.PathLike[str]) -> InspectResult:
    """Inspect a checkpoint file, Hugging Face folder, index or ONNX model without executing
    code from it."""
    from torchverity._formats import joblib_file_error
    from torchverity.checkpoint._folders import resolve
    from torchverity.checkpoint._onnx import is_onnx
    from torchverity.checkpoint._records import meta_path_for
    from torchverity.pickles._file_format import checkpoint_format, named_format

    p = Path(path)
    target = resolve(p)
    shards: tuple[str, ...] = ()
    present: list[Path] = []
    if target.index is not None:
        from torchverity.checkpoint._index import read_index

        record, folder, fmt = target.index, target.folder, "sharded"
        shards = tuple(sorted(set(read_index(record).values())))
        present = [folder / s for s in shards if (folder / s).is_file()]
        size = sum(f.stat().st_size for f in present)
    else:
        record = target.file
        fmt = "onnx" if is_onnx(record) else checkpoint_format(record)
        size = record.stat().st_size
    recorded = _record_of(record)
    shard_recorded = {f: r for f in present if (r := _record_of(f)) is not None}
    meta = _meta_summary(meta_path_for(record)) if meta_path_for(record).exists() else None
    # Compared with meta.json, so rebuilt with the algorithm the record names.
    recorded_fp = (meta or {}).get("fingerprint_algo")
    algo = recorded_fp if recorded_fp in (EXACT, LEGACY_EXACT) else EXACT
    scan = _scan(record) if fmt in ("pt", "pt-legacy", "pickle") else None
    # An unsafe joblib file is shown with its verdict (exit 1) rather than named (exit 2).
    if scan is not None and scan.format == "joblib" and scan.verdict not in ("unsafe",
                                                                             "malformed"):
        raise joblib_file_error(record)
    fmt = named_format(fmt, scan)
    shard_scans = tuple(_scan(f) for f in present if _pickle_file(f))
    # One read of a .safetensors file gives both its digest and its fingerprint.
    hashers = {f: new_hasher(r.algo, threads=True) for f, r in shard_recorded.items()}
    if fmt == "safetensors":
        hashers[record] = new_hasher(recorded.algo if recorded else DEFAULT_ALGO, threads=True)
    streamed = (_safetensors_contents(p, algo, hashers) if fmt in ("safetensors", "sharded")
                else None)
    listed = streamed
    if listed is None and fmt in ("pt", "sharded") and _listable(scan):
        listed = _listed_contents(p, algo)
    if fmt == "onnx":
        listed = _onnx_contents(record, algo)
    if listed is not None:
        (rows, values, root), not_loaded = listed, None
    else:
        obj, plain, not_loaded = _open_onnx(record) if fmt == "onnx" else _open(p, scan)
        rows, values, root = _contents(obj, algo)
        values = values or {n: repr(v) for n, v in plain.items()}
    digests = {f: h.hexdigest() for f, h in hashers.items()} if streamed is not None else {}
    sidecar = _check_record(record, recorded, digests.get(record))
    shard_records = {f.name: _check_record(f, r, digests.get(f))
                     for f, r in shard_recorded.items()}
    return InspectResult(os.fspath(p), fmt, size, sidecar, rows, values, root, meta, scan,
                         not_loaded, shards, shard_scans, shard_records)


def _record_of(path: Path) -> _Record | None:
    """``path``'s recorded digest: its sidecar, else its entry in the manifest of its
    folder (or of the nearest folder above with one), else the hub's name for its blob;
    as ``load`` and ``verify`` look them up."""
    from torchverity.checkpoint._folders import manifest_entry

    found = find_sidecar(path)
    if found is not None:
        algo, hexdigest = read_sidecar(found)[:2]
        return _Record("sidecar", algo, hexdigest, os.fspath(found))
    listed = manifest_entry(path)
    if listed is not None:
        algo, hexdigest, manifest = listed
        entry = path.absolute().relative_to(manifest.absolute().parent).as_posix()
        return _Record("manifest", algo, hexdigest, os.fspath(manifest), entry)
    hub = _hub_record(path)
    if hub is not None:
        return _Record("hub", hub[0], hub[1], os.fspath(path.resolve()))
    from torchverity.provenance._torch_hub import torch_hub_prefix

    prefix = torch_hub_prefix(path)
    return _Record("torch-hub", "sha256", prefix, path.name) if prefix is not None else None


def _check_record(path: Path, recorded: _Record | None, actual: str | None) -> SidecarCheck:
    """``path`` against its record; ``actual`` is the file's digest when it was computed
    while reading the tensors."""
    algo = recorded.algo if recorded else DEFAULT_ALGO
    actual = actual or digest_file(path, algo).hexdigest
    if recorded is None:
        return SidecarCheck("missing", algo, actual)
    # A torch.hub name holds the digest's first hex digits only.
    same = (actual.startswith(recorded.hexdigest) if recorded.source == "torch-hub"
            else actual == recorded.hexdigest)
    status: SidecarStatus = "ok" if same else "mismatched"
    return SidecarCheck(status, algo, actual, recorded.hexdigest, recorded.where,
                        recorded.source, recorded.entry)


def _hub_record(path: Path) -> tuple[str, str] | None:
    """The Hugging Face hub cache's record of an LFS file: its blob's name, its SHA-256."""
    from torchverity.provenance._hub_paths import in_hub_layout

    if not in_hub_layout(path):  # the hub checks' imports cost more than this question
        return None
    from torchverity.provenance import hub_record

    found = hub_record(path)
    return (found[0], found[1]) if found else None


def _scan(path: Path) -> Any:
    from torchverity.pickles._scan import scan_file

    return scan_file(path)


def _pickle_file(path: Path) -> bool:
    """Whether a shard is a torch pickle (one that is something else, a Git LFS pointer or
    an HTML page, is reported when its tensors are read)."""
    from torchverity.pickles._file_format import checkpoint_format

    try:
        return checkpoint_format(path) in ("pt", "pt-legacy", "pickle")
    except TorchVerityError:
        return False


def _listable(scan: Any) -> bool:
    """Whether the torch-free listing may hold the file's tensors: it reads plain data only,
    so a file the scan finds unsafe or malformed is not worth its try."""
    return scan is None or scan.verdict not in ("unsafe", "malformed")


def _open(path: Path, scan: Any) -> tuple[Any, dict[str, Any], str | None]:
    """The object to list, the plain values beside its tensors where it is read inertly,
    and why it was not opened."""
    from torchverity.checkpoint._read import read_unverified

    if scan is not None and scan.verdict == "malformed":
        return None, {}, f"not opened: the scan found it malformed ({scan.reason})"
    try:
        if scan is not None:
            # weights_only refuses its classes, or would meet a code-running global: read
            # inertly, values too (nothing from the file runs, its globals stay placeholders)
            from torchverity.pickles._extract import refused_contents

            found = refused_contents(path, scan)
            if found is not None:
                return (*found, None)
        return read_unverified(path), {}, None
    except TorchVerityError as exc:
        return None, {}, f"cannot list tensors: {exc.message}"


def _open_onnx(path: Path) -> tuple[Any, dict[str, Any], str | None]:
    from torchverity.checkpoint._onnx import ExternalDataError, onnx_initializers

    try:
        return onnx_initializers(path), {}, None
    except ExternalDataError:
        raise  # its step names the data file; restoring the .onnx would not help
    except TorchVerityError as exc:
        return None, {}, f"cannot list initializers: {exc.message}"


def _safetensors_contents(path: Path, algo: str, wholes: dict[Path, Any],
                          ) -> tuple[tuple[TensorRow, ...], dict[str, str], str | None] | None:
    """Rows and fingerprint from .safetensors headers and streamed bytes, without torch;
    each file's hasher in ``wholes`` is fed its bytes on the way.

    None when some file is not .safetensors (then tensors are opened the usual way).
    """
    from torchverity.checkpoint._fp_record import from_entries
    from torchverity.checkpoint._st_fingerprint import fingerprint_safetensors, safetensors_files
    from torchverity.checkpoint._st_header import parse_header

    try:
        files = safetensors_files(path)
        if files is None:
            return None
        headers = [(f, parse_header(f)) for f in files]
        rows = [TensorRow(e.name, e.dtype_name, e.shape, e.nbytes)
                for _, h in headers for e in h.entries]
        entries = [e for f, h in headers
                   for e in fingerprint_safetensors(f, algo, header=h,
                                                    whole=wholes.get(f)).entries]
    except TorchVerityError:
        return None  # reported by the usual path, with its own wording
    rows.sort(key=lambda r: r.name)
    return tuple(rows), {}, from_entries(algo, entries).root


def _onnx_contents(path: Path, algo: str,
                   ) -> tuple[tuple[TensorRow, ...], dict[str, str], str | None] | None:
    """Rows and fingerprint of an ONNX file's initializers, without torch; None when it
    cannot be read that way (then it is opened, and a damaged file reported, as before)."""
    from torchverity.checkpoint._onnx import ExternalDataError, onnx_contents

    try:
        found = onnx_contents(path, algo)
    except ExternalDataError:
        raise  # its step names the data file; restoring the .onnx would not help
    except TorchVerityError:
        return None
    if found is None:
        return None
    rows, fp = found
    return tuple(sorted((TensorRow(*r) for r in rows), key=lambda r: r.name)), {}, fp.root


def _listed_contents(path: Path, algo: str,
                     ) -> tuple[tuple[TensorRow, ...], dict[str, str], str | None] | None:
    """Rows, values and fingerprint of torch zip files (and .safetensors shards) listed
    without torch; None when some file cannot be listed that way (then it is opened)."""
    from torchverity.checkpoint._diff_listing import Listed, fingerprint_of, listing
    from torchverity.pickles._torch_names import ITEMSIZE

    found = listing(path, algo, canonical=True)
    if found is None:
        return None
    rows = sorted((TensorRow(n, v.dtype, v.shape, _numel(v.shape) * ITEMSIZE[v.dtype])
                   for n, v in found.items() if isinstance(v, Listed)), key=lambda r: r.name)
    values = {n: repr(v) for n, v in found.items() if not isinstance(v, Listed)}
    return tuple(rows), values, fingerprint_of(found, algo).root


def _contents(obj: Any, algo: str) -> tuple[tuple[TensorRow, ...], dict[str, str], str | None]:
    import torch

    from torchverity._tensors import dtype_name, iter_leaves
    from torchverity.checkpoint._fingerprint import fingerprint

    if obj is None:
        return (), {}, None
    rows, values = [], {}
    for name, value in iter_leaves(obj):
        if isinstance(value, torch.Tensor):
            rows.append(TensorRow(name, dtype_name(value.dtype), tuple(value.shape),
                                  value.numel() * value.element_size()))
        else:
            values[name] = repr(value)
    rows.sort(key=lambda r: r.name)
    return tuple(rows), values, fingerprint(obj, mode=algo).root


def _meta_summary(meta_file: Path) -> dict[str, Any]:
    from torchverity.checkpoint._meta import read_meta

    try:
        meta = read_meta(meta_file)
    except TorchVerityError as exc:
        return {"error": exc.message}
    env = meta.get("environment") or {}
    return {
        "created": meta.get("created"),
        "torch": env.get("torch"),
        "torchverity": env.get("torchverity"),
        "git_commit": env.get("git_commit"),
        "seed": meta.get("seed"),
        "data": meta.get("data"),
        "user": meta.get("user"),
        "digest": (meta.get("digest") or {}).get("hex"),
        "fingerprint_root": (meta.get("fingerprint") or {}).get("root"),
        "fingerprint_algo": (meta.get("fingerprint") or {}).get("algo"),
        "certification": meta.get("certification"),
    }
