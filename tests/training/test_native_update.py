"""The native update (the at-rest check in the optimizer's own pass on the CPU) computes bit
for bit what the eager ``optimizer.step()`` computes, in every setting of SGD, Adam and
AdamW, split across threads or not, with parameters that skip an update, and with
``arithmetic="compiled"`` what ``torch.compile(optimizer.step)`` computes; the proof it
runs before a guard uses it refuses a kernel that differs in one ulp; step hooks still
run; an LR scheduler sees the guarded update as the optimizer's step."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy
import pytest
import torch

from torchverity import faults
from torchverity.training import TrainingGuard, _native

Make = Callable[[Any], torch.optim.Optimizer]

SETTINGS: dict[str, Make] = {
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.05, foreach=True),
    "adam-l2-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1, amsgrad=True),
    # beta1 < 0.5 takes lerp's other branch
    "adam-maximize-low-beta1": lambda ps: torch.optim.Adam(ps, lr=1e-3, betas=(0.3, 0.9),
                                                           maximize=True, eps=1e-6),
    # torch's own one-pass CPU kernel (the Hugging Face Trainer's default optimizer)
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.05, fused=True),
    "adam-fused-l2-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1,
                                                         amsgrad=True, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2),
    "sgd-fused-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.3,
                                                     fused=True),
    "sgd-fused-nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.8, nesterov=True,
                                                     weight_decay=1e-3, fused=True),
    "sgd-dampened": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.3),
    "sgd-nesterov-maximize": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.8, nesterov=True,
                                                        weight_decay=1e-3, maximize=True),
}

X = torch.randn(64, 300, generator=torch.Generator().manual_seed(3))
Y = torch.randn(64, 1, generator=torch.Generator().manual_seed(4))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 153 728 parameters: large enough for the native update to split across two threads;
    # lengths of 12 and 13 past a multiple of 16 take every path of torch's fused=True
    # kernels (vector loop, the scalar loop's vectorized part on AVX-512, scalar elements)
    return torch.nn.Sequential(torch.nn.Linear(300, 509), torch.nn.Tanh(),
                               torch.nn.Linear(509, 1))


def _backward(model: torch.nn.Module, step: int, sign: float = 1.0) -> torch.Tensor:
    """The loss (``sign=-1``: its negative, for a maximizing optimizer) and its gradient."""
    loss = sign * torch.nn.functional.mse_loss(model(X), Y)
    loss.backward()
    if step % 7 == 3:
        model[2].bias.grad = None  # this parameter skips this update
    return loss


def _compiled_lrs(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """What a user of a compiled optimizer writes: tensor learning rates."""
    for group in opt.param_groups:
        group["lr"] = torch.tensor(group["lr"])
    return opt


def _bits(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[bytes]:
    tensors = list(model.parameters())
    tensors += [v for p in model.parameters() for v in opt.state[p].values()
                if isinstance(v, torch.Tensor)]
    return [t.detach().reshape(-1).numpy().tobytes() for t in tensors]


@contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_the_native_update_is_the_eager_step_bit_for_bit(name: str) -> None:
    with _threads(2):
        model, ref = _model(), _model()
        opt, ref_opt = SETTINGS[name](model.parameters()), SETTINGS[name](ref.parameters())
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 60)
        ref_schedule = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, 60)
        guard = TrainingGuard(model, opt, policies={"weights_changed": "record"})
        assert guard._rest.coverage()["update"] == "native"
        sign = -1.0 if "maximize" in name else 1.0
        for step in range(60):
            opt.zero_grad()
            loss = _backward(model, step, sign)
            guard.check(loss)
            guard.step()
            schedule.step()
            ref_opt.zero_grad()
            _backward(ref, step, sign)
            ref_opt.step()
            ref_schedule.step()
        assert guard.flush() == [] and guard.events == []
        native = guard._rest.fused
        assert isinstance(native, _native.NativeUpdate) and native._threads() == 2
        assert _bits(model, opt) == _bits(ref, ref_opt)
        # and the window after the last update is still watched
        faults.flip_bit(model[0].weight, 17, 0)
        opt.zero_grad()
        guard.check(_backward(model, 60, sign))
        guard.step()
        guard.flush()
        assert [e.kind for e in guard.events] == ["weights_changed"]
        guard.close()


def test_the_proof_refuses_a_kernel_one_ulp_off_and_the_guard_compiles_instead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fill = _native._fill_group

    def off_by_one_ulp(out: Any, optimizer: torch.optim.Optimizer, group: dict[str, Any],
                       sqrts: tuple[int, int], compiled: bool, vector: int) -> None:
        fill(out, optimizer, group, sqrts, compiled, vector)
        # what a scalar rounded the wrong way would do
        out.w1 = float(numpy.nextafter(numpy.float32(out.w1), numpy.float32(1)))

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert _native.agrees(opt) is None
    monkeypatch.setattr(_native, "_fill_group", off_by_one_ulp)
    assert _native.agrees(opt) == "group 0: the native update differs from AdamW.step() in step 2"
    guard = TrainingGuard(model, opt)
    coverage = guard._rest.coverage()
    # Refused for the eager arithmetic and for the compiled one: torch.compile runs it.
    assert (coverage["verification"], coverage["update"], coverage["arithmetic"]) == (
        "fused into the update", "compiled", "compiled")
    assert coverage["update_reason"] == (
        "group 0: the native update differs from AdamW.step() in step 2; group 0: the native "
        "update differs from torch.compile(AdamW.step) in step 2")
    guard.close()


COMPILED = ("adam-l2-amsgrad", "adam-maximize-low-beta1", "sgd-dampened")


@pytest.mark.parametrize("name", COMPILED)
def test_with_compiled_arithmetic_the_native_update_is_the_compiled_step_bit_for_bit(
        name: str) -> None:
    """``arithmetic="compiled"``: the kernel reproduces ``torch.compile(optimizer.step)``
    (its first update, which creates the state, is the compiled step itself)."""
    with _threads(2):
        model, ref = _model(), _model()
        opt = SETTINGS[name](model.parameters())
        ref_opt = _compiled_lrs(SETTINGS[name](ref.parameters()))
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 30)
        ref_schedule = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, 30)
        # Earlier tests' optimizers of the same class filled torch.compile's recompile
        # limit for their step, past which it would run this one eagerly.
        torch._dynamo.reset()
        ref_step = torch.compile(ref_opt.step)
        guard = TrainingGuard(model, opt, policies={"weights_changed": "record"},
                              arithmetic="compiled")
        coverage = guard._rest.coverage()
        assert (coverage["update"], coverage["arithmetic"]) == ("native", "compiled")
        assert coverage["update_reason"] == "arithmetic='compiled'"
        sign = -1.0 if "maximize" in name else 1.0
        for step in range(30):
            opt.zero_grad()
            guard.check(_backward(model, step, sign))
            guard.step()
            schedule.step()
            ref_opt.zero_grad()
            _backward(ref, step, sign)
            ref_step()
            ref_schedule.step()
        assert guard.flush() == [] and guard.events == []
        assert _bits(model, opt) == _bits(ref, ref_opt)
        faults.flip_bit(opt.state[model[0].weight]["exp_avg" if "adam" in name
                                                   else "momentum_buffer"], 5, 30)
        opt.zero_grad()
        guard.check(_backward(model, 30, sign))
        guard.step()
        guard.flush()
        assert [(e.kind, e.suspects) for e in guard.events] == [
            ("weights_changed", ("optimizer.0.weight." + ("exp_avg" if "adam" in name
                                                          else "momentum_buffer"),))]
        guard.close()


def test_an_lr_scheduler_sees_the_guarded_update_as_the_optimizers_step() -> None:
    """torch warns of a schedule stepped before the optimizer when its wrapper of
    ``optimizer.step`` did not run: the guard's update stands in for it from the first
    one (which the optimizer runs itself, creating its state)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.StepLR(opt, 10)
    guard = TrainingGuard(model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            opt.zero_grad()
            guard.check(_backward(model, step))
            guard.step()
            schedule.step()
    assert [str(w.message) for w in caught if "lr_scheduler" in str(w.message)] == []
    guard.close()


def test_with_step_hooks_the_optimizers_own_step_runs_and_flips_are_still_named() -> None:
    model, ref = _model(), _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    calls: list[int] = []
    opt.register_step_post_hook(lambda *_: calls.append(1))
    guard = TrainingGuard(model, opt, policies={"weights_changed": "record"})
    assert guard._rest.coverage()["update"] == "native"
    for step in range(8):
        if step == 5:
            faults.flip_bit(model[2].weight, 3, 3)  # a low mantissa bit: no statistic moves
            faults.flip_bit(ref[2].weight, 3, 3)
        opt.zero_grad()
        guard.check(_backward(model, step))
        guard.step()
        ref_opt.zero_grad()
        _backward(ref, step)
        ref_opt.step()
    guard.flush()
    assert len(calls) == 8
    assert [(e.step, e.suspects) for e in guard.events if e.kind == "weights_changed"] == [
        (5, ("2.weight",))]
    assert _bits(model, opt) == _bits(ref, ref_opt)
    guard.close()


def test_settings_changed_mid_run_are_proven_again_or_stepped_by_the_optimizer(
        caplog: pytest.LogCaptureFixture) -> None:
    """Weight decay turned on and a group added are proven again and stay native; a
    tensor lr is not native, so the optimizer steps itself from then on, the sums in
    passes: bit for bit the eager run throughout, and a flip after it still named."""
    model, ref = _model(), _model()
    runs = []
    for net in (model, ref):
        opt = torch.optim.AdamW([net[0].weight, net[0].bias], lr=1e-3, weight_decay=0.0)
        runs.append((net, opt))
    guard = TrainingGuard(model, runs[0][1], policies={"weights_changed": "record"})

    def change(step: int, net: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        if step == 5:
            opt.param_groups[0]["weight_decay"] = 0.01
        if step == 10:
            opt.add_param_group({"params": [net[2].weight, net[2].bias], "lr": 3e-3})
        if step == 15:
            opt.param_groups[1]["lr"] = torch.tensor(2e-3)

    kinds = []
    for step in range(20):
        for net, opt in runs:
            change(step, net, opt)
        if step == 18:
            faults.flip_bit(model[2].weight, 1, 2)
            faults.flip_bit(ref[2].weight, 1, 2)
        runs[0][1].zero_grad()
        guard.check(_backward(model, step))
        guard.step()
        runs[1][1].zero_grad()
        _backward(ref, step)
        runs[1][1].step()
        kinds.append(guard._rest.fused.declined)  # type: ignore[union-attr]
    guard.flush()
    assert kinds[:15] == [None] * 15 and kinds[15:] == ["a tensor lr"] * 5
    assert _bits(model, runs[0][1]) == _bits(ref, runs[1][1])
    assert [(e.step, e.suspects) for e in guard.events if e.kind == "weights_changed"] == [
        (18, ("2.weight",))]
    assert sum("no longer reproduces" in r.message for r in caplog.records) == 1
    guard.close()


def test_a_fused_kernel_the_native_update_does_not_reproduce_verifies_in_two_passes() -> None:
    """torch's fused=True kernels run channels_last weights through memory in another
    order than the native update takes: the guard does not stand in for the optimizer's
    own kernel, which takes no sums, so it verifies in two passes, saying why."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.LazyLinear(2))
    model(torch.randn(2, 3, 8, 8))
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, fused=True)
    guard = TrainingGuard(model, opt, policies={"weights_changed": "record"})
    coverage = guard._rest.coverage()
    assert (coverage["verification"], coverage["fallback_reason"]) == (
        "two passes", "fused=True optimizers run their own kernel")
    x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
    for step in range(4):
        if step == 2:
            faults.flip_bit(model[0].weight, 9, 1)
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        guard.check(loss)
        guard.step()
    guard.flush()
    assert [(e.step, e.suspects) for e in guard.events] == [(2, ("0.weight",))]
    guard.close()


@pytest.mark.parametrize("name", ["adam-l2-amsgrad", "sgd-dampened"])
def test_a_channels_last_model_takes_the_native_update_bit_for_bit(name: str) -> None:
    """``model.to(memory_format=torch.channels_last)``: weights, gradients and state share
    one dense layout that is not the contiguous one; the update runs through memory."""
    def conv() -> torch.nn.Module:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(),
                                  torch.nn.Conv2d(16, 8, 3), torch.nn.Flatten(),
                                  torch.nn.Linear(8 * 12 * 12, 1))
        return net.to(memory_format=torch.channels_last)

    x = torch.randn(8, 3, 16, 16).to(memory_format=torch.channels_last)
    model, ref = conv(), conv()
    assert not model[0].weight.is_contiguous()
    opt, ref_opt = SETTINGS[name](model.parameters()), SETTINGS[name](ref.parameters())
    guard = TrainingGuard(model, opt, policies={"weights_changed": "record"})
    assert guard._rest.coverage()["update"] == "native"
    for _step in range(20):
        for net, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            loss = net(x).pow(2).mean()
            loss.backward()
            if net is model:
                guard.check(loss)
                guard.step()
            else:
                o.step()
    assert guard.flush() == [] and guard.events == []
    assert _bits(model, opt) == _bits(ref, ref_opt)
    faults.flip_bit(model[0].weight, 100, 3)
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    guard.check(loss)
    guard.step()
    guard.flush()
    assert [(e.kind, e.suspects) for e in guard.events] == [("weights_changed", ("0.weight",))]
    guard.close()


def test_state_replaced_between_updates_is_recorded_again_and_its_next_window_watched() -> None:
    """Code that swaps an optimizer-state tensor for a copy (no ``load_state_dict`` to tell
    the guard): the next update verifies the old tensor, runs on the new one and records
    it, so a flip in the new one after that update is caught and named, and none is
    reported without one."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = TrainingGuard(model, opt, policies={"weights_changed": "record"})
    for step in range(4):
        opt.zero_grad()
        guard.check(_backward(model, step))
        guard.step()
    weight = model[0].weight
    opt.state[weight]["exp_avg"] = opt.state[weight]["exp_avg"].clone()
    for step in range(4, 6):
        opt.zero_grad()
        guard.check(_backward(model, step))
        guard.step()
    assert guard._rest.coverage()["update"] == "native"
    assert guard.flush() == [] and guard.events == []
    faults.flip_bit(opt.state[weight]["exp_avg"], 5, 0)
    opt.zero_grad()
    guard.check(_backward(model, 6))
    guard.step()
    guard.flush()
    assert [e.kind for e in guard.events] == ["weights_changed"]
    assert "optimizer.0.weight.exp_avg" in guard.events[0].suspects
    guard.close()


@pytest.mark.parametrize("arithmetic", ["eager", "compiled"])
def test_state_the_first_update_creates_is_watched_from_that_update_on(arithmetic: str) -> None:
    """The first update creates the optimizer's state (the native update leaves it to the
    optimizer, or to the compiled step): the tensors it created are recorded as it
    returns, so a flip in one before the second update is caught and named."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if arithmetic == "compiled":
        _compiled_lrs(opt)
    guard = TrainingGuard(model, opt, arithmetic=arithmetic,
                          policies={"weights_changed": "record"})
    opt.zero_grad()
    guard.check(_backward(model, 0))
    guard.step()
    assert guard._rest.coverage()["update"] == "native"
    faults.flip_bit(opt.state[model[2].weight]["exp_avg_sq"], 0, 3)
    opt.zero_grad()
    guard.check(_backward(model, 1))
    guard.step()
    guard.flush()
    assert [e.kind for e in guard.events] == ["weights_changed"]
    assert guard.events[0].suspects == ("optimizer.2.weight.exp_avg_sq",)
    guard.close()
