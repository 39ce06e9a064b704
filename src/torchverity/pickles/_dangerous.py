"""What to say about a file the scan finds unsafe: its code-running globals, and the next
step, which is never a load. Torch-free: scan, inspect and fingerprint say it too."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from torchverity.errors import shell_path

if TYPE_CHECKING:
    from torchverity.pickles._scan import ScanResult

# The scan's formats the inert reader (and so migrate) reads: torch's and plain pickles.
MIGRATABLE = ("torch-zip", "torch-legacy", "pickle", "torchscript")


def dangerous_globals(scan: ScanResult) -> dict[str, str]:
    """The globals of ``scan`` that run code or touch the system, with why, in order."""
    from torchverity.pickles._scan import DANGEROUS

    found: dict[str, str] = {}
    for g in scan.globals:
        if g.category == DANGEROUS:
            found.setdefault(g.name, g.reason)
    return found


def describe_globals(found: Mapping[str, str]) -> str:
    """``name (why), ...`` for a message: the first five, and how many more."""
    named = ", ".join(f"{name} ({why})" for name, why in list(found.items())[:5])
    return named + (f" and {len(found) - 5} more" if len(found) > 5 else "")


def rescue_step(scan: ScanResult) -> str:
    """The next step for a file that names code-running globals: never a load, but its
    tensors and data extracted by the inert reader where it reads the format."""
    if scan.format not in MIGRATABLE:
        return "do not load it"
    target = shell_path(f"{scan.path}.safetensors")
    return ("do not load it; extract its tensors and data without running anything: "
            f"torchverity migrate {shell_path(scan.path)} {target}")
