"""The index of a sharded folder (Hugging Face layout): which shard holds each tensor."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from torchverity.checkpoint._records import parse_json, read_text_record
from torchverity.errors import FormatError, InputError

INDEX_NAMES = {"safetensors": "model.safetensors.index.json", "pt": "pytorch_model.bin.index.json"}


SHARD_STEMS = {"safetensors": ("model", ".safetensors"), "pt": ("pytorch_model", ".bin")}


def find_index(folder: Path) -> Path:
    """The folder's index file; ``*.safetensors.index.json`` wins over ``.bin`` ones."""
    found = sorted(folder.glob("*.index.json"), key=lambda p: (".safetensors." not in p.name,
                                                                p.name))
    if not found:
        raise InputError(
            f"{folder}: folder has no *.index.json, so it is not a sharded checkpoint",
            path=folder, hint="load one of its files directly, or save with shard_bytes=",
        )
    return found[0]


def read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor -> shard file), with every shard path kept inside the folder."""
    hint = "restore the index from the source of the shards"
    data = parse_json(read_text_record(index, "the index", hint), index, "the index", hint)
    metadata = data.get("metadata") if isinstance(data, dict) else None
    if metadata is not None and not isinstance(metadata, dict):
        raise FormatError(f"{index}: 'metadata' is {type(metadata).__name__}, not an object",
                          path=index, hint=hint)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise FormatError(f"{index}: no 'weight_map' of tensor names to shard files",
                          path=index, hint="restore the index from the source of the shards")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not _plain_name(shard):
            raise FormatError(
                f"{index}: tensor '{name}' points to {shard!r}, which is not a file in this folder",
                path=index, hint="shard entries must be plain file names",
            )
    return dict(weight_map)


def index_shards(index: Path) -> tuple[list[str], list[str]]:
    """The shard files an index names (sorted, each once) and those of them not beside it;
    :class:`FormatError` when it is no sharded-checkpoint index."""
    shards = sorted(set(read_index(index).values()))
    return shards, [s for s in shards if not (index.parent / s).is_file()]


def _plain_name(name: str) -> bool:
    parts = PurePosixPath(name).parts
    return len(parts) == 1 and parts[0] not in (".", "..") and "\\" not in name
