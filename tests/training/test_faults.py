"""Tensor fault injection: the chosen bit of the chosen element changes, nothing else does."""

from __future__ import annotations

import math

import pytest
import torch

from torchverity import faults
from torchverity.errors import UsageError


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_exponent_flip_of_one_is_huge_and_mantissa_flip_is_tiny(dtype: torch.dtype) -> None:
    t = torch.ones(2, 3, dtype=dtype)
    fault = faults.flip_bit(t, index=4, bit=faults.exponent_bit(dtype))
    assert fault.before == 1.0 and math.isinf(fault.after)
    assert t.flatten()[4].isinf() and (t.flatten()[[0, 1, 2, 3, 5]] == 1).all()
    t = torch.ones(5, dtype=dtype)
    small = faults.flip_bit(t, index=0, bit=faults.mantissa_lsb(dtype))
    assert small.after == 1.0 + torch.finfo(dtype).eps


def test_flip_is_exactly_one_bit_on_non_contiguous_and_integer_tensors() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = base.t()  # non-contiguous: element 5 of the view is base[2, 1]
    before = base.clone()
    faults.flip_bit(view, index=5, bit=31)
    assert base[2, 1] == -before[2, 1] and (base != before).sum() == 1
    ints = torch.zeros(4, dtype=torch.int16)
    faults.flip_bit(ints, index=2, bit=15)
    assert ints.tolist() == [0, 0, -32768, 0]
    faults.flip_bit(ints, index=2, bit=15)  # flipping twice restores
    assert ints.tolist() == [0, 0, 0, 0]


def test_set_value_and_bad_requests() -> None:
    t = torch.zeros(3)
    assert math.isnan(faults.set_value(t, 1, math.nan).after)
    with pytest.raises(UsageError, match="out of range"):
        faults.flip_bit(t, index=3, bit=0)
    with pytest.raises(UsageError, match="bit 32 does not exist"):
        faults.flip_bit(t, index=0, bit=32)
    with pytest.raises(UsageError, match="no float bit layout"):
        faults.exponent_bit(torch.int32)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def test_injector_applies_each_fault_once_at_its_step() -> None:
    model = _model()
    inj = faults.FaultInjector(model)
    inj.parameter("0.weight", step=1, index=2, bit=30)
    inj.gradient("2.weight", step=2, index=1, value=math.nan)
    inj.activation("0", step=3, index=0, value=math.inf)
    x = torch.ones(2, 4)
    observed = []
    for step in range(5):
        w = model[0].weight.detach().clone()
        inj.begin_step(step)
        model.zero_grad()
        out = model(x)
        out.sum().backward()
        observed.append((
            not torch.equal(w, model[0].weight.detach()),
            bool(model[2].weight.grad.isnan().any()),  # type: ignore[union-attr]
            bool(out.isinf().any() or out.isnan().any()),
        ))
    assert observed == [
        (False, False, False),
        (True, False, False),
        (False, True, False),
        (False, False, True),
        (False, False, False),
    ]
    assert [(f.target, f.name, f.step) for f in inj.injected] == [
        ("parameter", "0.weight", 1), ("gradient", "2.weight", 2), ("activation", "0", 3)
    ]
    inj.remove()


def test_injector_rejects_unknown_names_and_ambiguous_faults() -> None:
    inj = faults.FaultInjector(_model())
    with pytest.raises(UsageError, match=r"no parameter named 'fc\.weight'"):
        inj.parameter("fc.weight", step=0, bit=1)
    with pytest.raises(UsageError, match="no module named 'head'"):
        inj.activation("head", step=0, bit=1)
    with pytest.raises(UsageError, match="exactly one of bit= and value="):
        inj.parameter("0.weight", step=0)
