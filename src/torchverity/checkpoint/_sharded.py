"""Hugging Face style sharded checkpoints: a folder of shards and an index.

The index (``model.safetensors.index.json`` or ``pytorch_model.bin.index.json``)
maps every tensor name to its shard file. torchverity treats the index like a
checkpoint file: it gets a sidecar and a meta.json whose fingerprint covers
every tensor of every shard, and each shard is saved and verified like any
single file. Each save writes its shards under names the live index does not
use (``_generations.py``) and publishes the index last: its rename is the one
instant the folder switches from the previous checkpoint to the new one.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import torchverity.checkpoint._generations as gen
import torchverity.checkpoint._safetensors as st
from torchverity.checkpoint._atomic import _atomic_target, _write_error
from torchverity.checkpoint._fingerprint import EXACT, Fingerprint, TensorDigest, from_entries
from torchverity.checkpoint._index import INDEX_NAMES, SHARD_STEMS, find_index, read_index
from torchverity.checkpoint._load_file import (
    _check_digest,
    _check_fingerprint,
    _content_mismatch,
    _load_file,
    current_expectation,
)
from torchverity.checkpoint._meta import (
    _data_record,
    _json_ready,
    _meta_fingerprint,
    meta_path_for,
    meta_record,
    read_meta,
)
from torchverity.checkpoint._results import (
    ExpectedDigest,
    LoadReport,
    SaveReport,
    SidecarPolicy,
)
from torchverity.checkpoint._save_file import save_file
from torchverity.digest import (
    ALGORITHMS,
    DEFAULT_ALGO,
    check_algo,
    format_sidecar_line,
    new_hasher,
    sidecar_path,
)
from torchverity.errors import (
    CheckpointWriteError,
    FormatError,
    IntegrityError,
    UsageError,
    shell_path,
)

if TYPE_CHECKING:
    from torchverity.provenance import HubEntry


def save_sharded(
    obj: Mapping[str, Any],
    folder: Path,
    *,
    shard_bytes: int,
    shard_format: str = "safetensors",
    meta: Mapping[str, Any] | None = None,
    seed: int | None = None,
    data: str | os.PathLike[str] | None = None,
    algo: str = DEFAULT_ALGO,
) -> SaveReport:
    """Split a flat state_dict into shards of at most ``shard_bytes`` and write the index."""
    if shard_format not in INDEX_NAMES:
        raise UsageError(f"unknown shard format '{shard_format}'", hint="use safetensors or pt")
    if shard_bytes <= 0:
        raise UsageError("shard_bytes must be positive")
    check_algo(algo)
    user_meta = _json_ready(meta, "meta")
    tensors = st.check_writable(obj, folder)
    data_record = _data_record(data, algo) if data is not None else None
    _make_folder(folder)
    live = gen.live_index(folder)
    generation = gen.generation_of(live) + 1
    written: list[Path] = []
    try:
        previous = gen.sweep(folder, live)
        weight_map, entries = _write_shards(tensors, folder, shard_bytes, shard_format, algo,
                                            generation, written)
        index = folder / INDEX_NAMES[shard_format]
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        report = _publish_index(index, gen.index_body(total, generation, weight_map), algo,
                                from_entries(EXACT, entries), seed, data_record, user_meta)
    except (CheckpointWriteError, OSError) as exc:
        _discard(written)
        raise _folder_write_error(folder, exc, live is not None) from None
    gen.retire(folder, previous, index)
    return report


def _make_folder(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _folder_write_error(folder, exc, False) from None


def _write_shards(tensors: Mapping[str, torch.Tensor], folder: Path, shard_bytes: int,
                  shard_format: str, algo: str, generation: int, written: list[Path],
                  ) -> tuple[dict[str, str], list[TensorDigest]]:
    """Save this generation's shards under names no live index uses."""
    groups = _split(tensors, shard_bytes)
    stem, suffix = SHARD_STEMS[shard_format]
    weight_map: dict[str, str] = {}
    entries: list[TensorDigest] = []
    for i, names in enumerate(groups, 1):
        shard = folder / gen.shard_name(stem, suffix, i, len(groups), generation)
        written.append(shard)
        save_file({n: tensors[n] for n in names}, shard, user_meta=None, seed=None,
                  data=None, algo=algo)
        entries.extend(_meta_fingerprint(read_meta(shard), shard).entries)
        weight_map.update(dict.fromkeys(names, shard.name))
    return weight_map, entries


def _discard(written: list[Path]) -> None:
    """Free what a failed save wrote (no index names it): a full disk gets its space back."""
    for shard in written:
        for path in (shard, meta_path_for(shard), *(sidecar_path(shard, a) for a in ALGORITHMS)):
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)


def _folder_write_error(folder: Path, exc: Exception, existed: bool) -> CheckpointWriteError:
    reason = (exc.reason if isinstance(exc, CheckpointWriteError)
              else _write_error(folder, exc, existed).reason if isinstance(exc, OSError)
              else str(exc))
    previous = (f"the previous checkpoint in {folder} is intact and still loads" if existed
                else f"no checkpoint was created in {folder}")
    return CheckpointWriteError(
        f"cannot save the sharded checkpoint {folder}: {reason}; {previous}", path=folder,
        reason=reason, previous_intact=existed,
        hint="free space or fix the folder's permissions, then save again",
    )


def _split(tensors: Mapping[str, torch.Tensor], shard_bytes: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    used = 0
    for name in sorted(tensors):
        size = tensors[name].numel() * tensors[name].element_size()
        if groups[-1] and used + size > shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    return groups


def _publish_index(index: Path, body: bytes, algo: str, fp: Fingerprint, seed: int | None,
                   data_record: dict[str, Any] | None, user_meta: Any) -> SaveReport:
    hasher = new_hasher(algo)
    hasher.update(body)
    digest = hasher.hexdigest()
    record = meta_record(index, "sharded", algo, digest, len(body), fp, seed, data_record,
                          user_meta)
    sidecar, meta_file = sidecar_path(index, algo), meta_path_for(index)
    with _atomic_target(index) as staged:
        view = memoryview(body)
        while view:
            view = view[os.write(staged.fd, view) :]
        staged.companions[sidecar] = format_sidecar_line(digest, index.name)
        staged.companions[meta_file] = json.dumps(record, indent=2) + "\n"
    return SaveReport(os.fspath(index.parent), algo, digest, fp.root, os.fspath(sidecar),
                      os.fspath(meta_file), len(body))


def load_sharded(folder: Path, *, map_location: Any, sidecar: SidecarPolicy,
                 mmap: bool = False, recheck_tensors: bool = False, index: Path | None = None,
                 ) -> tuple[dict[str, Any], LoadReport]:
    """Verify the index, every shard, the index's tensor list and the whole fingerprint."""
    index = index or find_index(folder)
    hub = _hub_index(index) if sidecar == "require" else None
    expected, meta, _pending = current_expectation(index, "warn" if hub else sidecar)
    digest = _check_digest(index, expected, None)
    if expected is None and hub is not None:  # checked just now against its blob's name
        expected, digest = ExpectedDigest(str(hub.algo), str(hub.actual), "hub"), hub.actual
    weight_map = read_index(index)
    shards = sorted(set(weight_map.values()))
    _check_shards_exist(folder, index, weight_map, shards)
    merged: dict[str, Any] = {}
    reports = []
    for shard in shards:
        obj, report = _load_file(folder / shard, map_location, sidecar, None, mmap,
                                 recheck_tensors)
        _check_shard_names(index, shard, obj, {n for n, s in weight_map.items() if s == shard})
        merged.update(obj)
        reports.append(report)
    # Every shard checked against its own record (by its digest or by hashing it):
    # the index's record is then compared with their union, nothing is hashed again.
    fp_root, check = None, None
    if meta is not None and all(r.fingerprint_verified for r in reports):
        fp_root = _check_union(folder, index, shards, meta)
        bound = all(r.fingerprint_check == "bound" for r in reports)
        check = "bound" if bound else "rehashed"
    if fp_root is None:
        fp_root = _check_fingerprint(index, merged, meta, None)
        check = "rehashed" if fp_root is not None else None
    report = LoadReport(
        path=os.fspath(folder), format=f"sharded-{reports[0].format}",
        algo=expected.algo if expected else None, digest=digest,
        digest_source=expected.source if expected else None, fingerprint=fp_root,
        fingerprint_verified=fp_root is not None, sidecar_policy=sidecar, weights_only=True,
        tensors=len(merged), shards=tuple(shards),
        warnings=_summarise_warnings(index, reports, expected is None and sidecar == "warn"
                                     and not _hub_checked(index)),
        fingerprint_check=check,
    )
    return merged, report


def _check_union(folder: Path, index: Path, shards: list[str],
                 meta: Mapping[str, Any]) -> str | None:
    """The index's fingerprint against the union of its shards' records (no hashing).

    Each shard's verified digest vouches for its own recorded fingerprint, and
    ``save_sharded`` records the index's fingerprint as exactly that union.
    None when the records were made with different algorithms (then rehash).
    """
    recorded = _meta_fingerprint(meta, meta_path_for(index))
    parts = [_meta_fingerprint(read_meta(folder / s), meta_path_for(folder / s)) for s in shards]
    if any(part.algo != recorded.algo for part in parts):
        return None
    union = from_entries(recorded.algo, [e for part in parts for e in part.entries])
    bad = recorded.differing(union)
    if bad:
        raise _content_mismatch(index, recorded, union.tensors, bad)
    return recorded.root


def _check_shards_exist(folder: Path, index: Path, weight_map: dict[str, str],
                        shards: list[str]) -> None:
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        lost = sorted(n for n, s in weight_map.items() if s in missing)
        raise IntegrityError(
            f"{index}: names {len(missing)} shard(s) that do not exist: {', '.join(missing)} "
            f"({len(lost)} tensors lost, e.g. {', '.join(lost[:5])})",
            path=index, tensors=lost,
            hint="copy the missing shards from the source; torchverity verify checks the folder",
        )


def _check_shard_names(index: Path, shard: str, obj: Any, listed: set[str]) -> None:
    if not isinstance(obj, Mapping):
        raise FormatError(f"{shard}: shard holds a {type(obj).__name__}, not a state_dict",
                          path=index.parent / shard, hint="torchverity inspect "
                                                          f"{shell_path(index.parent)}")
    absent, extra = sorted(listed - set(obj)), sorted(set(obj) - listed)
    if absent or extra:
        raise IntegrityError(
            f"{index}: shard {shard} does not hold what the index says: "
            f"missing {absent[:5] or 'none'}, not in the index {extra[:5] or 'none'}",
            path=index, tensors=absent + extra,
            hint="the index and its shards come from different saves; restore them together",
        )


def _hub_index(index: Path) -> HubEntry | None:
    """The hub's check of an index in a hub snapshot or ``local_dir`` download, else None.

    The hub names such an index by its git SHA-1 (a small file, not in LFS), which no
    sidecar algorithm computes, so ``sidecar="require"`` takes this check as its record:
    without it a sharded download from the hub could never be loaded strictly, though
    every byte of it is vouched for. Raises :class:`IntegrityError` when the index
    differs from its name.
    """
    from torchverity.provenance import require_hub_blob

    entry = require_hub_blob(index)
    # "unchecked" passes a verify (a blob name no digest fits), but vouches for nothing.
    return entry if entry is not None and entry.status == "ok" and entry.actual else None


def _hub_checked(index: Path) -> bool:
    """An index in a hub snapshot is named by its git SHA-1, which the load checked."""
    from torchverity.provenance import hub_blob_check

    entry = hub_blob_check(index)
    return entry is not None and entry.ok


def _summarise_warnings(index: Path, reports: list[LoadReport], index_unverified: bool,
                        ) -> tuple[str, ...]:
    notes = [f"{index}: no sidecar: the index was not verified"] if index_unverified else []
    unverified = [r for r in reports if r.warnings]
    if not unverified:
        return tuple(notes)
    first = Path(unverified[0].path).name
    sources = {r.digest_source for r in unverified}
    if None in sources:
        notes.append(f"{len(unverified)} of {len(reports)} shards could not be fully verified "
                     f"(no sidecar or meta.json), e.g. {first}")
    else:  # their bytes were checked (manifest, hub names); only meta.json is absent
        notes.append(f"{len(unverified)} of {len(reports)} shards match their "
                     f"{'/'.join(sorted(str(x) for x in sources))} record, but have no meta.json:"
                     f" their content fingerprint was not checked, e.g. {first}")
    return tuple(notes)
