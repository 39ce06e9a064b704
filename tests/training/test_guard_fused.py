"""Full at-rest coverage by default: every single-bit flip in a parameter or optimizer-state
tensor, between two updates, is reported at the next update and named, on the fused path
(the check in the optimizer's own pass) and on the two-pass fallback; the fused update is
bit-identical to the eager optimizer (the native update) or to
``torch.compile(optimizer.step)`` (the compiled one), the fallback to the eager optimizer."""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from guard_helpers import MakeOptimizer, bits, loss_of, make_model, step_once, train

from torchverity import faults
from torchverity.errors import TrainingAnomalyError
from torchverity.training import TrainingGuard
from torchverity.training._fused import word_sum, word_sums

FUSED = "fused into the update"


def _sgd(ps: Any) -> torch.optim.Optimizer:
    ps = list(ps)
    return torch.optim.SGD([
        {"params": ps[:2], "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
        {"params": ps[2:], "momentum": 0.5, "lr": 5e-3},
    ], lr=1e-2)


def _adam(ps: Any) -> torch.optim.Optimizer:
    ps = list(ps)
    return torch.optim.Adam([
        {"params": ps[:2], "amsgrad": True},
        {"params": ps[2:], "weight_decay": 1e-2, "lr": 5e-3},
    ], lr=1e-2)


def _adamw(ps: Any) -> torch.optim.Optimizer:
    ps = list(ps)
    return torch.optim.AdamW([
        {"params": ps[:2]},
        {"params": ps[2:], "amsgrad": True, "weight_decay": 0.1},
    ], lr=1e-2)


OPTIMIZERS: dict[str, MakeOptimizer] = {"sgd": _sgd, "adam": _adam, "adamw": _adamw}


def _scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=40, gamma=0.5)


def _state_bits(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[list[int]]:
    out = [bits(p) for p in model.parameters()]
    for p in model.parameters():
        out.extend(bits(v) for v in opt.state[p].values() if isinstance(v, torch.Tensor))
    return out


# (the code that runs the update, the arithmetic it reproduces, the guard's settings)
UPDATES = {"native": ("native", "eager", {}),
           "native, compiled arithmetic": ("native", "compiled", {"arithmetic": "compiled"}),
           "compiled": ("compiled", "compiled", {"native": False})}


@pytest.mark.parametrize("update", sorted(UPDATES))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_update_is_bit_identical_to_its_optimizer_then_catches_every_flip(
        name: str, update: str) -> None:
    """200 clean steps (param groups, an LR scheduler): no event, and the bits of every
    parameter and state tensor are those of the eager ``optimizer.step()`` (the native
    update, the CPU default) or of ``torch.compile(optimizer.step)`` (the native update
    with ``arithmetic="compiled"``, and the compiled one, ``native=False``). Then, in the
    same run, random single-bit flips at rest: each reported at the next update."""
    model, opt = make_model(OPTIMIZERS[name])
    schedule = _scheduler(opt)
    code, arithmetic, settings = UPDATES[update]
    guard = TrainingGuard(model, opt, policies={"weights_changed": "record"}, **settings)
    coverage = guard._rest.coverage()
    assert (coverage["verification"], coverage["update"], coverage["arithmetic"]) == (
        FUSED, code, arithmetic)
    ref_model, ref_opt = make_model(OPTIMIZERS[name])
    ref_step = ref_opt.step
    if arithmetic == "compiled":
        # What a user of a compiled optimizer writes: tensor learning rates, a compiled step.
        for group in ref_opt.param_groups:
            group["lr"] = torch.tensor(group["lr"])
        # Earlier tests' optimizers of the same class filled torch.compile's recompile
        # limit for their step, past which it would run this one eagerly.
        torch._dynamo.reset()
        ref_step = torch.compile(ref_opt.step)
    ref_schedule = _scheduler(ref_opt)
    for step in range(200):
        step_once(guard, model, step)
        schedule.step()
        ref_opt.zero_grad()
        loss_of(ref_model, step).backward()
        ref_step()
        ref_schedule.step()
    assert guard.flush() == [] and guard.events == []
    assert _state_bits(model, opt) == _state_bits(ref_model, ref_opt)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(1e-2 * 0.5 ** 5)  # scheduled
    rng = random.Random(name)
    made = []
    for step in range(200, 240):
        if step % 3 == 0:
            tensor_name, tensor = rng.choice(_covered(model, opt))
            faults.flip_bit(tensor, rng.randrange(tensor.numel()),
                            rng.randrange(8 * tensor.element_size()))
            made.append((step, (tensor_name,)))
        step_once(guard, model, step)
        guard.flush()  # under "record" a read comes on the interval; here after each step
        assert [(e.step, e.suspects) for e in guard.events if e.kind == "weights_changed"
                ] == made  # found by this very update
    assert any(n.startswith("optimizer.") for _, (n,) in made)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_two_pass_fallback_is_bit_identical_to_the_eager_optimizer_over_200_steps(
        name: str) -> None:
    model, opt = make_model(OPTIMIZERS[name])
    schedule = _scheduler(opt)
    guard = TrainingGuard(model, opt, fused=False)
    assert guard._rest.coverage() == {"windows": "every", "tensors": "parameters and optimizer "
                                      "state", "verification": "two passes", "update": None,
                                      "arithmetic": None, "update_reason": None,
                                      "fallback_reason": "fused=False",
                                      "frozen_parameters": 0}
    ref_model, ref_opt = make_model(OPTIMIZERS[name])
    ref_schedule = _scheduler(ref_opt)
    for step in range(200):
        step_once(guard, model, step)
        schedule.step()
        ref_opt.zero_grad()
        loss_of(ref_model, step).backward()
        ref_opt.step()
        ref_schedule.step()
    guard.close()
    assert guard.events == []
    assert _state_bits(model, opt) == _state_bits(ref_model, ref_opt)


def _covered(model: torch.nn.Module, opt: torch.optim.Optimizer
             ) -> list[tuple[str, torch.Tensor]]:
    named = list(model.named_parameters())
    for name, p in list(named):
        named.extend((f"optimizer.{name}.{k}", v) for k, v in opt.state[p].items()
                     if isinstance(v, torch.Tensor))
    return named


def _campaign(name: str, dtype: torch.dtype, fused: bool, seed: int, steps: int = 40
              ) -> tuple[list[tuple[int, str]], Any]:
    """Random single-bit flips (any bit, any covered tensor) before random steps' forward
    passes; returns the flips made and the run."""
    rng = random.Random(seed)
    flip_steps = set(rng.sample(range(1, steps), 12))
    made: list[tuple[int, str]] = []

    def between(step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        if step in flip_steps:
            tensor_name, tensor = rng.choice(_covered(model, opt))
            faults.flip_bit(tensor, rng.randrange(tensor.numel()),
                            rng.randrange(8 * tensor.element_size()))
            made.append((step, tensor_name))

    # Two passes verify before the update: skipping it keeps eager Adam from stepping on a
    # corrupted step counter (a negative one makes its bias correction complex and raises).
    # Fused, the check comes with the update, which then computes NaN instead.
    policy = "record" if fused else "skip"
    run = train(steps, make_opt=OPTIMIZERS[name], plain=True, between=between, dtype=dtype,
                fused=fused, policies={"weights_changed": policy},
                check_every=1 if fused else 10)  # "record" is read on the interval
    return made, run


# The fused path in float32 runs its campaign after the bit-identity test above.
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
CAMPAIGN = [(n, d, False) for n in sorted(OPTIMIZERS) for d in FLOATS]
CAMPAIGN += [("sgd", torch.bfloat16, True), ("adamw", torch.float16, True)]


@pytest.mark.parametrize(("name", "dtype", "fused"), CAMPAIGN)
def test_every_flip_at_rest_is_reported_at_the_next_update_and_named(
        name: str, dtype: torch.dtype, fused: bool) -> None:
    made, run = _campaign(name, dtype, fused, seed=zlib.crc32(f"{name}{dtype}{fused}".encode()))
    expected = "fused into the update" if fused else "two passes"
    assert run.guard._rest.coverage()["verification"] == expected
    found = [(e.step, e.suspects) for e in run.guard.events if e.kind == "weights_changed"]
    assert found == [(step, (tensor,)) for step, tensor in made]
    # Known at that very update, before the next forward pass.
    assert all(run.detected_at[step] == step for step, _ in made)
    assert len(made) == 12


@pytest.mark.parametrize("fused", [True, False])
def test_default_guard_stops_at_the_update_after_a_flip_naming_the_tensor(
        fused: bool, tmp_path: Path) -> None:
    model, opt = make_model(OPTIMIZERS["adamw"])
    log = tmp_path / "events.jsonl"
    options = {} if fused else {"fused": False}
    guard = TrainingGuard(model, opt, log=log, **options)
    with pytest.raises(TrainingAnomalyError) as info:
        for step in range(20):
            if step == 7:  # the lowest mantissa bit of one moment: no statistic moves
                faults.flip_bit(opt.state[model[2].weight]["exp_avg"], 5, 0)
            step_once(guard, model, step)
    assert step == 7
    err = info.value
    assert (err.step, err.kind, err.suspects) == (7, "weights_changed",
                                                  ["optimizer.2.weight.exp_avg"])
    start = json.loads(log.read_text().splitlines()[0])
    assert start["coverage"]["windows"] == "every"
    assert start["coverage"]["verification"] == (FUSED if fused else "two passes")


def test_other_optimizers_fall_back_to_two_passes_and_say_so_once(tmp_path: Path) -> None:
    model, opt = make_model(lambda ps: torch.optim.RMSprop(ps, lr=1e-3))
    log = tmp_path / "events.jsonl"
    guard = TrainingGuard(model, opt, log=log)
    for step in range(5):
        if step == 3:
            faults.flip_bit(opt.state[model[0].bias]["square_avg"], 1, 30)
        with pytest.raises(TrainingAnomalyError) if step == 3 else _nothing():
            step_once(guard, model, step)
    records = [json.loads(x) for x in log.read_text().splitlines()]
    said = [r for r in records if "coverage" in r]
    assert len(said) == 1 and said[0]["coverage"] == {
        "windows": "every", "tensors": "parameters and optimizer state",
        "verification": "two passes", "update": None, "arithmetic": None,
        "update_reason": None,
        "fallback_reason": "RMSprop has no fused verification (SGD, Adam, AdamW do)",
        "frozen_parameters": 0}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_opting_down_verifies_one_window_in_n() -> None:
    made = []

    def between(step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        if step in (5, 7):  # verified: the windows before the updates of steps 3, 7, 11
            faults.flip_bit(model[0].weight, step, 0)
            made.append(step)

    run = train(12, plain=True, between=between, rest_every=4,
                policies={"weights_changed": "record"})
    assert run.guard._rest.coverage()["windows"] == "1 in 4"
    assert [e.step for e in run.guard.events] == [7]  # step 5's flip is not seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float64])
def test_word_sum_moves_with_every_single_bit_flip_in_every_float_dtype(
        dtype: torch.dtype) -> None:
    t = torch.randn(33, generator=torch.Generator().manual_seed(0)).to(dtype)
    record = word_sum(t)
    for index in (0, 16, 32):
        for bit in range(8 * t.element_size()):
            faults.flip_bit(t, index, bit)
            assert word_sum(t) != record, (index, bit)
            faults.flip_bit(t, index, bit)
    assert word_sum(t) == record


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_word_sums_equal_the_eager_ones_when_they_wrap_around(dtype: torch.dtype
                                                                        ) -> None:
    """The fused record (compiled) is verified against eager sums and the other way round
    (skipped updates, certification): both must wrap around modulo 2**32 alike."""
    gen = torch.Generator().manual_seed(1)
    tensors = [(torch.randn(n, generator=gen) * 1e30).to(dtype) for n in (1, 7, 4099, 1 << 20)]
    compiled = torch.compile(word_sums, dynamic=False)
    assert torch.equal(compiled(tensors), word_sums(tensors))
    exact = sum(int(t.view(torch.int32 if t.element_size() == 4 else torch.int16)
                    .to(torch.int64).sum()) for t in tensors[-1:])
    assert exact >= 2**31 or exact < -(2**31) or dtype != torch.float32  # it did wrap
    assert int(word_sums(tensors[-1:])[0]) == (exact + 2**31) % 2**32 - 2**31


def test_a_machine_without_a_compiler_falls_back_says_so_once_and_still_catches_flips(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No C compiler at all: the native update cannot be built, the compiled one fails
    at its first update, and the guard verifies in two passes from there, saying so."""
    import torch._inductor.config as inductor

    from torchverity.training import _native

    model, opt = make_model(lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9))
    log = tmp_path / "events.jsonl"
    # No cc on PATH and no kernel built before; the cache is cleared again at the end so
    # the tests that follow in this process build it.
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("TORCHVERITY_CACHE_DIR", str(tmp_path / "cache"))
    _native._kernel.cache_clear()
    try:
        guard = TrainingGuard(model, opt, log=log, check_every=1,
                              policies={"weights_changed": "record"})
        # The config's own patch puts inductor's compiler back for later tests.
        with inductor.patch({"cpp.cxx": ("/nonexistent/c++",)}):
            for step in range(6):
                if step == 3:
                    faults.flip_bit(model[0].weight, 2, 1)
                step_once(guard, model, step)
        guard.close()
    finally:
        _native._kernel.cache_clear()
    said = [json.loads(x)["coverage"] for x in log.read_text().splitlines() if '"coverage"' in x]
    assert [(c["verification"], c["update"]) for c in said] == [
        ("fused into the update", "compiled"), ("two passes", None)]
    assert said[1]["fallback_reason"].startswith("torch.compile failed")
    assert [(e.step, e.kind, e.suspects) for e in guard.events] == [
        (3, "weights_changed", ("0.weight",))]
    assert float(opt.state[model[0].weight]["momentum_buffer"].abs().sum()) > 0  # it stepped
