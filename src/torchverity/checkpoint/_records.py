"""The records that describe a checkpoint file now, read the same way by load and verify.

A save publishes three names with three renames: the checkpoint, then its
sidecar, then its meta.json (the companions wait as ``.NAME.pending`` until
their turn). A process killed between two renames leaves a complete new file
beside records of which some are still pending. :func:`resolve_records` picks,
for every instant, the records that describe the file at the path: a pending
sidecar only when the file's digest matches it, a pending meta.json only when
its digest is the one the chosen sidecar records. Torch-free: ``verify`` uses it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchverity._formats import open_regular
from torchverity.digest import ALGORITHMS, digest_file, read_sidecar, sidecar_path
from torchverity.errors import FormatError, InputError, TorchVerityError

META_FORMAT = "torchverity-checkpoint-meta"
META_VERSION = 1
META_SUFFIX = ".meta.json"


def meta_path_for(path: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(path)}{META_SUFFIX}")


def pending_name(final: Path) -> Path:
    """Where a companion waits until the checkpoint is renamed (found by load after a crash)."""
    return final.with_name(f".{final.name}.pending")


def parse_json(text: str, path: Path, what: str, hint: str) -> Any:
    """JSON text as a typed error when malformed or nested too deeply for the parser."""
    try:
        return json.loads(text)
    except RecursionError:
        raise FormatError(f"{path}: {what} is nested too deeply to be a valid record",
                          path=path, hint=hint) from None
    except ValueError as exc:
        raise FormatError(f"{path}: {what} is not valid JSON: {exc}", path=path,
                          hint=hint) from None


def read_text_record(path: Path, what: str, hint: str) -> str:
    """A record's UTF-8 text; a folder, unreadable file or non-UTF-8 bytes are typed errors."""
    try:
        with open_regular(path) as fh:  # a pipe under a record's name is refused, not read
            return fh.read().decode("utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: no such file", path=path, hint=hint) from None
    except IsADirectoryError:
        raise FormatError(f"{path}: {what} is a folder, not a file", path=path,
                          hint=hint) from None
    except UnicodeDecodeError as exc:
        raise FormatError(f"{path}: {what} is not UTF-8 text: {exc}", path=path,
                          hint=hint) from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read {what}: {exc.strerror or exc}", path=path,
                         hint=hint) from None


_META_HINT = ("restore it from the checkpoint's copy, or re-save the checkpoint with "
              "torchverity.save")


def read_meta_file(mp: Path) -> dict[str, Any]:
    """Read and check one meta.json document (docs/formats/checkpoint.md)."""
    if not mp.exists():
        raise InputError(f"{mp}: no such file", path=mp,
                         hint="torchverity.save writes it next to every checkpoint")
    data = parse_json(read_text_record(mp, "meta.json", _META_HINT), mp, "meta.json", _META_HINT)
    if not isinstance(data, dict) or data.get("format") != META_FORMAT:
        raise FormatError(f"{mp}: not a torchverity meta.json (no format '{META_FORMAT}')",
                          path=mp, hint="move the foreign file away; torchverity.save writes "
                                        "its own NAME.meta.json")
    if type(data.get("version")) is not int or data["version"] != META_VERSION:
        raise FormatError(f"{mp}: meta.json version {data.get('version')!r} is not supported",
                          path=mp, hint="upgrade torchverity")
    _check_fields(data, mp)
    return data


# Field -> (accepted types, may be null); "user" is the caller's own JSON, anything goes.
_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "file": ((str,), False), "file_format": ((str,), False), "size": ((int,), False),
    "created": ((str,), False), "environment": ((dict,), False),
    "seed": ((int,), True), "data": ((dict,), True), "fingerprint": ((dict,), False),
}
_FILE_FORMATS = ("pt", "safetensors", "sharded")


def _check_fields(data: dict[str, Any], mp: Path) -> None:
    """Every field present with its documented type (docs/formats/checkpoint.md)."""
    for key, (types, nullable) in _FIELDS.items():
        if key not in data:
            raise FormatError(f"{mp}: meta.json has no '{key}' field", path=mp, hint=_META_HINT)
        value = data[key]
        if value is None and nullable:
            continue
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise FormatError(f"{mp}: meta.json's '{key}' is {json.dumps(value)[:60]}, not "
                              f"{' or '.join(t.__name__ for t in types)}", path=mp,
                              hint=_META_HINT)
    recorded = data.get("digest")  # absent: the record is not bound to the file's bytes
    if recorded is not None and (not isinstance(recorded, dict)
                                 or recorded.get("algo") not in ALGORITHMS
                                 or not isinstance(recorded.get("hex"), str)):
        raise FormatError(f"{mp}: meta.json's 'digest' is not {{algo, hex}} of a known algorithm",
                          path=mp, hint=_META_HINT)
    if data["size"] < 0 or data["file_format"] not in _FILE_FORMATS or not data["file"]:
        raise FormatError(f"{mp}: meta.json's file, file_format or size is not valid",
                          path=mp, hint=_META_HINT)


def recorded_digest(meta: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """``(algo, hex)`` that meta.json records for its file, or None."""
    recorded = meta.get("digest") if meta else None
    if isinstance(recorded, dict) and isinstance(recorded.get("hex"), str):
        return str(recorded.get("algo")), str(recorded["hex"]).lower()
    return None


@dataclass(frozen=True)
class Records:
    """The sidecar (``algo``, ``hexdigest`` from ``sidecar``) and meta.json describing a file.

    ``pending`` is True when the sidecar is a pending one that the file's digest
    was found to match.
    """

    sidecar: Path | None
    algo: str | None
    hexdigest: str | None
    meta: dict[str, Any] | None
    meta_file: Path | None
    pending: bool = False


def linked_checkpoint(p: Path) -> Path:
    """``p``, or the file it leads to when it is a link with no records of its own to a
    file of its own folder: Lightning's ``last.ckpt`` (``save_last="link"``) names the
    latest checkpoint that way, and that checkpoint's sidecar and meta.json vouch for it."""
    if not p.is_symlink() or meta_path_for(p).exists() or any(
            sidecar_path(p, algo).exists() for algo in ALGORITHMS):
        return p
    target = p.resolve()
    same_folder = target.is_file() and target.parent == p.parent.resolve()
    return p.parent / target.name if same_folder else p


def resolve_records(p: Path) -> Records:
    """The records of ``p`` at this instant, whatever rename a killed save stopped at."""
    pending = _matching_pending_sidecar(p)
    if pending is not None:
        algo, hexd, side = pending
        meta, mp = _pending_meta(p, {(algo, hexd)})
        if meta is None and meta_path_for(p).exists():
            published = read_meta_file(meta_path_for(p))
            if recorded_digest(published) == (algo, hexd):
                meta, mp = published, meta_path_for(p)
        return Records(side, algo, hexd, meta, mp, pending=True)
    sidecars: dict[str, str] = {algo: read_sidecar(sidecar_path(p, algo))[1] for algo in ALGORITHMS
                if sidecar_path(p, algo).is_file()}
    meta, mp = _pending_meta(p, set(sidecars.items()))
    if meta is None and meta_path_for(p).exists():
        meta, mp = read_meta_file(meta_path_for(p)), meta_path_for(p)
    wanted = recorded_digest(meta)
    # The sidecar of the algorithm meta.json used; another one may describe a file replaced.
    chosen: str | None = next(iter(sidecars), None)
    if wanted is not None and wanted[0] in sidecars:
        chosen = wanted[0]
    if chosen is None:
        return Records(None, None, None, meta, mp)
    return Records(sidecar_path(p, chosen), chosen, sidecars[chosen], meta, mp)


def _matching_pending_sidecar(p: Path) -> tuple[str, str, Path] | None:
    """A pending sidecar that describes the file now at ``p`` (its rename came first)."""
    if not p.is_file():
        return None
    for algo in ALGORITHMS:
        side = pending_name(sidecar_path(p, algo))
        if not side.is_file():
            continue
        hexd = _first_word(side)
        if hexd is not None and digest_file(p, algo).hexdigest == hexd:
            return algo, hexd, side
        return None  # a save that died before its rename: the old records stand
    return None


def _pending_meta(p: Path, digests: set[tuple[str, str]]
                  ) -> tuple[dict[str, Any] | None, Path | None]:
    """The pending meta.json when it records one of ``digests`` (its sidecar was renamed)."""
    mp = pending_name(meta_path_for(p))
    if not digests or not mp.is_file():
        return None, None
    try:
        meta = read_meta_file(mp)
    except TorchVerityError:
        return None, None  # a torn pending record of a save that died while writing it
    return (meta, mp) if recorded_digest(meta) in digests else (None, None)


def _first_word(path: Path) -> str | None:
    try:
        words = path.read_text(encoding="utf-8").split()
    except (OSError, UnicodeDecodeError):
        return None
    return words[0].lower() if words else None


def settle(p: Path) -> None:
    """Finish the renames of a save killed after renaming ``p``, before a new save starts.

    A new save rewrites the pending names; were the file still described by
    them, it would be left with the records of the save before it.
    """
    if not p.is_file():
        return
    records = resolve_records(p)
    if records.pending and records.sidecar is not None and records.algo is not None:
        os.replace(records.sidecar, sidecar_path(p, records.algo))
    if records.meta_file is not None and records.meta_file == pending_name(meta_path_for(p)):
        os.replace(records.meta_file, meta_path_for(p))
