"""record and check: golden outputs of a model on fixed inputs, compared exactly on the same
environment and within tolerance across environments.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchverity._tensors import dtype_name
from torchverity.checkpoint._fingerprint import Fingerprint, fingerprint
from torchverity.errors import UsageError
from torchverity.golden._compare import (
    CompareMode,
    _fmt_index,
    compare_tensors,
    tolerance,
    unravel,
)
from torchverity.golden._draw import InputDraw
from torchverity.golden._environment import environment, environment_differences
from torchverity.golden._record_file import STATS, GoldenRecord, OutputRecord, _write, load_record
from torchverity.golden._run import (
    _to_device,
    call_model,
    inference_mode,
    model_device,
    output_leaves,
)

DEFAULT_SAMPLE_SIZE = 64


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
    mode: CompareMode
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
    the file, so keep them small (a few samples). An :class:`InputDraw`
    (:func:`draw_inputs`) is drawn into one tensor, and its parameters are
    recorded with it.
    """
    drawn = inputs if isinstance(inputs, InputDraw) else None
    call, named = _named_inputs(drawn.tensor() if drawn is not None else inputs)
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
        inputs_drawn=drawn,
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
    weights: bool | None = None,
) -> GoldenResult:
    """Rerun the golden inputs through ``model`` and compare with the file at ``path``.

    ``exact=None`` compares bitwise when the environment matches the recorded
    one and within the ``cross`` tolerances (or ``rtol``/``atol``) otherwise.
    The weights are compared with the recorded fingerprint whenever the record
    holds one (``weights=None``, the default: exact, and cheaper than the model
    run, it catches a weight change that moves no output bit on the golden
    inputs); ``weights=False`` compares them only when outputs fail.
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
    if (failures or weights is not False) and rec.model_fingerprint is not None:
        changed = _changed_weights(rec.model_fingerprint, model)
        if changed:
            failures.append(_weights_failure(changed, set(rec.model_fingerprint.tensors),
                                             _tensor_names(model)))
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


def _tensor_names(model: Any) -> set[str]:
    return set(model.state_dict()) if isinstance(model, torch.nn.Module) else set()


def _weights_failure(changed: list[str], recorded: set[str], current: set[str]) -> GoldenFailure:
    """The weights' failure, telling tensors whose values changed from tensors on one side
    only (a model with layers the recorded one lacked is another model, not damage)."""
    shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
    kinds = (("changed", [n for n in changed if n in recorded and n in current]),
             ("not in the record", [n for n in changed if n not in recorded]),
             ("recorded but not in the model", [n for n in changed if n not in current]))
    parts = [f"{len(names)} {what} ({', '.join(names[:5])}{' ...' if len(names) > 5 else ''})"
             for what, names in kinds if names]
    return GoldenFailure(
        part="weights",
        output=shown,
        message=f"the weights differ from those recorded: {'; '.join(parts)}",
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
