"""Resolve ``module:callable`` specs (as uvicorn names apps) used by golden, serve and batch.

These name the user's own model-building code, which is trusted by definition;
files being checked (checkpoints) are never imported.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchverity.errors import UsageError


def import_callable(spec: str) -> Callable[..., Any]:
    """Import ``package.module:attr.path`` and return the callable it names."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise UsageError(
            f"'{spec}' is not of the form module:callable",
            hint="for example --model mypkg.models:build_model",
        )
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # like uvicorn: modules in the current folder resolve
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(
            f"cannot import module '{module_name}' named in '{spec}': {exc}",
            hint="check the name and that its folder is on PYTHONPATH",
        ) from None
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(
                f"module '{module_name}' has no attribute '{attr_path}' (from '{spec}')",
                hint="name a function or class that builds the model",
            ) from None
    if not callable(obj):
        raise UsageError(f"'{spec}' names a {type(obj).__name__}, not a callable")
    return obj
