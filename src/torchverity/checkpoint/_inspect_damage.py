"""What an inspected checkpoint's records say is wrong with it: the cases ``inspect``
exits 1 for beyond a sidecar or fingerprint mismatch (a damaged meta.json, one that
disagrees with the file's size or digest, a header that cannot be read, a missing shard).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from torchverity.checkpoint._records import recorded_digest, resolve_records
from torchverity.digest import digest_file
from torchverity.errors import TorchVerityError

_SHARD_PARTS = re.compile(r"(?P<stem>model|pytorch_model)-\d{5}-of-(?P<count>\d{5})"
                          r"(?P<rest>(?:\.g\d+)?\.(?:safetensors|bin))")


def problems(result: Any) -> list[str]:
    """Human-readable problems found in ``result`` (an InspectResult); empty when intact."""
    from torchverity.checkpoint._folders import resolve

    # As inspect read it: a folder, its index given directly, or one file.
    target = resolve(result.path)
    record, folder = target.record, target.folder
    found = []
    if result.not_loaded and (result.scan is None or result.scan.ok):
        found.append(result.not_loaded)
    missing = [s for s in result.shards if not (folder / s).is_file()]
    if missing:
        found.append(f"the index names {len(missing)} shard(s) that do not exist: "
                     f"{', '.join(missing[:5])}")
    extra = _extra_shards(folder, set(result.shards)) if result.shards else []
    if extra:
        found.append(f"the folder holds {len(extra)} shard(s) of this save that the index does "
                     f"not name: {', '.join(extra[:5])}")
    records = _record_problems(result, record, folder)
    meta = _meta_problems(record, result)
    found += records + meta
    if result.fingerprint_matches_meta is False and not (records or meta):
        found.append("the tensors differ from those meta.json records (its fingerprint "
                     "does not match)")
    return found


def _record_problems(result: Any, file: Path, folder: Path) -> list[str]:
    """The file, and each shard, whose bytes differ from the record that vouches for them,
    with the tensors hit when a meta.json beside it names them."""
    checks = {file: result.sidecar}
    checks.update({folder / name: check for name, check in result.shard_records.items()})
    found = []
    for path, check in checks.items():
        if check.status != "mismatched":
            continue
        where = check.sidecar or "its record"
        hit = _damaged(path)
        found.append(f"{path}: {check.algo} {check.actual} does not match {where} (recorded "
                     f"{check.expected})" + (f"; damaged tensors: {', '.join(hit)}" if hit else ""))
    return found


def _damaged(path: Path) -> list[str]:
    from torchverity.checkpoint._meta import meta_path_for

    if not meta_path_for(path).is_file():
        return []  # no record of its tensors: nothing to name them by
    from torchverity.checkpoint._damage import locate_damage

    return locate_damage(path)


def _extra_shards(folder: Path, listed: set[str]) -> list[str]:
    """Shard files named as this save's shards (same count, generation and suffix) but unlisted.

    Shards of another generation (what a killed save left) are not this checkpoint's.
    """
    family = {_family(name) for name in listed}
    return sorted(p.name for p in folder.iterdir()
                  if p.name not in listed and _family(p.name) in family and p.is_file())


def _family(name: str) -> str | None:
    match = _SHARD_PARTS.fullmatch(name)
    return None if match is None else f"{match['stem']}|{match['count']}|{match['rest']}"


def _meta_problems(record: Path, result: Any) -> list[str]:
    if isinstance(result.meta, dict) and "error" in result.meta:
        return [f"meta.json is damaged: {result.meta['error']}"]
    try:
        meta = resolve_records(record).meta
    except TorchVerityError as exc:
        return [exc.message]
    if meta is None:
        return []
    found = []
    if meta["size"] != record.stat().st_size:
        found.append(f"meta.json records {meta['size']} bytes, the file has "
                     f"{record.stat().st_size}")
    digest = recorded_digest(meta)
    if digest is not None:
        algo, want = digest
        actual = (result.sidecar.actual if result.sidecar.algo == algo
                  else digest_file(record, algo).hexdigest)
        told = (result.sidecar.status == "mismatched" and result.sidecar.algo == algo
                and result.sidecar.expected == want)  # the sidecar's line says it already
        if actual != want and not told:
            found.append(f"meta.json records {algo} {want}, the file's is {actual}")
    return found
