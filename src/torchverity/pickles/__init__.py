"""Pickle safety: static scans, the weights_only load plan, inert migration, load-error help.

Nothing from a scanned file is imported or run: every pickle stream is walked
symbolically inside every container a loader would open.

``scan(*paths)`` / ``scan_file(path)``
    A verdict per file (``safe``, ``needs-allowlist``, ``needs-review``, ``unsafe``,
    ``malformed``), each global classified by allowlist, and the minimal ``safe_globals`` plan.
``check_limits(path)``
    The scan's bounds (zip bombs, huge safetensors headers, deep nesting, memo bombs)
    checked before a loader hands the file's bytes to torch.
``migrate(src, dst)``
    A legacy or full-object pickle rewritten as a ``weights_only`` state dict plus JSON
    meta, read inertly (no class from the file is instantiated).
``inert_tensors(path)``
    The tensors of a checkpoint torch's weights_only loader refuses (omegaconf, your own
    classes, TorchScript, code-running globals), read inertly; what inspect and fingerprint
    fall back to.
``explain(text_or_exception)``
    Known save/load errors turned into cause, fix and the command that checks it.

Scanning never imports torch; ``migrate`` does, on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchverity._lazy import attach

if TYPE_CHECKING:
    from torchverity.pickles._explain import (
        Explanation,
        explain,
        explain_exception,
        explain_text,
        with_file,
    )
    from torchverity.pickles._extract import inert_tensors
    from torchverity.pickles._limits import check_limits
    from torchverity.pickles._migrate import MigrateResult, inert_load, migrate
    from torchverity.pickles._ops import Limits
    from torchverity.pickles._scan import (
        BENIGN,
        DANGEROUS,
        TORCH,
        UNKNOWN,
        GlobalFinding,
        LoadPlan,
        ScanReport,
        ScanResult,
        Skipped,
        Unreadable,
        scan,
        scan_file,
        torch_allowlist,
    )

__all__ = [
    "BENIGN",
    "DANGEROUS",
    "TORCH",
    "UNKNOWN",
    "Explanation",
    "GlobalFinding",
    "Limits",
    "LoadPlan",
    "MigrateResult",
    "ScanReport",
    "ScanResult",
    "Skipped",
    "Unreadable",
    "check_limits",
    "explain",
    "explain_exception",
    "explain_text",
    "inert_load",
    "inert_tensors",
    "migrate",
    "scan",
    "scan_file",
    "torch_allowlist",
    "with_file",
]
__getattr__, __dir__ = attach(__name__, __file__)
