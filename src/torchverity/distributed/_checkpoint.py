"""Verified checkpoints in a ``torch.distributed`` job.

``save_rank0``
    Rank 0 writes through :func:`torchverity.save`, re-reads the file against
    the digest computed while writing, and only then releases the other ranks.
``save_dcp`` / ``load_dcp``
    ``torch.distributed.checkpoint`` folders record offsets but no content
    hash, and their ``.metadata`` is a pickle. After a save each rank hashes
    the files it wrote, rank 0 writes a standard ``torchverity.manifest.json``
    (``torchverity verify DIR`` checks it) plus per-rank tensor fingerprints;
    a load verifies the files (split across ranks) before ``.metadata`` is
    unpickled, and the loaded tensors against the fingerprints afterwards.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import torchverity.distributed._dcp_generations as generations
from torchverity._generation_pointer import SHARDS_IN_GENERATION
from torchverity.digest import DEFAULT_ALGO, atomic_write_text, digest_files
from torchverity.distributed._comm import (
    DEFAULT_TIMEOUT_S,
    Comm,
    all_gather_json,
    broadcast_status,
    open_comm,
)
from torchverity.distributed._fullsums import ALGO as FULL_ALGO
from torchverity.distributed._fullsums import full_sums, leaves
from torchverity.errors import FormatError, InputError, IntegrityError, TorchVerityError, shell_path
from torchverity.manifest import (
    MANIFEST_NAME,
    Manifest,
    ManifestEntry,
    list_files,
    read_manifest,
    resolve_inside,
)

SHARDS_NAME = SHARDS_IN_GENERATION
SHARDS_FORMAT = "torchverity-dcp-shards"
SHARDS_VERSION = 1
_WRITER_PREFIX = re.compile(r"^__(\d+)_")


@dataclass(frozen=True)
class DcpLoadReport:
    """What ``load_dcp`` verified before and after loading."""

    path: str
    algo: str
    files_verified: int
    fingerprints_verified: bool
    rank: int
    full_tensors_verified: bool = False


# ------------------------------------------------------------------ rank-0 save


def save_rank0(
    obj: Any,
    path: str | os.PathLike[str],
    *,
    group: dist.ProcessGroup | None = None,
    check: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    **save_kwargs: Any,
) -> Any:
    """Save on the group's first rank, verify the written file, then release every rank.

    With ``check=model`` the replicas are compared first and nothing is saved
    if they disagree (a checkpoint of a corrupted replica is worse than none).
    Every rank returns the :class:`~torchverity.checkpoint.SaveReport` (with
    ``written=False`` on the others) or raises the same failure.
    """
    from torchverity.checkpoint._results import SaveReport
    from torchverity.checkpoint._save import save
    from torchverity.distributed._checks import check_replicas
    from torchverity.verify import verify_file

    c = open_comm(group, timeout, "save_rank0")
    path = Path(path)
    if check is not None:
        check_replicas(check, optimizer, group, timeout=timeout).raise_if_failed()
    report, error = None, None
    if c.index == 0:
        try:
            report = save(obj, path, all_ranks=True, **save_kwargs)
            result = verify_file(path)
            if not result.ok:
                raise IntegrityError(
                    f"{path}: the file read back does not match the digest computed while "
                    "writing it (the storage corrupted it)",
                    path=path, expected=report.digest, actual=result.entries[0].actual,
                    hint="save again to another disk and check the storage's health",
                )
        except Exception as exc:  # every rank must hear about any failure, then it is re-raised
            error = exc
    failed = broadcast_status(c, error is not None, f"the verified save of {path}")
    if error is not None:
        raise error
    if failed:
        raise IntegrityError(
            f"rank {c.ranks[0]} could not write a verified checkpoint {path}; rank {c.rank} "
            "holds the only copy of its state",
            path=path, hint=f"see rank {c.ranks[0]}'s error, then torchverity verify "
                            f"{shell_path(path)}",
        )
    return report or SaveReport(os.fspath(path), save_kwargs.get("algo", DEFAULT_ALGO), "", "",
                                None, None, written=False)


# ------------------------------------------------------------------ DCP save


def _owner(rel: str, position: int, world: int) -> int:
    """Which group index hashes ``rel``: the rank that wrote it, when the name says so."""
    name = rel.rsplit("/", 1)[-1]
    match = _WRITER_PREFIX.match(name)
    if match:
        return int(match.group(1)) % world
    if name in (".metadata", SHARDS_NAME):
        return 0
    return position % world


def _my_files(c: Comm, files: list[str]) -> list[str]:
    return [f for i, f in enumerate(files) if _owner(f, i, c.world) == c.index]


def _written_files(metadata: Any) -> set[str]:
    """The files a save wrote, from its own metadata (listing the folder would race rank 0)."""
    storage = getattr(metadata, "storage_data", None)
    paths = {getattr(info, "relative_path", None) for info in (storage or {}).values()}
    if None in paths or not paths:
        raise FormatError(
            "save_dcp: the storage writer did not report the files it wrote",
            hint="use the default FileSystemWriter (pass a folder path as checkpoint_id)",
        )
    return {str(p) for p in paths} | {".metadata"}


def _local_tensors(state: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's own piece of every tensor: DTensor local shards, or the full tensor."""
    for name, t in leaves(state):
        local = t.to_local() if hasattr(t, "to_local") else t
        yield name, local.detach()


def _shard_fingerprint(state: Any, algo: str | None = None) -> dict[str, Any]:
    from torchverity.checkpoint._fingerprint import fingerprint

    # A recorded algorithm (blake3, sha256 or tvsum64x2) rebuilds the record as it was made.
    return fingerprint(dict(_local_tensors(state)), mode=algo or "auto").to_dict()


def save_dcp(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    group: dist.ProcessGroup | None = None,
    algo: str = DEFAULT_ALGO,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    certification: dict[str, Any] | None = None,
) -> Manifest:
    """``torch.distributed.checkpoint.save`` plus a manifest and per-rank fingerprints.

    Call it on every rank. Each rank hashes the files it wrote (in parallel
    across ranks); rank 0 writes ``torchverity.manifest.json`` so that
    ``torchverity verify PATH`` and :func:`load_dcp` can check the folder.
    The save goes to a new generation folder under ``path`` and is published
    by one rename of ``path/torchverity.current.json``: killed at any instant,
    ``path`` still holds the previous checkpoint, whole and verified.
    ``certification`` (JSON-ready, rank 0's is written) is a training guard's
    verdict on the state being saved, kept with the fingerprints
    (:func:`read_certification`; ``torchverity verify`` reports it).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    c = open_comm(group, timeout, "save_dcp")
    top = Path(path)
    root = generations.begin(c, top)  # this save's own folder beside the live checkpoint
    try:
        saved = dcp.save(state_dict, checkpoint_id=root, process_group=group)
    except (Exception, CheckpointException) as exc:  # every rank gets DCP's collective failure
        raise generations.failed(c, top, root, exc) from None
    written = _written_files(saved)
    fingerprints = all_gather_json(c, _shard_fingerprint(state_dict),
                                   "the shard fingerprint exchange")
    full = full_sums(c, state_dict)
    error: Exception | None = None
    if c.index == 0:
        record = {"format": SHARDS_FORMAT, "version": SHARDS_VERSION, "world_size": c.world,
                  "ranks": {str(i): fp for i, fp in enumerate(fingerprints)},
                  "full": {"algo": FULL_ALGO, "tensors": full}}
        if certification is not None:
            record["certification"] = certification
        atomic_write_text(root / SHARDS_NAME, json.dumps(record, indent=2) + "\n")
    files = sorted({*written, SHARDS_NAME}, key=str.encode)
    shares = all_gather_json(c, _hash_share(c, root, files, algo), "the shard digest exchange")
    failed = [share for share in shares if share["error"]]
    if failed:
        raise InputError(
            f"{root}: rank {failed[0]['rank']} could not hash the files it wrote: "
            f"{failed[0]['error']}; no manifest was written",
            path=root, hint="fix the storage, then record the folder: torchverity manifest "
                            f"{shell_path(root)}",
        )
    entries = tuple(sorted(
        (ManifestEntry(e["path"], e["size"], e["digest"]) for share in shares
         for e in share["files"]),
        key=lambda e: e.path.encode(),
    ))
    manifest = Manifest(algo=algo, entries=entries)
    if c.index == 0:
        try:
            atomic_write_text(root / MANIFEST_NAME, json.dumps(manifest.to_dict(), indent=2) + "\n")
            generations.publish(top, root)
        except Exception as exc:  # released to every rank below, then re-raised here
            error = exc
    if broadcast_status(c, error is not None, f"the manifest of {root}"):
        raise error or IntegrityError(
            f"rank {c.ranks[0]} could not write the manifest of {root}", path=root,
            hint=f"see rank {c.ranks[0]}'s error, then torchverity manifest {shell_path(root)}",
        )
    return manifest


# ------------------------------------------------------------------ DCP load


def _hash_share(c: Comm, root: Path, files: list[str], algo: str) -> dict[str, Any]:
    """Digests of this rank's files; a failure is reported to every rank, never left hanging."""
    mine = _my_files(c, files)
    try:
        digests = digest_files([root / f for f in mine], algo) if mine else []
    except TorchVerityError as exc:
        return {"rank": c.rank, "files": [], "error": exc.message}
    return {"rank": c.rank, "error": None, "files": [
        {"path": f, "size": d.size, "digest": d.hexdigest}
        for f, d in zip(mine, digests, strict=True)
    ]}


def _digest_present(c: Comm, root: Path, mine: list[str], algo: str, record: Path,
                    problems: list[dict[str, Any]]) -> dict[str, Any]:
    """Digest the files of ``mine`` that exist; links and unreadable files become problems."""
    present = []
    for f in mine:
        try:
            if resolve_inside(root, f, record).is_file():
                present.append(f)
        except TorchVerityError:
            problems.append({"path": f, "status": "symlink", "rank": c.rank})
    try:
        digests = digest_files([root / f for f in present], algo) if present else []
    except TorchVerityError:
        problems += [{"path": f, "status": "unreadable", "rank": c.rank} for f in present]
        return {}
    return dict(zip(present, digests, strict=True))


def _check_share(c: Comm, root: Path, manifest: Manifest, record: Path) -> list[dict[str, Any]]:
    """Verify this rank's share of the manifest; rank 0 also looks for unlisted files."""
    expected = {e.path: e for e in manifest.entries}
    mine = _my_files(c, sorted(expected, key=str.encode))
    problems: list[dict[str, Any]] = []
    actual = _digest_present(c, root, mine, manifest.algo, record, problems)
    reported = {p["path"] for p in problems}
    for f in mine:
        got = actual.get(f)
        if f in reported:
            continue
        if got is None:
            problems.append({"path": f, "status": "missing", "rank": c.rank})
        elif got.hexdigest != expected[f].digest or expected[f].size not in (-1, got.size):
            problems.append({"path": f, "status": "mismatched", "rank": c.rank})
    if c.index == 0:
        problems += [{"path": f, "status": "extra", "rank": c.rank}
                     for f in list_files(root)[0]
                     if f not in expected and not generations.is_temp(f)]
    return problems


def load_dcp(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    group: dist.ProcessGroup | None = None,
    timeout: float | None = DEFAULT_TIMEOUT_S,
) -> DcpLoadReport:
    """Verify a distributed checkpoint folder, then load it in place into ``state_dict``.

    The ranks split the files of the manifest between them and agree on the
    verdict before ``torch.distributed.checkpoint.load`` unpickles
    ``.metadata``. After loading, each rank's tensors are compared with the
    fingerprints recorded for the same rank when the world size is unchanged.
    """
    import torch.distributed.checkpoint as dcp

    c = open_comm(group, timeout, "load_dcp")
    root = generations.data_folder(Path(path))
    record = root / MANIFEST_NAME
    manifest = read_manifest(record)
    problems = [p for share in all_gather_json(c, _check_share(c, root, manifest, record),
                                                "the checkpoint verification exchange")
                for p in share]
    if problems:
        listed = "; ".join(f"{p['path']} {p['status']} (checked by rank {p['rank']})"
                           for p in problems[:5])
        raise IntegrityError(
            f"{root}: {len(problems)} file(s) of the distributed checkpoint do not match its "
            f"manifest: {listed}; nothing was loaded",
            path=root, tensors=[p["path"] for p in problems],
            hint=f"torchverity verify {shell_path(root)}; load an older verified checkpoint",
        )
    dcp.load(state_dict, checkpoint_id=root, process_group=group)
    verified = _check_fingerprints(c, root, state_dict)
    full = check_full_tensors(c, root, state_dict)
    return DcpLoadReport(os.fspath(path), manifest.algo, len(manifest.entries), verified, c.rank,
                         full)


def check_full_tensors(c: Comm, root: Path, state_dict: dict[str, Any]) -> bool:
    """Compare the loaded state's full-tensor sums with those recorded at save.

    Works whatever the sharding at load (resharding from 4 ranks to 2 included):
    each rank sums its own shards at their global positions. Tensors the
    loaded state lacks, or whose placement cannot be summed, are skipped; the
    result is true when at least one tensor was compared and none differed.
    """
    recorded = _read_shards(root / SHARDS_NAME)
    full = (recorded or {}).get("full") or {}
    expected = full.get("tensors") if full.get("algo") == FULL_ALGO else None
    if not expected:
        return False
    actual = full_sums(c, state_dict)
    compared = [n for n, v in actual.items() if v is not None and expected.get(n) is not None]
    differing = [n for n in compared if actual[n] != expected[n]]
    if differing:
        raise IntegrityError(
            f"{root}: {len(differing)} full tensor(s) loaded from the distributed checkpoint "
            f"differ from the digests recorded at save: {', '.join(differing[:5])}",
            path=root, tensors=differing,
            hint="the files verified, so the load path or memory corrupted them: reload, and "
            "check the devices of the ranks that hold those shards",
        )
    return bool(compared)


def _check_fingerprints(c: Comm, root: Path, state_dict: dict[str, Any]) -> bool:
    from torchverity.checkpoint._fingerprint import Fingerprint

    recorded = _read_shards(root / SHARDS_NAME)
    mine = recorded.get("ranks", {}).get(str(c.index)) if recorded else None
    usable = mine is not None and recorded is not None and recorded.get("world_size") == c.world
    if usable and mine is not None:
        expected = Fingerprint.from_dict(mine)
        actual = Fingerprint.from_dict(_shard_fingerprint(state_dict, expected.algo))
        differing = expected.differing(actual)
    else:
        differing = []
    reports = all_gather_json(c, {"rank": c.rank, "usable": usable, "differing": differing},
                              "the loaded fingerprint exchange")
    bad = [r for r in reports if r["differing"]]
    if bad:
        where = "; ".join(f"rank {r['rank']}: {', '.join(r['differing'][:3])}" for r in bad)
        raise IntegrityError(
            f"{root}: tensors loaded from the distributed checkpoint differ from the fingerprints "
            f"recorded at save: {where}",
            path=root, tensors=[t for r in bad for t in r["differing"]],
            hint="the files verified, so memory or the load path corrupted them: reload, and "
            "check the named rank's device",
        )
    return all(r["usable"] for r in reports)


def read_certification(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The training guard's certification recorded with the live checkpoint of ``path``
    (None: none recorded). Plain JSON: readable before anything is verified or loaded."""
    root = generations.data_folder(Path(path))
    found = (_read_shards(root / SHARDS_NAME) or {}).get("certification")
    if found is not None and not (isinstance(found, dict)
                                  and isinstance(found.get("certified"), bool)):
        raise FormatError(f"{root / SHARDS_NAME}: the certification it records is malformed",
                          path=root / SHARDS_NAME,
                          hint=f"torchverity verify {shell_path(path)}; save the checkpoint again")
    return found


def _read_shards(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{path}: unreadable shard fingerprints: {exc}", path=path) from None
    if not isinstance(data, dict) or data.get("format") != SHARDS_FORMAT:
        raise FormatError(f"{path}: not a {SHARDS_FORMAT} file", path=path)
    return data
