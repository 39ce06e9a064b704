"""Inference integrity: run-to-run consistency and golden outputs.

A model that loads may still compute wrong answers. Two checks catch it:

``consistency_check(model, sample, runs=2)``
    Runs the model several times on one sample (eval mode, no autograd) and
    compares the outputs, bitwise and within a dtype-aware tolerance. A device
    that sometimes returns a wrong element shows up as a difference, with the
    run, output and element named.

``record(model, inputs, path)`` / ``check(model, path)``
    A golden file stores the inputs (and their fingerprint), the weights'
    fingerprint, and per output: a summary (mean, std, min, max, non-finite
    count), exact values at fixed sampled positions and a SHA-256 digest of
    the full output, plus the environment. ``check`` reruns the inputs and
    names the part that failed. On the same environment the comparison is
    exact: the digest catches any change of any output bit, which is what a
    single flipped weight bit usually causes (a mean/max/std check within
    1e-4 misses most of those). Across devices or versions, where bitwise
    equality is not expected, sampled values and statistics are compared
    within tolerances instead. When outputs differ, the weights are hashed
    and compared with the recorded fingerprint, so the report says whether
    the weights changed (and which tensor) or the computation did.

>>> import torch, torchverity
>>> model = torch.nn.Linear(4, 2)
>>> torchverity.consistency_check(model, torch.ones(3, 4)).ok
True
"""

from __future__ import annotations

import base64
import itertools
import json
import math
import os
import platform
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from torchverity._tensors import dtype_name, host_bytes, iter_leaves
from torchverity.checkpoint._fingerprint import Fingerprint, fingerprint
from torchverity.errors import FormatError, InputError, UsageError

GOLDEN_FORMAT = "torchverity-golden"
GOLDEN_VERSION = 1
DEFAULT_SAMPLE_SIZE = 64
Scope = Literal["repeat", "cross"]
STATS = ("mean", "std", "min", "max")

# (rtol, atol) per dtype. "repeat": the same computation twice on one device,
# where only reduced-precision rounding may legitimately move results (the
# torch.testing defaults). "cross": another device, library version or
# compiler; float32 allows TF32, which cuDNN uses for convolutions by default.
_TOLERANCES: dict[Scope, dict[torch.dtype, tuple[float, float]]] = {
    "repeat": {
        torch.float64: (1e-7, 1e-7),
        torch.float32: (1.3e-6, 1e-5),
        torch.float16: (1e-3, 1e-5),
        torch.bfloat16: (1.6e-2, 1e-5),
    },
    "cross": {
        torch.float64: (1e-5, 1e-8),
        torch.float32: (1e-3, 1e-4),
        torch.float16: (1e-2, 1e-3),
        torch.bfloat16: (5e-2, 1e-2),
    },
}


def tolerance(dtype: torch.dtype, scope: Scope = "repeat") -> tuple[float, float]:
    """Default ``(rtol, atol)`` for ``dtype``; integers and bools compare exactly."""
    return _TOLERANCES[scope].get(dtype, (0.0, 0.0))


# ------------------------------------------------------------ comparing outputs


@dataclass(frozen=True)
class Comparison:
    """How one output tensor compares with its reference.

    ``worst_index`` is the element whose difference is largest relative to
    what the tolerance allows there (the first failing element to look at).
    """

    name: str
    identical: bool
    within_tolerance: bool
    max_abs_diff: float
    mismatched: int
    numel: int
    worst_index: tuple[int, ...] | None
    expected: float | None
    actual: float | None
    rtol: float
    atol: float

    @property
    def where(self) -> str | None:
        if self.worst_index is None:
            return None
        return f"output '{self.name}' at {_fmt_index(self.worst_index)}"


def unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    """The multi-dimensional index of flat position ``flat`` in ``shape``."""
    index = []
    for size in reversed(shape):
        flat, rest = divmod(flat, size) if size else (flat, 0)
        index.append(rest)
    return tuple(reversed(index))


def _fmt_index(index: Sequence[int]) -> str:
    return "[" + ", ".join(str(i) for i in index) + "]"


def compare_tensors(
    name: str, expected: torch.Tensor, actual: torch.Tensor, rtol: float, atol: float
) -> Comparison:
    """Compare bitwise and within ``atol + rtol*|expected|`` (NaN equals NaN)."""
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        raise UsageError(
            f"output '{name}' changed form: {dtype_name(expected.dtype)}{list(expected.shape)}"
            f" -> {dtype_name(actual.dtype)}{list(actual.shape)}"
        )
    exp = expected.detach().to(actual.device)
    identical = bitwise_equal(exp, actual.detach())
    if identical or exp.numel() == 0:
        return Comparison(name, True, True, 0.0, 0, exp.numel(), None, None, None, rtol, atol)
    e, a = exp.double(), actual.detach().double()
    both_nan = torch.isnan(e) & torch.isnan(a)
    diff = torch.where(both_nan, torch.zeros_like(e), (a - e).abs())
    diff = torch.nan_to_num(diff, nan=math.inf)  # NaN on one side only is infinitely off
    allowed = atol + rtol * e.abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    excess = diff / allowed.clamp_min(torch.finfo(torch.float64).tiny)
    bad = diff > allowed
    flat = int(torch.argmax(excess.reshape(-1)).item())
    index = unravel(flat, tuple(e.shape))
    return Comparison(
        name=name,
        identical=False,
        within_tolerance=not bool(bad.any()),
        max_abs_diff=float(diff.max()),
        mismatched=int(bad.sum()),
        numel=e.numel(),
        worst_index=index,
        expected=float(e.reshape(-1)[flat]),
        actual=float(a.reshape(-1)[flat]),
        rtol=rtol,
        atol=atol,
    )


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (-0.0 differs from 0.0; NaN payloads count)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    from torchverity._tensors import byte_view

    return bool(torch.equal(byte_view(a), byte_view(b)))


def output_leaves(outputs: Any) -> list[tuple[str, torch.Tensor]]:
    """Flatten model outputs (tensor, tuple, dict, HF ModelOutput) to named tensors."""
    leaves = [(n or "output", v) for n, v in iter_leaves(outputs)]
    return [(n, v) for n, v in leaves if isinstance(v, torch.Tensor)]


# ------------------------------------------------------------ running the model


def call_model(model: Any, inputs: Any) -> Any:
    """``model(x)`` for a tensor, ``model(*x)`` for a tuple/list, ``model(**x)`` for a dict."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


@contextmanager
def inference_mode(model: Any) -> Iterator[None]:
    """Eval mode and no autograd; restores every submodule's previous training flag."""
    modules = list(model.modules()) if isinstance(model, torch.nn.Module) else []
    flags = [m.training for m in modules]
    try:
        for m in modules:
            m.training = False
        with torch.no_grad():
            yield
    finally:
        for m, flag in zip(modules, flags, strict=True):
            m.training = flag


def model_device(model: Any) -> torch.device:
    if isinstance(model, torch.nn.Module):
        first = next(itertools.chain(model.parameters(), model.buffers()), None)
        if first is not None:
            return first.device
    return torch.device("cpu")


def _to_device(inputs: Any, device: torch.device) -> Any:
    if isinstance(inputs, torch.Tensor):
        return inputs.to(device)
    if isinstance(inputs, Mapping):
        return {k: _to_device(v, device) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_to_device(v, device) for v in inputs)
    return inputs


# ------------------------------------------------------------ consistency check


@dataclass(frozen=True)
class ConsistencyResult:
    """Outcome of :func:`consistency_check`.

    ``mode`` is ``exact`` when any bit difference fails the check (CPU, or
    deterministic algorithms enabled) and ``tolerance`` otherwise. ``run`` is
    the first run (0-based) whose outputs differed from run 0; ``where`` names
    the output and element with the worst difference.
    """

    ok: bool
    mode: str
    runs: int
    identical: bool
    within_tolerance: bool
    max_abs_diff: float
    run: int | None
    where: str | None
    expected: float | None
    actual: float | None
    differing_outputs: tuple[str, ...]

    def summary(self) -> str:
        if self.identical:
            return f"consistent: {self.runs} runs gave bitwise identical outputs"
        verdict = "consistent within tolerance" if self.ok else "INCONSISTENT"
        return (
            f"{verdict} ({self.mode} mode): run {self.run} differs from run 0 at {self.where}: "
            f"{self.expected!r} vs {self.actual!r} (max abs diff {self.max_abs_diff:.3g})"
        )


def consistency_check(
    model: Any,
    sample: Any,
    runs: int = 2,
    *,
    exact: bool | None = None,
    rtol: float | None = None,
    atol: float | None = None,
) -> ConsistencyResult:
    """Run ``model`` on ``sample`` ``runs`` times and compare every run with the first.

    ``exact=None`` requires bitwise equality on the CPU and when
    ``torch.use_deterministic_algorithms(True)`` is on, and accepts differences
    within the dtype-aware ``repeat`` tolerance otherwise (GPU kernels may
    reorder reductions between runs). Explicit ``rtol``/``atol`` override it.
    """
    if runs < 2:
        raise UsageError(f"consistency_check needs runs >= 2, got {runs}")
    device = model_device(model)
    if exact is None:
        exact = device.type == "cpu" or torch.are_deterministic_algorithms_enabled()
    sample = _to_device(sample, device)
    with inference_mode(model):
        reference = output_leaves(call_model(model, sample))
        first_bad: tuple[int, list[Comparison]] | None = None
        for run in range(1, runs):
            comps = _compare_runs(reference, output_leaves(call_model(model, sample)), rtol, atol)
            if first_bad is None and any(not c.identical for c in comps):
                first_bad = (run, comps)
    return _consistency_result(runs, exact, first_bad)


def _compare_runs(
    reference: list[tuple[str, torch.Tensor]],
    current: list[tuple[str, torch.Tensor]],
    rtol: float | None,
    atol: float | None,
) -> list[Comparison]:
    if [n for n, _ in reference] != [n for n, _ in current]:
        raise UsageError(
            "the model returned different outputs between runs: "
            f"{[n for n, _ in reference]} vs {[n for n, _ in current]}"
        )
    comps = []
    for (name, ref), (_, cur) in zip(reference, current, strict=True):
        d_rtol, d_atol = tolerance(ref.dtype, "repeat")
        comps.append(compare_tensors(
            name, ref, cur, d_rtol if rtol is None else rtol, d_atol if atol is None else atol
        ))
    return comps


def _consistency_result(
    runs: int, exact: bool, first_bad: tuple[int, list[Comparison]] | None
) -> ConsistencyResult:
    mode = "exact" if exact else "tolerance"
    if first_bad is None:
        return ConsistencyResult(True, mode, runs, True, True, 0.0, None, None, None, None, ())
    run, comps = first_bad
    differing = [c for c in comps if not c.identical]
    within = all(c.within_tolerance for c in comps)
    worst = max(differing, key=lambda c: (not c.within_tolerance, c.max_abs_diff))
    return ConsistencyResult(
        ok=within and not exact,
        mode=mode,
        runs=runs,
        identical=False,
        within_tolerance=within,
        max_abs_diff=max(c.max_abs_diff for c in differing),
        run=run,
        where=worst.where,
        expected=worst.expected,
        actual=worst.actual,
        differing_outputs=tuple(c.name for c in differing),
    )


# ------------------------------------------------------------ environment


def environment(device: torch.device) -> dict[str, Any]:
    """What determines the exact bits an inference produces on ``device``."""
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device.type,
        "device_name": device_name(device),
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32 if device.type == "cuda" else None,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32 if device.type == "cuda" else None,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }
    return env


# Keys whose change can legitimately change output bits.
_IDENTITY_KEYS = (
    "torch", "device", "device_name", "threads", "cpu_capability", "cuda", "cudnn",
    "tf32_matmul", "tf32_cudnn",
)


def environment_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    return [
        f"{k}: {recorded.get(k)!r} -> {current.get(k)!r}"
        for k in _IDENTITY_KEYS
        if recorded.get(k) != current.get(k)
    ]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    if device.type == "cpu":
        return _cpu_model()
    return device.type


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ------------------------------------------------------------ golden records


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "call": self.call,
            "input_fingerprint": self.input_fingerprint,
            "model_fingerprint": self.model_fingerprint.root if self.model_fingerprint else None,
            "outputs": [_output_to_json(o) for o in self.outputs],
            "environment": self.environment,
            "created": self.created,
        }


@dataclass(frozen=True)
class GoldenFailure:
    """One part of a golden check that failed.

    ``part`` is ``inputs`` (the golden file's inputs are damaged), ``structure``
    (output names, shapes or dtypes), ``digest`` (full-output digest, exact
    mode), ``sample`` (sampled exact values), ``summary`` (a statistic moved;
    ``stat`` names it), ``nonfinite`` (NaN/Inf count) or ``weights`` (the
    weights differ from the recorded ones; ``output`` names the tensors).
    """

    part: str
    output: str
    message: str
    stat: str | None = None
    expected: Any = None
    actual: Any = None


@dataclass(frozen=True)
class GoldenResult:
    """Outcome of :func:`check`. ``mode`` is ``exact`` or ``tolerance``."""

    ok: bool
    failures: list[GoldenFailure]
    path: str
    mode: str
    environment_differences: tuple[str, ...]
    outputs: tuple[str, ...]
    weights_changed: tuple[str, ...] | None
    seconds: float

    @property
    def parts(self) -> list[str]:
        """The distinct failed parts, in report order."""
        return list(dict.fromkeys(f.part for f in self.failures))


def record(
    model: Any,
    inputs: Any,
    path: str | os.PathLike[str],
    *,
    sample_size: int = DEFAULT_SAMPLE_SIZE,
) -> GoldenRecord:
    """Run ``model`` on ``inputs`` and write a golden file to ``path`` (JSON).

    ``inputs`` is a tensor (``model(x)``), a tuple/list of tensors
    (``model(*x)``) or a dict of tensors (``model(**x)``); they are stored in
    the file, so keep them small (a few samples).
    """
    call, named = _named_inputs(inputs)
    device = model_device(model)
    with inference_mode(model):
        outputs = output_leaves(call_model(model, _to_device(_rebuild(call, named), device)))
    rec = GoldenRecord(
        path=os.fspath(path),
        call=call,
        input_fingerprint=fingerprint(named, mode="exact").root,
        model_fingerprint=_model_fingerprint(model),
        outputs=tuple(_output_record(n, t, sample_size) for n, t in outputs),
        environment=environment(device),
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    _write(Path(path), rec, named)
    return rec


def check(
    model: Any,
    path: str | os.PathLike[str],
    *,
    exact: bool | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    weights: bool = False,
) -> GoldenResult:
    """Rerun the golden inputs through ``model`` and compare with the file at ``path``.

    ``exact=None`` compares bitwise when the environment matches the recorded
    one and within the ``cross`` tolerances (or ``rtol``/``atol``) otherwise.
    The weights are compared with the recorded fingerprint when outputs fail,
    or always with ``weights=True``.
    """
    start = time.perf_counter()
    rec, named = load_record(path)
    device = model_device(model)
    env_diff = environment_differences(rec.environment, environment(device))
    exact = not env_diff if exact is None else exact
    failures = _check_inputs(rec, named)
    if not failures:
        with inference_mode(model):
            sample = _to_device(_rebuild(rec.call, named), device)
            outputs = output_leaves(call_model(model, sample))
        failures = _check_outputs(rec, outputs, exact, rtol, atol)
    changed = None
    if (failures or weights) and rec.model_fingerprint is not None:
        changed = _changed_weights(rec.model_fingerprint, model)
        if changed:
            failures.append(_weights_failure(changed))
    return GoldenResult(
        ok=not failures,
        failures=failures,
        path=os.fspath(path),
        mode="exact" if exact else "tolerance",
        environment_differences=tuple(env_diff),
        outputs=tuple(o.name for o in rec.outputs),
        weights_changed=tuple(changed) if changed is not None else None,
        seconds=time.perf_counter() - start,
    )


def _named_inputs(inputs: Any) -> tuple[str, dict[str, torch.Tensor]]:
    if isinstance(inputs, torch.Tensor):
        call, items = "tensor", [("input", inputs)]
    elif isinstance(inputs, Mapping):
        call, items = "kwargs", [(str(k), v) for k, v in inputs.items()]
    elif isinstance(inputs, (tuple, list)):
        call, items = "args", [(str(i), v) for i, v in enumerate(inputs)]
    else:
        raise UsageError(
            f"golden inputs must be a tensor, a tuple/list or a dict of tensors, "
            f"not {type(inputs).__name__}"
        )
    bad = [n for n, v in items if not isinstance(v, torch.Tensor)]
    if bad:
        raise UsageError(f"golden inputs must all be tensors; not a tensor: {', '.join(bad)}")
    return call, {n: v.detach() for n, v in items}


def _rebuild(call: str, named: dict[str, torch.Tensor]) -> Any:
    if call == "tensor":
        return named["input"]
    if call == "args":
        return tuple(named[str(i)] for i in range(len(named)))
    return dict(named)


def _model_fingerprint(model: Any) -> Fingerprint | None:
    if not isinstance(model, torch.nn.Module):
        return None
    return fingerprint(model.state_dict())


def _changed_weights(recorded: Fingerprint, model: Any) -> list[str] | None:
    if not isinstance(model, torch.nn.Module):
        return None
    current = fingerprint(model.state_dict(), mode=recorded.algo)  # the record's own algorithm
    return recorded.differing(current)


def _weights_failure(changed: list[str]) -> GoldenFailure:
    shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
    return GoldenFailure(
        part="weights",
        output=shown,
        message=f"the weights differ from those recorded: {len(changed)} tensor(s) changed "
        f"({shown}); compare checkpoints with: torchverity diff OLD NEW",
    )


def _output_record(name: str, tensor: torch.Tensor, sample_size: int) -> OutputRecord:
    index = _sample_positions(tensor.numel(), sample_size)
    flat = tensor.detach().reshape(-1)
    values = flat[torch.tensor(index, dtype=torch.long, device=flat.device)].double().cpu()
    summary, nonfinite = _summary(tensor)
    return OutputRecord(
        name=name,
        dtype=dtype_name(tensor.dtype),
        shape=tuple(tensor.shape),
        digest=fingerprint({name: tensor}, mode="exact").entries[0].digest,
        summary=summary,
        nonfinite=nonfinite,
        sample_index=tuple(index),
        sample_values=tuple(values.tolist()),
    )


def _sample_positions(numel: int, size: int) -> list[int]:
    """Evenly spread flat positions, always including the first and last element."""
    if numel <= size:
        return list(range(numel))
    step = (numel - 1) / (size - 1)
    return sorted({round(i * step) for i in range(size)})


def _summary(tensor: torch.Tensor) -> tuple[dict[str, float], int]:
    x = tensor.detach().double()
    finite = torch.isfinite(x)
    nonfinite = int((~finite).sum())
    values = x[finite] if nonfinite else x.reshape(-1)
    if values.numel() == 0:
        return dict.fromkeys(STATS, math.nan), nonfinite
    stats = torch.stack([values.mean(), values.std(correction=0), values.min(), values.max()])
    return dict(zip(STATS, stats.cpu().tolist(), strict=True)), nonfinite


# ------------------------------------------------------------ comparing with a record


def _check_inputs(rec: GoldenRecord, named: dict[str, torch.Tensor]) -> list[GoldenFailure]:
    actual = fingerprint(named, mode="exact").root
    if actual == rec.input_fingerprint:
        return []
    return [GoldenFailure(
        part="inputs", output="-",
        message="the golden file's stored inputs do not match their recorded fingerprint "
        "(the golden file is damaged); record it again from a trusted model",
        expected=rec.input_fingerprint, actual=actual,
    )]


def _check_outputs(
    rec: GoldenRecord,
    outputs: list[tuple[str, torch.Tensor]],
    exact: bool,
    rtol: float | None,
    atol: float | None,
) -> list[GoldenFailure]:
    now = {n: t for n, t in outputs}
    failures: list[GoldenFailure] = []
    for out in rec.outputs:
        tensor = now.get(out.name)
        form = f"{out.dtype}{list(out.shape)}"
        got = "missing" if tensor is None else f"{dtype_name(tensor.dtype)}{list(tensor.shape)}"
        if tensor is None or got != form:
            failures.append(GoldenFailure(
                "structure", out.name, f"output '{out.name}' was {form}, now {got}",
                None, form, got,
            ))
            continue
        d_rtol, d_atol = tolerance(tensor.dtype, "cross")
        tol = (0.0, 0.0) if exact else (
            d_rtol if rtol is None else rtol, d_atol if atol is None else atol
        )
        failures += _compare_output(out, tensor, exact, tol)
    extra = sorted(set(now) - {o.name for o in rec.outputs})
    failures += [
        GoldenFailure("structure", n, f"output '{n}' was not recorded") for n in extra
    ]
    return failures


def _compare_output(
    out: OutputRecord, tensor: torch.Tensor, exact: bool, tol: tuple[float, float]
) -> list[GoldenFailure]:
    failures: list[GoldenFailure] = []
    digest = fingerprint({out.name: tensor}, mode="exact").entries[0].digest
    if exact and digest != out.digest:
        failures.append(GoldenFailure(
            "digest", out.name, f"the digest of the full output '{out.name}' differs "
            "(at least one output bit changed)", None, out.digest, digest,
        ))
    if not exact or digest != out.digest:
        failures += _compare_sample(out, tensor, tol)
        failures += _compare_summary(out, tensor, tol)
    return failures


def _compare_sample(
    out: OutputRecord, tensor: torch.Tensor, tol: tuple[float, float]
) -> list[GoldenFailure]:
    index = torch.tensor(out.sample_index, dtype=torch.long, device=tensor.device)
    actual = tensor.detach().reshape(-1)[index].double().cpu()
    expected = torch.tensor(out.sample_values, dtype=torch.float64)
    cmp = compare_tensors(out.name, expected, actual, *tol)
    if cmp.within_tolerance or cmp.worst_index is None:
        return []
    flat = out.sample_index[cmp.worst_index[0]]
    where = _fmt_index(unravel(flat, out.shape))
    return [GoldenFailure(
        "sample", out.name,
        f"{cmp.mismatched} of {cmp.numel} sampled values of '{out.name}' differ; worst at "
        f"{where}: recorded {cmp.expected!r}, now {cmp.actual!r}",
        None, cmp.expected, cmp.actual,
    )]


def _compare_summary(
    out: OutputRecord, tensor: torch.Tensor, tol: tuple[float, float]
) -> list[GoldenFailure]:
    summary, nonfinite = _summary(tensor)
    failures: list[GoldenFailure] = []
    if nonfinite != out.nonfinite:
        failures.append(GoldenFailure(
            "nonfinite", out.name,
            f"'{out.name}' had {out.nonfinite} NaN/Inf values, now {nonfinite}",
            None, out.nonfinite, nonfinite,
        ))
    rtol, atol = tol
    # Statistics move with the whole output, so scale the tolerance by its magnitude.
    scale = max(abs(out.summary["min"]), abs(out.summary["max"]), 0.0)
    for stat in STATS:
        was, now = out.summary[stat], summary[stat]
        if _same_number(was, now) or abs(now - was) <= atol + rtol * scale:
            continue
        failures.append(GoldenFailure(
            "summary", out.name,
            f"{stat} of '{out.name}' moved: recorded {was!r}, now {now!r} (Δ {now - was:+.3g})",
            stat, was, now,
        ))
    return failures


def _same_number(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


# ------------------------------------------------------------ the golden file (JSON)


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
        raise FormatError(f"{p}: not a readable golden file: {exc}", path=p) from None
    if not isinstance(doc, dict) or doc.get("format") != GOLDEN_FORMAT:
        raise FormatError(f"{p}: not a torchverity golden file (no format marker)", path=p)
    if doc.get("version") != GOLDEN_VERSION:
        raise FormatError(
            f"{p}: golden file version {doc.get('version')!r} is not supported "
            f"(this torchverity reads version {GOLDEN_VERSION})", path=p,
            hint="record it again with this torchverity version",
        )
    try:
        named = {t["name"]: _decode_tensor(t) for t in doc["inputs"]["tensors"]}
        model = Fingerprint.from_dict(doc["model"]) if doc.get("model") else None
        rec = GoldenRecord(
            path=os.fspath(p),
            call=str(doc["inputs"]["call"]),
            input_fingerprint=str(doc["inputs"]["fingerprint"]),
            model_fingerprint=model,
            outputs=tuple(_output_from_json(o) for o in doc["outputs"]),
            environment=dict(doc["environment"]),
            created=str(doc.get("created", "")),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise FormatError(f"{p}: malformed golden file: {exc!r}", path=p) from None
    return rec, named


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
