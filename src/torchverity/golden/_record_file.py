"""The golden file: records of inputs and outputs as JSON (docs/formats/golden.md)."""

from __future__ import annotations

import base64
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchverity._tensors import dtype_name, host_bytes
from torchverity.checkpoint._fingerprint import Fingerprint
from torchverity.errors import FormatError, InputError
from torchverity.golden._draw import InputDraw

GOLDEN_FORMAT = "torchverity-golden"

STATS = ("mean", "std", "min", "max")  # the summary statistics recorded per output


GOLDEN_VERSION = 1
# A golden file is what `golden record` writes: a damaged one is recorded again.
_RECORD_AGAIN = ("record it again from the trusted model: torchverity golden record --model M:F "
                 "--weights W --golden FILE")


@dataclass(frozen=True)
class OutputRecord:
    """What a golden file keeps about one output tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    digest: str
    summary: dict[str, float]
    nonfinite: int
    sample_index: tuple[int, ...]
    sample_values: tuple[float, ...]


@dataclass(frozen=True)
class GoldenRecord:
    """A golden file: inputs, weights fingerprint, output records and environment."""

    path: str
    call: str
    input_fingerprint: str
    model_fingerprint: Fingerprint | None
    outputs: tuple[OutputRecord, ...]
    environment: dict[str, Any]
    created: str
    inputs_drawn: InputDraw | None = None  # how seeded inputs were drawn; None when given

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "call": self.call,
            "input_fingerprint": self.input_fingerprint,
            "inputs_drawn": self.inputs_drawn.to_dict() if self.inputs_drawn else None,
            "model_fingerprint": self.model_fingerprint.root if self.model_fingerprint else None,
            "outputs": [_output_to_json(o) for o in self.outputs],
            "environment": self.environment,
            "created": self.created,
        }


def _encode_number(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def _output_to_json(o: OutputRecord) -> dict[str, Any]:
    return {
        "name": o.name,
        "dtype": o.dtype,
        "shape": list(o.shape),
        "digest": o.digest,
        "summary": {k: _encode_number(v) for k, v in o.summary.items()},
        "nonfinite": o.nonfinite,
        "sample": {"index": list(o.sample_index),
                   "values": [_encode_number(v) for v in o.sample_values]},
    }


def _output_from_json(d: Mapping[str, Any]) -> OutputRecord:
    return OutputRecord(
        name=str(d["name"]),
        dtype=str(d["dtype"]),
        shape=tuple(int(s) for s in d["shape"]),
        digest=str(d["digest"]),
        summary={k: float(d["summary"][k]) for k in STATS},
        nonfinite=int(d["nonfinite"]),
        sample_index=tuple(int(i) for i in d["sample"]["index"]),
        sample_values=tuple(float(v) for v in d["sample"]["values"]),
    )


def _write(path: Path, rec: GoldenRecord, named: dict[str, torch.Tensor]) -> None:
    from torchverity.digest import atomic_write_text

    doc = {
        "format": GOLDEN_FORMAT,
        "version": GOLDEN_VERSION,
        "created": rec.created,
        "environment": rec.environment,
        "inputs": {
            "call": rec.call,
            "fingerprint": rec.input_fingerprint,
            "drawn": rec.inputs_drawn.to_dict() if rec.inputs_drawn else None,
            "tensors": [
                {"name": n, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
                 "data": base64.b64encode(host_bytes(t)).decode("ascii")}
                for n, t in named.items()
            ],
        },
        "model": rec.model_fingerprint.to_dict() if rec.model_fingerprint else None,
        "outputs": [_output_to_json(o) for o in rec.outputs],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(doc, indent=1, allow_nan=False) + "\n")


def load_record(path: str | os.PathLike[str]) -> tuple[GoldenRecord, dict[str, torch.Tensor]]:
    """Read a golden file: the record and its stored input tensors."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(
            f"{p}: no such golden file", path=p,
            hint="create it with: torchverity golden record --model M:F --weights W --golden FILE",
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{p}: not a readable golden file: {exc}", path=p,
                          hint=_RECORD_AGAIN) from None
    except RecursionError:
        raise FormatError(f"{p}: not a golden file: nested too deeply", path=p,
                          hint=_RECORD_AGAIN) from None
    if not isinstance(doc, dict) or doc.get("format") != GOLDEN_FORMAT:
        raise FormatError(f"{p}: not a torchverity golden file (no format marker)", path=p,
                          hint=_RECORD_AGAIN)
    if type(doc.get("version")) is not int or doc["version"] != GOLDEN_VERSION:
        raise FormatError(
            f"{p}: golden file version {doc.get('version')!r} is not supported "
            f"(this torchverity reads version {GOLDEN_VERSION})", path=p,
            hint="record it again with this torchverity version",
        )
    _check_shape(p, doc)
    try:
        named = {t["name"]: _decode_tensor(t) for t in doc["inputs"]["tensors"]}
        model = Fingerprint.from_dict(doc["model"]) if doc.get("model") else None
        drawn = doc["inputs"].get("drawn")
        rec = GoldenRecord(
            path=os.fspath(p),
            call=str(doc["inputs"]["call"]),
            input_fingerprint=str(doc["inputs"]["fingerprint"]),
            model_fingerprint=model,
            outputs=tuple(_output_from_json(o) for o in doc["outputs"]),
            environment=dict(doc["environment"]),
            created=str(doc.get("created", "")),
            inputs_drawn=InputDraw.from_dict(drawn) if drawn is not None else None,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise FormatError(f"{p}: malformed golden file: {exc!r}", path=p) from None
    return rec, named


def _check_shape(p: Path, doc: dict[str, Any]) -> None:
    """The containers the record is read from, with their documented types."""
    inputs, outputs, model = doc.get("inputs"), doc.get("outputs"), doc.get("model")
    ok = (isinstance(inputs, dict) and isinstance(inputs.get("tensors"), list)
          and isinstance(outputs, list) and outputs
          and all(isinstance(o, dict) for o in outputs)
          and (model is None or isinstance(model, dict)))
    if not ok:
        raise FormatError(f"{p}: malformed golden file: 'inputs', 'outputs' (a non-empty "
                          "list) or 'model' has the wrong shape", path=p,
                          hint="record it again with torchverity golden record")


def _decode_tensor(entry: Mapping[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, str(entry["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {entry['dtype']!r}")
    shape = [int(s) for s in entry["shape"]]
    # Not validating here is 5x faster; the input fingerprint check catches damage.
    raw = bytearray(base64.b64decode(entry["data"]))
    if len(raw) != math.prod(shape) * torch.empty((), dtype=dtype).element_size():
        raise ValueError(f"input '{entry['name']}' holds {len(raw)} bytes, not {shape} x {dtype}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).reshape(shape)
