"""The guard's own state as a JSON record that carries its own digest.

A Hugging Face checkpoint folder can be resumed from anywhere (copied to another
machine, another ``output_dir``), and the Trainer tells a callback nothing about where
the folder is: only its ``trainer_state.json`` comes back, with each stateful
callback's entry. So the guard's state travels inside that entry, as this record
(docs/formats/checkpoint.md, "The guard's state in trainer_state.json"). Tensors are
their raw little-endian bytes in base64, so the windows come back bit for bit; the
digest covers the canonical JSON of the state and the step it belongs to.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

import torch

from torchverity._tensors import host_bytes, numel_bytes
from torchverity.checkpoint._safetensors import CODES, DTYPES
from torchverity.errors import FormatError, IntegrityError

FORMAT = "torchverity-guard-state/1"


def encode_record(state: Mapping[str, Any], global_step: int, saved_in: str) -> dict[str, Any]:
    """The record of ``state`` (``TrainingGuard.state_dict()``) saved at ``global_step``
    in the folder ``saved_in``."""
    body = _encode(state)
    return {"format": FORMAT, "global_step": global_step, "saved_in": saved_in,
            "sha256": _digest(body, global_step), "state": body}


def decode_record(record: Any, global_step: int) -> dict[str, Any]:
    """The guard state in ``record``, which must belong to the checkpoint of
    ``global_step``: ``IntegrityError`` when it was edited or belongs to another step,
    ``FormatError`` when it is not such a record."""
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise FormatError(f"not a {FORMAT} record")
    body, digest, step = record.get("state"), record.get("sha256"), record.get("global_step")
    if not isinstance(body, dict) or not isinstance(digest, str) or type(step) is not int:
        raise FormatError(f"a {FORMAT} record needs 'state', 'sha256' and 'global_step'")
    actual = _digest(body, step)
    if actual != digest:
        raise IntegrityError("its SHA-256 does not match its content (edited or damaged)",
                             expected=digest, actual=actual)
    if step != global_step:
        raise IntegrityError(f"it was saved at global step {step}, the checkpoint is at "
                             f"step {global_step}")
    state = _decode(body)
    assert isinstance(state, dict)
    return state


def _digest(body: Any, global_step: int) -> str:
    canonical = json.dumps({"global_step": global_step, "state": body}, sort_keys=True,
                           separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _encode(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return {"tensor": {"dtype": CODES[obj.dtype], "shape": list(obj.shape),
                           "data": base64.b64encode(host_bytes(obj)).decode()}}
    if isinstance(obj, Mapping):
        return {str(k): _encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):  # NaN is not valid JSON
        return {"float": str(obj)}
    return obj


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict) and obj.keys() == {"tensor"}:
        return _tensor(obj["tensor"])
    if isinstance(obj, dict) and obj.keys() == {"float"}:
        return float(obj["float"])
    if isinstance(obj, dict):
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


def _tensor(spec: Any) -> torch.Tensor:
    try:
        dtype = DTYPES[spec["dtype"]]
        shape = [int(n) for n in spec["shape"]]
        raw = base64.b64decode(spec["data"], validate=True)
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise FormatError(f"a tensor entry is malformed ({exc})") from None
    if len(raw) != numel_bytes(shape, dtype):
        raise FormatError(f"a tensor entry holds {len(raw)} bytes, its shape {shape} needs "
                          f"{numel_bytes(shape, dtype)}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
