"""Generations of a sharded folder: each save writes its shards under new names beside the
shards of the checkpoint it replaces, and the index's rename is the one instant it switches.

The first save into a folder uses the Hugging Face names
(``model-00001-of-00003.safetensors``); save N after it (N >= 2) names its
shards ``model-00001-of-00003.gN.safetensors`` and records ``generation: N``
in the index's ``metadata``. The index that ``load`` reads (the live one) only
ever names shards of its own save, so a kill at any instant leaves the
previous checkpoint whole. Files a killed save left behind (shards no index
names, temp files of dead processes, an index of the other format) are swept
by the next save; ``load`` never looks at them.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
from collections.abc import Callable, Iterable
from pathlib import Path

from torchverity.checkpoint._index import INDEX_NAMES, find_index, read_index
from torchverity.checkpoint._records import META_SUFFIX, parse_json
from torchverity.digest import ALGORITHMS
from torchverity.errors import TorchVerityError

_SHARD = re.compile(r"^(?:model|pytorch_model)-\d{5}-of-\d{5}(?:\.g\d+)?\.(?:safetensors|bin)")
_RECORD_SUFFIXES = (*tuple(f".{a}" for a in ALGORITHMS), META_SUFFIX)
# Temp names: ``.NAME.tmp-HOST-PID-HEX`` (checkpoint files) and ``.NAME.tmp-PID`` (records).
_TEMP = re.compile(rf"\.tmp-(?:(?:{re.escape(socket.gethostname())})-(\d+)-[0-9a-f]+|(\d+))$")
_ANY_TEMP = re.compile(r"\.tmp-[^/]*$")


def shard_name(stem: str, suffix: str, i: int, n: int, generation: int) -> str:
    tag = f".g{generation}" if generation > 1 else ""
    return f"{stem}-{i:05d}-of-{n:05d}{tag}{suffix}"


def live_index(folder: Path) -> Path | None:
    """The index ``load`` would read now, or None for a folder with no checkpoint yet."""
    try:
        return find_index(folder)
    except TorchVerityError:
        return None


def generation_of(index: Path | None) -> int:
    """The generation an index records (1 for an index written by another tool)."""
    if index is None:
        return 0
    try:
        data = parse_json(index.read_text(encoding="utf-8"), index, "index", "")
    except (OSError, UnicodeDecodeError, TorchVerityError):
        return 1
    meta = data.get("metadata") if isinstance(data, dict) else None
    gen = meta.get("generation") if isinstance(meta, dict) else None
    return gen if isinstance(gen, int) and not isinstance(gen, bool) and gen > 0 else 1


def referenced(index: Path | None) -> set[str] | None:
    """The shard files an index names; None when it cannot be read (then nothing is swept)."""
    if index is None:
        return set()
    try:
        return set(read_index(index).values())
    except TorchVerityError:
        return None


def _owner(name: str) -> str | None:
    """The shard (or index) file a name belongs to: itself, a record of it, or a temp of it."""
    base = name
    if base.startswith("."):
        base = _ANY_TEMP.sub("", base[1:])
        base = base.removesuffix(".pending")
    for suffix in _RECORD_SUFFIXES:
        stripped = base.removesuffix(suffix)
        if stripped != base and (_SHARD.fullmatch(stripped) or stripped in INDEX_NAMES.values()):
            base = stripped
            break
    if _SHARD.fullmatch(base) or base in INDEX_NAMES.values():
        return base
    return None


def dead_temp(name: str) -> bool:
    """A temp file of this host whose writer is no longer running (other hosts' are kept)."""
    from torchverity.checkpoint._atomic import _alive

    match = _TEMP.search(name)
    return match is not None and not _alive(int(match.group(1) or match.group(2)))


def sweep(folder: Path, live: Path | None) -> set[str]:
    """Remove what no live record names: shards and indexes of killed saves, dead temps.

    Returns the names the live checkpoint is made of (its index and shards).
    """
    names = referenced(live)
    if names is None:  # a damaged index: keep everything, the new index replaces it
        return set()
    keep = names | ({live.name} if live is not None else set())
    _remove(folder, lambda owner: owner not in keep)
    return keep


def retire(folder: Path, old: set[str], new: Path) -> None:
    """After the switch: remove the replaced checkpoint's files that the new one does not use."""
    gone = old - (referenced(new) or set()) - {new.name}
    # The old index first: a folder never has an index naming shards it lacks.
    _remove(folder, lambda owner: owner in gone and owner in INDEX_NAMES.values())
    _remove(folder, lambda owner: owner in gone)


def _remove(folder: Path, doomed: Callable[[str], bool]) -> None:
    for path in _entries(folder):
        owner = _owner(path.name)
        if owner is None:
            continue
        temp = _ANY_TEMP.search(path.name) is not None
        if (temp and not dead_temp(path.name)) or (not temp and not doomed(owner)):
            continue
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            path.unlink()


def _entries(folder: Path) -> Iterable[Path]:
    try:
        return sorted(p for p in folder.iterdir() if not p.is_dir())
    except OSError:
        return []


def index_body(total: int, generation: int, weight_map: dict[str, str]) -> bytes:
    metadata: dict[str, int] = {"total_size": total}
    if generation > 1:
        metadata["generation"] = generation
    return (json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2)
            + "\n").encode()
