"""Frozen parameters (``requires_grad=False``: a frozen backbone, the base model under LoRA)
are verified at rest like the trained ones, though no update reads them."""

from __future__ import annotations

import pytest
import torch
from guard_helpers import bits, make_guard, make_model, step_once

from torchverity import faults
from torchverity.training import TrainingGuard


def _frozen_first_layer(trainable_only: bool = True
                        ) -> tuple[torch.nn.Sequential, torch.optim.Optimizer]:
    model, _ = make_model()
    for p in model[0].parameters():
        p.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad] if trainable_only else list(
        model.parameters())  # frozen ones handed to the optimizer too: it skips them
    return model, torch.optim.Adam(params, lr=1e-2)


def _run(guard: TrainingGuard, model: torch.nn.Module, steps: range,
         flip: tuple[int, torch.Tensor, int, int] | None = None) -> None:
    for step in steps:
        if flip is not None and step == flip[0]:
            faults.flip_bit(flip[1], flip[2], flip[3])
        step_once(guard, model, step)
    guard.flush()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(("name", "index", "bit"), [("0.weight", 5, 0), ("0.bias", 3, 30)])
def test_a_flip_in_a_frozen_parameter_is_reported_at_the_next_update_and_named(
        fused: bool, name: str, index: int, bit: int) -> None:
    model, opt = _frozen_first_layer()
    guard = make_guard(model, opt, fused=fused, policies={"weights_changed": "record"})
    target = dict(model.named_parameters())[name]
    _run(guard, model, range(12), flip=(7, target, index, bit))
    assert [(e.step, e.kind, e.suspects) for e in guard.events] == [
        (7, "weights_changed", (name,))]
    assert guard._rest.coverage()["frozen_parameters"] == 2


@pytest.mark.parametrize("options", [{"fused": True}, {"fused": False},
                                     {"fused": False, "rest_weighted": True},
                                     {"fused": False, "stats": "device"}])
def test_a_clean_run_with_frozen_parameters_raises_nothing(options: dict[str, object]) -> None:
    model, opt = _frozen_first_layer(trainable_only=False)
    frozen_before = bits(model[0].weight)
    guard = make_guard(model, opt, check_every=5, **options)
    _run(guard, model, range(40))
    assert guard.events == [] and bits(model[0].weight) == frozen_before
    assert guard.close().anomalies == {}


def test_weights_changed_at_rest_in_a_frozen_layer_uncertifies_a_checkpoint() -> None:
    model, opt = _frozen_first_layer()
    guard = make_guard(model, opt, policies={"weights_changed": "record"})
    _run(guard, model, range(4))
    assert guard.certify()["certified"]
    assert guard.certify()["verified"]["frozen_parameters"] == 2
    faults.flip_bit(model[0].weight, 9, 12)
    cert = guard.certify()
    assert (cert["certified"], cert["verified"]["at_rest"], cert["changed"]) == (
        False, "failed", ["0.weight"])


def test_gradual_unfreezing_raises_no_alarm_and_a_later_flip_is_still_named() -> None:
    model, opt = _frozen_first_layer()
    guard = make_guard(model, opt, policies={"weights_changed": "record"})
    _run(guard, model, range(10))
    for p in model[0].parameters():  # unfreeze the first layer, as fine-tuning recipes do
        p.requires_grad_(True)
    opt.add_param_group({"params": list(model[0].parameters())})
    _run(guard, model, range(10, 30), flip=(25, model[2].weight, 1, 3))
    assert [(e.step, e.kind, e.suspects) for e in guard.events] == [
        (25, "weights_changed", ("2.weight",))]


def test_frozen_parameters_false_leaves_them_out() -> None:
    model, opt = _frozen_first_layer()
    guard = make_guard(model, opt, frozen_parameters=False,
                       policies={"weights_changed": "record"})
    _run(guard, model, range(10), flip=(5, model[0].weight, 2, 0))
    assert guard.events == [] and guard._rest.coverage()["frozen_parameters"] == 0
