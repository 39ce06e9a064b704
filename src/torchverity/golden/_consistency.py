"""consistency_check: one sample run several times, outputs compared bitwise and within
tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from torchverity.errors import UsageError
from torchverity.golden._compare import CompareMode, Comparison, compare_tensors, tolerance
from torchverity.golden._run import (
    _to_device,
    call_model,
    inference_mode,
    model_device,
    output_leaves,
)


@dataclass(frozen=True)
class ConsistencyResult:
    """Outcome of :func:`consistency_check`.

    ``mode`` is ``exact`` when any bit difference fails the check (CPU, or
    deterministic algorithms enabled) and ``tolerance`` otherwise. ``run`` is
    the first run (0-based) whose outputs differed from run 0; ``where`` names
    the output and element with the worst difference.
    """

    ok: bool
    mode: CompareMode
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
    mode: CompareMode = "exact" if exact else "tolerance"
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
