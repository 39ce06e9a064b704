"""The one training loop the guard's tests run, with its tiny model, data and fault plans.

Guards built here verify at rest in two passes (``fused=False``) unless a test asks for
the fused update: compiling it costs seconds per guard, and the fused path has tests of
its own (test_guard_fused.py) that compile once per configuration.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from torchverity import faults
from torchverity.training import TrainingGuard

X = torch.randn(512, 16, generator=torch.Generator().manual_seed(1))
Y = X @ torch.randn(16, 1, generator=torch.Generator().manual_seed(2)) + 0.1

MakeOptimizer = Callable[[Any], torch.optim.Optimizer]


def batch_at(step: int, dtype: torch.dtype = torch.float32
             ) -> tuple[torch.Tensor, torch.Tensor]:
    i = (step * 32) % 512
    return X[i: i + 32].to(dtype), Y[i: i + 32].to(dtype)


def make_model(make_opt: MakeOptimizer | None = None, dtype: torch.dtype = torch.float32
               ) -> tuple[torch.nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    model = model.to(dtype)
    if make_opt is not None:
        return model, make_opt(model.parameters())
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def make_guard(model: torch.nn.Module, opt: torch.optim.Optimizer, **options: Any
               ) -> TrainingGuard:
    options.setdefault("fused", False)
    return TrainingGuard(model, opt, **options)


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    x, y = batch_at(step, dtype)
    return torch.nn.functional.mse_loss(model(x), y)


def step_once(guard: TrainingGuard, model: torch.nn.Module, step: int) -> torch.Tensor:
    """One plain-loop step: zero_grad, forward, backward, check, step."""
    guard.optimizer.zero_grad()
    loss = loss_of(model, step)
    loss.backward()
    guard.check(loss)
    guard.step()
    return loss


@dataclass
class Run:
    guard: TrainingGuard
    model: torch.nn.Module
    final_loss: float
    detected_at: dict[int, int]  # anomaly step -> step after which the host knew
    losses: list[float] = field(default_factory=list)


def train(
    steps: int,
    plan: Callable[[faults.FaultInjector], Any] | None = None,
    poison: Callable[[int, torch.Tensor], torch.Tensor] | None = None,  # applied to targets
    close: bool = True,
    make_opt: MakeOptimizer | None = None,
    *,
    between: Callable[[int, torch.nn.Module, torch.optim.Optimizer], None] | None = None,
    plain: bool = False,  # check() + step() in the loop instead of train_step(step_fn)
    dtype: torch.dtype = torch.float32,
    **options: Any,
) -> Run:
    """``steps`` guarded steps of the tiny model; ``plan`` arms a fault injector, ``between``
    runs before each step's forward pass (between two updates)."""
    model, opt = make_model(make_opt, dtype)

    def step_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    if not plain:
        options.setdefault("step_fn", step_fn)
    options.setdefault("min_samples", 20)
    options.setdefault("window", 64)
    guard = make_guard(model, opt, **options)
    injector = faults.FaultInjector(model)
    if plan:
        plan(injector)
    detected: dict[int, int] = {}
    losses = []
    for step in range(steps):
        injector.begin_step(step)
        if between is not None:
            between(step, model, opt)
        if plain:
            losses.append(float(step_once(guard, model, step).detach()))
        else:
            x, y = batch_at(step, dtype)
            if poison:
                y = poison(step, y)
            losses.append(float(guard.train_step((x, y))))
        for e in guard.events:
            detected.setdefault(e.step, step)
    if close:
        guard.close()
        for e in guard.events:
            detected.setdefault(e.step, steps)
    with torch.no_grad():
        final = float(torch.nn.functional.mse_loss(model(X.to(dtype)).float(), Y))
    return Run(guard, model, final, detected, losses)


def bits(t: torch.Tensor) -> list[int]:
    t = t.detach().reshape(-1)
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).tolist()


_SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__",
                 "__index__", "nonzero", "__array__")


@contextmanager
def count_syncs() -> Iterator[list[str]]:
    """Every call of a method that reads a tensor's values on the host, by name."""
    calls: list[str] = []
    originals = {m: getattr(torch.Tensor, m) for m in _SYNC_METHODS}

    def wrap(name: str, fn: Any) -> Any:
        def counted(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            calls.append(name)
            return fn(self, *a, **k)

        return counted

    try:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, wrap(name, fn))
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
