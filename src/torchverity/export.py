"""Export verification: does the exported or compiled model compute what eager PyTorch does?

``verify_export(model, sample, exported)`` runs the eager model and the other
form on the same sample and compares every output within dtype-aware
``cross`` tolerances (see :func:`torchverity.golden.tolerance`), reporting the
worst element. ``exported`` may be:

* an ``.onnx`` path or an ``onnx.ModelProto`` (run with ONNX Runtime, extra ``onnx``);
* a ``torch.export.ExportedProgram`` or a ``.pt2`` path saved by ``torch.export.save``;
* a TorchScript module, a ``torch.compile`` result or any other callable;
* one of the strings ``"onnx"``, ``"torch.export"``, ``"torchscript"``,
  ``"torch.compile"``: torchverity produces that form from ``model`` itself.

``torch.compile`` on a CPU needs a C++ compiler; without one that path is
reported as ``skipped`` with the reason instead of failing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchverity.errors import InputError, UsageError, require_extra
from torchverity.golden import Comparison, compare_tensors, tolerance
from torchverity.golden._run import call_model, inference_mode, output_leaves

BUILDERS = ("onnx", "torch.export", "torchscript", "torch.compile")


@dataclass(frozen=True)
class ExportResult:
    """Outcome of :func:`verify_export`. ``status`` is ``ok``, ``mismatch`` or ``skipped``."""

    ok: bool
    status: str
    kind: str
    reason: str | None
    max_abs_diff: float
    worst: str | None
    expected: float | None
    actual: float | None
    outputs: tuple[Comparison, ...]


def verify_export(
    model: torch.nn.Module,
    sample: Any,
    exported: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> ExportResult:
    """Compare eager ``model(sample)`` with ``exported`` on the same sample."""
    args = _positional(sample)
    with inference_mode(model):
        reference = output_leaves(call_model(model, sample))
        kind, run = _runner(model, args, exported)
        if run is None:
            return _skipped(kind, str(_cxx_missing_reason()))
        candidate = run(args)
    return _compare(kind, reference, candidate, rtol, atol)


def _positional(sample: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(sample, torch.Tensor):
        return (sample,)
    if isinstance(sample, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in sample):
        return tuple(sample)
    raise UsageError(
        "verify_export needs the sample as a tensor or a tuple of tensors (positional inputs)",
        hint="pass the same positional inputs the model was exported with",
    )


_Run = Callable[[tuple[torch.Tensor, ...]], list[torch.Tensor]]


def _runner(model: torch.nn.Module, args: tuple[torch.Tensor, ...],
            exported: Any) -> tuple[str, _Run | None]:
    if isinstance(exported, str) and exported in BUILDERS:
        return _build(model, args, exported)
    if isinstance(exported, (str, os.PathLike)):
        return _from_file(Path(exported))
    if type(exported).__name__ == "ModelProto":
        return "onnx", _onnx_runner(exported.SerializeToString())
    if isinstance(exported, torch.export.ExportedProgram):
        return "torch.export", _module_runner(exported.module())
    if isinstance(exported, torch.jit.ScriptModule):
        return "torchscript", _module_runner(exported)
    if callable(exported):
        return type(exported).__name__, _module_runner(exported)
    raise UsageError(
        f"cannot verify a {type(exported).__name__}",
        hint=f"pass an .onnx/.pt2 path, an ExportedProgram, a callable or one of {BUILDERS}",
    )


def _build(model: torch.nn.Module, args: tuple[torch.Tensor, ...],
           kind: str) -> tuple[str, _Run | None]:
    if kind == "torch.export":
        return kind, _module_runner(torch.export.export(model, args).module())
    if kind == "torchscript":
        return kind, _module_runner(torch.jit.trace(model, args))
    if kind == "torch.compile":
        on_cpu = all(t.device.type == "cpu" for t in args)
        if on_cpu and _cxx_missing_reason():
            return kind, None
        return kind, _module_runner(torch.compile(model))
    return kind, _onnx_runner(_export_onnx(model, args))


def _export_onnx(model: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> bytes:
    require_extra("onnxscript", extra="onnx", feature="exporting to ONNX")
    with tempfile.TemporaryDirectory(prefix="torchverity-onnx-") as tmp:
        path = Path(tmp) / "model.onnx"
        torch.onnx.export(model, args, path, dynamo=True, external_data=False, verbose=False)
        return path.read_bytes()


def _from_file(path: Path) -> tuple[str, _Run]:
    if not path.is_file():
        raise InputError(f"{path}: no such exported model", path=path)
    if path.suffix == ".onnx":
        return "onnx", _onnx_runner(path)
    if path.suffix == ".pt2":
        return "torch.export", _module_runner(torch.export.load(path).module())
    raise UsageError(f"{path}: unknown exported model type '{path.suffix}'",
                     hint="use .onnx (ONNX) or .pt2 (torch.export.save)")


def _module_runner(module: Callable[..., Any]) -> _Run:
    def run(args: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        return [t for _, t in output_leaves(module(*args))]

    return run


def _onnx_runner(source: Path | bytes) -> _Run:
    ort = require_extra("onnxruntime", extra="onnx", feature="ONNX export verification")
    session = ort.InferenceSession(
        source if isinstance(source, bytes) else os.fspath(source),
        providers=["CPUExecutionProvider"],
    )
    inputs = session.get_inputs()
    names = [i.name for i in inputs]
    takes = ", ".join(f"{i.name}: {i.type} {i.shape}" for i in inputs)

    def run(args: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        if len(args) != len(names):
            raise UsageError(f"the ONNX graph takes {len(names)} input(s) ({', '.join(names)}), "
                             f"the sample has {len(args)}")
        feeds = {n: t.detach().cpu().numpy() for n, t in zip(names, args, strict=True)}
        try:
            outputs = session.run(None, feeds)
        except Exception as exc:  # onnxruntime's own errors share no importable base class
            first = (str(exc).strip().splitlines() or [""])[0]
            given = ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
                              for t in args)
            raise UsageError(f"the ONNX graph refused the sample ({given}): {first}",
                             hint=f"pass the inputs the model was exported with; the graph "
                                  f"takes {takes}") from None
        return [torch.from_numpy(o) for o in outputs]

    return run


def _cxx_missing_reason() -> str | None:
    """Why torch.compile cannot build CPU kernels here, or None when a C++ compiler exists."""
    candidates = [os.environ.get("CXX") or "", "g++", "c++", "clang++"]
    if any(c and shutil.which(c) for c in candidates):
        return None
    return "torch.compile on the CPU needs a C++ compiler and none was found (install g++)"


def _skipped(kind: str, reason: str) -> ExportResult:
    return ExportResult(True, "skipped", kind, reason, 0.0, None, None, None, ())


def _compare(kind: str, reference: Sequence[tuple[str, torch.Tensor]],
             candidate: Sequence[torch.Tensor], rtol: float | None,
             atol: float | None) -> ExportResult:
    if len(reference) != len(candidate):
        reason = f"eager returns {len(reference)} output(s), {kind} returns {len(candidate)}"
        return ExportResult(False, "mismatch", kind, reason, float("inf"), None, None, None, ())
    comps: list[Comparison] = []
    for (name, ref), got in zip(reference, candidate, strict=True):
        if tuple(got.shape) != tuple(ref.shape):
            reason = f"output '{name}' has shape {list(got.shape)}, eager {list(ref.shape)}"
            return ExportResult(False, "mismatch", kind, reason, float("inf"), None, None, None,
                                tuple(comps))
        d_rtol, d_atol = tolerance(ref.dtype, "cross")
        comps.append(compare_tensors(
            name, ref, got.to(device=ref.device, dtype=ref.dtype),
            d_rtol if rtol is None else rtol, d_atol if atol is None else atol,
        ))
    worst = max(comps, key=lambda c: (not c.within_tolerance, c.max_abs_diff), default=None)
    ok = all(c.within_tolerance for c in comps)
    return ExportResult(
        ok=ok,
        status="ok" if ok else "mismatch",
        kind=kind,
        reason=None,
        max_abs_diff=max((c.max_abs_diff for c in comps), default=0.0),
        worst=worst.where if worst else None,
        expected=worst.expected if worst else None,
        actual=worst.actual if worst else None,
        outputs=tuple(comps),
    )
