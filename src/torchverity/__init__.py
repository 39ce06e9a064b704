"""torchverity: make silent data corruption in PyTorch loud, located and recoverable.

Map of the package (one module per concept; the CLI mirrors it)::

    Artifacts
      digest       streaming file digests, sha256sum-compatible sidecars
      manifest     directory manifests (JSON, BagIt/sha256sum) with a root digest
      verify       files against sidecars, folders against manifests
      inject       fault drills on files: bit flips, truncation
      fingerprint  format-independent content fingerprints of tensors and checkpoints
      checkpoint   atomic verified save / verified load, sharded folders, meta.json
      diff         tensor-by-tensor comparison, bit-flip classification
      inspect      what a checkpoint holds, without running its pickle
      scan         static pickle analysis, weights_only planner
      migrate      legacy pickles -> weights_only state_dict + JSON meta
      explain      known save/load errors -> cause, fix, checking command
    Training
      guard        TrainingGuard: NaN/Inf, spikes, weights at rest, replay, policies
      determinism  seed_everything, RNG capture, data-order records, reproducibility
      faults       tensor fault injection for drills and tests
      distributed  cross-replica checks, gradient checks, cross-rank replay, DCP manifests
      report       summaries and plots of guard event logs
      integrations Lightning and Hugging Face callbacks (extras)
    Inference
      golden       consistency_check, golden record/check
      selftest     known-answer and repeat-run tests of a device
      doctor       environment report
      export       eager vs ONNX Runtime / torch.export / TorchScript / torch.compile
    Serving and batch
      serve        FastAPI service with RFC 9530 digests (extra: serve)
      batch        journaled batch jobs with exactly-once outputs (local or Ray)
    Shared
      errors       TorchVerityError and its typed subclasses
      cli, demo    the ``torchverity`` command and ``torchverity demo``

Examples (``torchverity demo`` runs every capability end to end)::

    >>> import tempfile, torch, torchverity
    >>> from pathlib import Path
    >>> folder = Path(tempfile.mkdtemp())
    >>> state = {"w": torch.ones(2, 2), "b": torch.zeros(2, dtype=torch.bfloat16)}
    >>> report = torchverity.save(state, folder / "model.safetensors")
    >>> loaded = torchverity.load(folder / "model.safetensors", sidecar="require")
    >>> torchverity.fingerprint(loaded).root == torchverity.fingerprint(state).root
    True
    >>> torchverity.verify_path(folder / "model.safetensors").ok
    True
    >>> torch.save(state, folder / "plain.pt")
    >>> torchverity.scan(folder / "plain.pt").results[0].verdict
    'safe'

Command line::

    torchverity hash --write model.pt      # sidecar model.pt.sha256 (sha256sum -c reads it)
    torchverity manifest runs/exp1         # torchverity.manifest.json + root digest
    torchverity verify model.pt runs/exp1  # exit 1 on any mismatch, with the place

Public names load lazily, so ``import torchverity`` and the CLI start fast.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__version__ = "0.1.0"

# Public name -> module that defines it. Several names equal their module's
# name (``torchverity.fingerprint`` is a function defined in the module
# ``torchverity.fingerprint``); _Package keeps the function bound when the
# submodule is imported. So inside the package write
# ``from torchverity.fingerprint import fingerprint``, never
# ``import torchverity.fingerprint as m``.
_LAZY: dict[str, str] = {
    "TorchVerityError": "errors",
    "UsageError": "errors",
    "InputError": "errors",
    "FormatError": "errors",
    "MissingExtraError": "errors",
    "CheckFailedError": "errors",
    "IntegrityError": "errors",
    "UnsafeFileError": "errors",
    "StateDictMismatchError": "errors",
    "CheckpointWriteError": "errors",
    "BatchError": "errors",
    "ReplicaMismatchError": "errors",
    "DistributedTimeoutError": "errors",
    "ServiceError": "errors",
    "digest_file": "digest",
    "write_sidecar": "digest",
    "verify_file": "verify",
    "verify_path": "verify",
    "build_manifest": "manifest",
    "write_manifest": "manifest",
    "verify_directory": "verify",
    "fingerprint": "fingerprint",
    "Fingerprint": "fingerprint",
    "save": "checkpoint",
    "load": "checkpoint",
    "diff": "diff",
    "inspect": "inspect",
    "scan": "pickles",
    "migrate": "pickles",
    "explain": "pickles",
    "TrainingGuard": "training",
    "TrainingAnomalyError": "errors",
    "seed_everything": "determinism",
    "reproducibility_check": "determinism",
    "consistency_check": "golden",
    "verify_export": "export",
}
# Modules reached as attributes: ``torchverity.golden.record(...)``.
_SUBMODULES = frozenset(
    {
        "golden", "selftest", "doctor", "distributed", "serve", "batch", "faults", "manifest",
        "digest", "report", "integrations", "determinism",
    }
)

__all__ = ["__version__", *_LAZY, *sorted(_SUBMODULES)]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"torchverity.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torchverity' has no attribute '{name}'")
    value = getattr(importlib.import_module(f"torchverity.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


class _Package(types.ModuleType):
    """Keeps public functions bound when a same-named submodule is imported."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == name:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
