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

from torchverity.errors import TorchVerityError, UsageError


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
    except Exception as exc:  # the module's own code failed while it was imported
        raise factory_failed(spec, exc, f"importing module '{module_name}'") from exc
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


def call_spec(spec: str, factory: Callable[..., Any], *args: Any) -> Any:
    """``factory(*args)``: the user's model-building code, whose failure is named as theirs
    (not a fault of torchverity), with the way to see where it failed."""
    try:
        return factory(*args)
    except TorchVerityError:
        raise
    except Exception as exc:
        raise factory_failed(spec, exc, f"calling '{spec}'") from exc


def factory_failed(spec: str, exc: BaseException, doing: str) -> UsageError:
    return UsageError(
        f"{doing} raised {type(exc).__name__}: {exc}: the model named by '{spec}' could not "
        "be built",
        hint="rerun with TORCHVERITY_DEBUG=1 for the traceback into that code",
    )
