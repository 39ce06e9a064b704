"""Result objects (dataclasses, paths, tuples, NaN) as JSON-ready values."""

from __future__ import annotations

import dataclasses
from pathlib import PurePath
from typing import Any


def to_jsonable(obj: Any) -> Any:
    """Convert result objects (dataclasses, paths, tuples) into JSON-ready values."""
    if hasattr(obj, "to_dict"):
        return to_jsonable(obj.to_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, PurePath):
        return obj.as_posix()
    if isinstance(obj, float) and obj != obj:  # NaN is not valid JSON
        return "nan"
    if isinstance(obj, float) and obj in (float("inf"), float("-inf")):
        return "inf" if obj > 0 else "-inf"
    return obj
