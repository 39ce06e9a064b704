"""torchverity: make silent data corruption in PyTorch loud, located and recoverable.

Map of the package (one subpackage per area; the CLI mirrors it)::

    Artifacts
      digest        streaming file digests, sha256sum-compatible sidecars
      manifest      directory manifests (JSON, BagIt/sha256sum) with a root digest
      verify        files against sidecars, folders against manifests
      inject        fault drills on files: bit flips, truncation
      checkpoint/   atomic verified save and load, sharded folders, meta.json,
                    content fingerprints, diff, inspect
      pickles/      static pickle scans, the weights_only plan, inert migration, explain
      provenance/   OpenSSF model signatures (extra: sign), Hugging Face caches checked
                    offline, in-toto attestations
    Training
      training/     TrainingGuard: NaN/Inf, spikes, weights at rest, replay, policies
      determinism   seed_everything, RNG capture, data-order records, reproducibility
      faults        tensor fault injection for drills and tests
      distributed/  replica and gradient checks from DTensor placements (DDP, FSDP2,
                    HSDP, TP), replays (sharded too), healing, verified DCP
      report        summaries and plots of guard event logs
      integrations/ Lightning and Hugging Face callbacks (extras)
      protection/   protect(): one switch that watches every load and save in code
                    you don't own; torchverity run
    Inference
      golden/       consistency_check, golden record/check
      selftest      known-answer and repeat-run tests of a device
      doctor        environment report
      export        eager vs ONNX Runtime / torch.export / TorchScript / torch.compile
    Serving and batch
      serve/        FastAPI service with RFC 9530 digests (extra: serve)
      batch/        journaled batch jobs with exactly-once outputs (local or Ray)
    Bottom layer (imports nothing above it)
      errors        TorchVerityError and its typed subclasses
      _formats      what a file is, from its bytes (torch-free)
      _tensors      tensors as bytes: leaves, byte views, dtype names
    cli/, demo/     the ``torchverity`` command and ``torchverity demo``

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

    torchverity hash --write model.pt      # sidecar model.pt.blake3 (b3sum -c reads it)
    torchverity manifest runs/exp1         # torchverity.manifest.json + root digest
    torchverity verify model.pt runs/exp1  # exit 1 on any mismatch, with the place

Public names load lazily, so ``import torchverity`` and the CLI start fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchverity._lazy import attach

__version__ = "0.1.0"

if TYPE_CHECKING:
    from torchverity import (
        batch,
        checkpoint,
        determinism,
        digest,
        distributed,
        doctor,
        faults,
        golden,
        integrations,
        manifest,
        pickles,
        protection,
        provenance,
        report,
        selftest,
        serve,
        training,
    )
    from torchverity.checkpoint import Fingerprint, diff, fingerprint, inspect, load, save
    from torchverity.determinism import reproducibility_check, seed_everything
    from torchverity.digest import digest_file, write_sidecar
    from torchverity.errors import (
        BatchError,
        CheckFailedError,
        CheckpointWriteError,
        DistributedTimeoutError,
        FormatError,
        InputError,
        IntegrityError,
        MissingExtraError,
        ReplicaMismatchError,
        ServiceError,
        StateDictMismatchError,
        TorchVerityError,
        TrainingAnomalyError,
        UnsafeFileError,
        UsageError,
    )
    from torchverity.export import verify_export
    from torchverity.golden import consistency_check
    from torchverity.manifest import build_manifest, write_manifest
    from torchverity.pickles import explain, migrate, scan
    from torchverity.protection import protect, protected, unprotect
    from torchverity.training import TrainingGuard
    from torchverity.verify import verify_directory, verify_file, verify_path

__all__ = [
    "BatchError",
    "CheckFailedError",
    "CheckpointWriteError",
    "DistributedTimeoutError",
    "Fingerprint",
    "FormatError",
    "InputError",
    "IntegrityError",
    "MissingExtraError",
    "ReplicaMismatchError",
    "ServiceError",
    "StateDictMismatchError",
    "TorchVerityError",
    "TrainingAnomalyError",
    "TrainingGuard",
    "UnsafeFileError",
    "UsageError",
    "__version__",
    "batch",
    "build_manifest",
    "checkpoint",
    "consistency_check",
    "determinism",
    "diff",
    "digest",
    "digest_file",
    "distributed",
    "doctor",
    "explain",
    "faults",
    "fingerprint",
    "golden",
    "inspect",
    "integrations",
    "load",
    "manifest",
    "migrate",
    "pickles",
    "protect",
    "protected",
    "protection",
    "provenance",
    "report",
    "reproducibility_check",
    "save",
    "scan",
    "seed_everything",
    "selftest",
    "serve",
    "training",
    "unprotect",
    "verify_directory",
    "verify_export",
    "verify_file",
    "verify_path",
    "write_manifest",
    "write_sidecar",
]
__getattr__, __dir__ = attach(__name__, __file__)
