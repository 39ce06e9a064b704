"""Tensor fault injection for drills and tests.

Flip a chosen bit of a chosen element (or set it to a value such as NaN) in a
parameter, a gradient or an activation, at a chosen training step. Faults are
applied in place on the tensor's own device, so what a detector sees is what
a hardware fault would leave behind.

>>> import torch
>>> from torchverity import faults
>>> w = torch.ones(4)
>>> faults.flip_bit(w, index=2, bit=faults.exponent_bit(w.dtype)).after
inf

A plan for a training loop (``begin_step`` before each forward)::

    injector = faults.FaultInjector(model)
    injector.parameter("fc.weight", step=50, index=7, bit=30)   # exponent bit
    injector.gradient("fc.bias", step=80, value=float("nan"))
    injector.activation("fc", step=120, index=0, bit=30)
    for step, batch in enumerate(loader):
        injector.begin_step(step)
        ...
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from torchverity.errors import UsageError

Target = Literal["parameter", "gradient", "activation"]

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Bit positions of IEEE-like formats: (mantissa bits, exponent bits).
_FLOAT_LAYOUT = {
    torch.float16: (10, 5),
    torch.bfloat16: (7, 8),
    torch.float32: (23, 8),
    torch.float64: (52, 11),
}


@dataclass(frozen=True)
class InjectedFault:
    """One fault that was applied: where, which bit or value, and the value before/after."""

    target: str
    name: str
    step: int | None
    index: int
    bit: int | None
    before: float
    after: float


@dataclass(frozen=True)
class Fault:
    """A planned fault. Exactly one of ``bit`` and ``value`` is set."""

    target: Target
    name: str
    step: int
    index: int = 0
    bit: int | None = None
    value: float | None = None


def exponent_bit(dtype: torch.dtype) -> int:
    """The highest exponent bit: flipping it turns most values into huge ones or zero."""
    mantissa, exponent = _layout(dtype)
    return mantissa + exponent - 1


def mantissa_lsb(dtype: torch.dtype) -> int:
    """The lowest mantissa bit: the smallest possible change of a value."""
    _layout(dtype)
    return 0


def _layout(dtype: torch.dtype) -> tuple[int, int]:
    if dtype not in _FLOAT_LAYOUT:
        raise UsageError(
            f"no float bit layout for {dtype}",
            hint="pass an explicit bit= for integer tensors",
        )
    return _FLOAT_LAYOUT[dtype]


def _element(tensor: torch.Tensor, index: int) -> torch.Tensor:
    """A 0-dim view of element ``index`` (row-major) of ``tensor``; writes reach the tensor."""
    numel = tensor.numel()
    if not 0 <= index < numel:
        raise UsageError(f"element index {index} is out of range for a tensor of {numel} elements")
    coords: list[int] = []
    for size in reversed(tensor.shape):
        coords.append(index % size)
        index //= size
    return tensor.detach()[tuple(reversed(coords))]


def _as_float(value: torch.Tensor) -> float:
    return float(value.item()) if value.dtype.is_floating_point else float(int(value.item()))


def flip_bit(
    tensor: torch.Tensor, index: int, bit: int, *, target: str = "tensor", name: str = "",
    step: int | None = None,
) -> InjectedFault:
    """Flip ``bit`` (0 = least significant) of element ``index`` of ``tensor`` in place."""
    width = 8 * tensor.element_size()
    if not 0 <= bit < width:
        raise UsageError(f"bit {bit} does not exist in a {width}-bit {tensor.dtype} element")
    elem = _element(tensor, index)
    before = _as_float(elem)
    words = elem.view(_INT_VIEW[tensor.element_size()])
    mask = (1 << bit) - (1 << width if bit == width - 1 and width > 8 else 0)
    words.bitwise_xor_(mask)
    return InjectedFault(target, name, step, index, bit, before, _as_float(elem))


def set_value(
    tensor: torch.Tensor, index: int, value: float, *, target: str = "tensor", name: str = "",
    step: int | None = None,
) -> InjectedFault:
    """Set element ``index`` of ``tensor`` to ``value`` (e.g. ``float('nan')``) in place."""
    elem = _element(tensor, index)
    before = _as_float(elem)
    elem.fill_(value)
    return InjectedFault(target, name, step, index, None, before, _as_float(elem))


def _apply(tensor: torch.Tensor, fault: Fault, step: int | None) -> InjectedFault:
    if fault.bit is not None:
        return flip_bit(tensor, fault.index, fault.bit, target=fault.target, name=fault.name,
                        step=step)
    assert fault.value is not None
    return set_value(tensor, fault.index, fault.value, target=fault.target, name=fault.name,
                     step=step)


class FaultInjector:
    """Applies planned faults to a model at chosen steps.

    Parameter faults are applied by :meth:`begin_step` (between steps, like a
    memory fault at rest). Gradient and activation faults are applied by hooks
    during the backward and forward passes of that step, once each, so a replay
    of the same step runs clean (as a transient hardware fault would).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.step: int | None = None
        self.injected: list[InjectedFault] = []
        self._pending: list[Fault] = []
        self._handles: list[Any] = []
        self._params = dict(model.named_parameters())
        self._modules = dict(model.named_modules())

    def parameter(self, name: str, *, step: int, index: int = 0, bit: int | None = None,
                  value: float | None = None) -> Fault:
        return self._plan(Fault("parameter", name, step, index, bit, value))

    def gradient(self, name: str, *, step: int, index: int = 0, bit: int | None = None,
                 value: float | None = None) -> Fault:
        fault = self._plan(Fault("gradient", name, step, index, bit, value))
        self._handles.append(self._params[name].register_hook(self._grad_hook(fault)))
        return fault

    def activation(self, module: str, *, step: int, index: int = 0, bit: int | None = None,
                   value: float | None = None) -> Fault:
        fault = self._plan(Fault("activation", module, step, index, bit, value))
        self._handles.append(self._modules[module].register_forward_hook(self._act_hook(fault)))
        return fault

    def _plan(self, fault: Fault) -> Fault:
        if (fault.bit is None) == (fault.value is None):
            raise UsageError("give exactly one of bit= and value= for a fault")
        known = self._modules if fault.target == "activation" else self._params
        if fault.name not in known:
            raise UsageError(
                f"no {'module' if fault.target == 'activation' else 'parameter'} "
                f"named '{fault.name}' in the model",
                hint=f"known names start with: {', '.join(sorted(known)[:5])}",
            )
        self._pending.append(fault)
        return fault

    def begin_step(self, step: int) -> list[InjectedFault]:
        """Mark the start of ``step`` and apply the parameter faults planned for it."""
        self.step = step
        applied = []
        for fault in self._due("parameter"):
            applied.append(_apply(self._params[fault.name], fault, step))
        self.injected.extend(applied)
        return applied

    def _due(self, target: str, only: Fault | None = None) -> list[Fault]:
        due = [f for f in self._pending if f.target == target and f.step == self.step
               and (only is None or f is only)]
        self._pending = [f for f in self._pending if f not in due]
        return due

    def _grad_hook(self, fault: Fault) -> Callable[[torch.Tensor], torch.Tensor | None]:
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            if not self._due("gradient", fault):
                return None
            faulty = grad.clone()
            self.injected.append(_apply(faulty, fault, self.step))
            return faulty

        return hook

    def _act_hook(self, fault: Fault) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> Any:
            if not isinstance(output, torch.Tensor) or not self._due("activation", fault):
                return None
            faulty = output.clone()
            self.injected.append(_apply(faulty, fault, self.step))
            return faulty

        return hook

    def remove(self) -> None:
        """Remove every hook this injector installed."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
