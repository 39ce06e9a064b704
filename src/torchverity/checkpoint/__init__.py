"""Checkpoints: verified save and load, fingerprints, diffs and inspection.

``save`` writes to a temporary file in the target's folder, hashes every byte
as it is written (no second pass over the file), fsyncs, renames over the
target and fsyncs the folder, so a process killed at any moment leaves either
the previous checkpoint or the new one, never a torn file. Next to the file it
writes ``FILE.blake3`` (a ``b3sum`` line) and ``FILE.meta.json`` (versions,
seed, data digest, fingerprint, keys/shapes/dtypes and the caller's metadata;
see ``docs/formats/checkpoint.md``).

``load`` checks the file digest as it reads the file (once), loads with
``weights_only=True``, compares the content fingerprint with meta.json and,
given a model, checks keys, shapes and dtypes all at once. It never falls back
to ``weights_only=False``: full pickles load only when the caller names the
file's SHA-256 (``trust_sha256=``), and that is logged.

>>> import torch, torchverity
>>> report = torchverity.save({"w": torch.ones(2)}, "model.pt", meta={"step": 10})  # doctest: +SKIP
>>> state = torchverity.load("model.pt")                                          # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchverity._lazy import attach

if TYPE_CHECKING:
    from torchverity.checkpoint._damage import locate_damage
    from torchverity.checkpoint._diff import diff
    from torchverity.checkpoint._diff_result import DiffResult, TensorDiff
    from torchverity.checkpoint._file_fingerprint import fingerprint_file
    from torchverity.checkpoint._fingerprint import (
        DEVICE,
        EXACT,
        Fingerprint,
        TensorDigest,
        checksum_tensors,
        device_checksum,
        fingerprint,
        fingerprint_tensor,
    )
    from torchverity.checkpoint._inspect import InspectResult, inspect
    from torchverity.checkpoint._load import load
    from torchverity.checkpoint._meta import (
        META_FORMAT,
        META_VERSION,
        environment,
        meta_path_for,
        read_meta,
    )
    from torchverity.checkpoint._model_fit import check_against_model, state_dict_of
    from torchverity.checkpoint._read import read_unverified
    from torchverity.checkpoint._results import (
        CheckpointWarning,
        LoadReport,
        SaveReport,
        SidecarPolicy,
    )
    from torchverity.checkpoint._save import save

__all__ = [
    "DEVICE",
    "EXACT",
    "META_FORMAT",
    "META_VERSION",
    "CheckpointWarning",
    "DiffResult",
    "Fingerprint",
    "InspectResult",
    "LoadReport",
    "SaveReport",
    "SidecarPolicy",
    "TensorDiff",
    "TensorDigest",
    "check_against_model",
    "checksum_tensors",
    "device_checksum",
    "diff",
    "environment",
    "fingerprint",
    "fingerprint_file",
    "fingerprint_tensor",
    "inspect",
    "load",
    "locate_damage",
    "meta_path_for",
    "read_meta",
    "read_unverified",
    "save",
    "state_dict_of",
]
__getattr__, __dir__ = attach(__name__, __file__)
