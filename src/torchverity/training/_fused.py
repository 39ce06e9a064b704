"""The at-rest check folded into the optimizer's own pass over its tensors.

An optimizer reads every parameter and state tensor and writes them back once per
update. Compiled together with that update (``torch.compile``: C++ kernels on the
CPU, Triton on a GPU), a word sum of each tensor as the update reads it verifies
the window that has just ended, and a word sum of what it writes records the next
one: full coverage without two extra passes over memory.

The update itself is the optimizer's own ``step()`` traced by ``torch.compile``, so
it computes bit for bit what ``torch.compile(optimizer.step)`` computes; the sums
only add reads the compiler can fuse into the same loops. Step-dependent scalars
must reach the compiled function as tensors, or every change recompiles it: Adam's
step counters already are, and each group's ``lr`` is turned into a 0-dim tensor
(torch's own recipe for compiled optimizers under an LR scheduler, which then fills
the tensor in place).

The word sum of a tensor is the sum, modulo 2**32 (int32 with wrap-around), of its
elements read as signed integers of their own width (8-byte elements as two 32-bit
words): a single-bit flip moves one integer by a power of two below 2**32, and the
sum with it, in any dtype. Summing in int32 rather than int64 keeps the compiled
loop at one vector add per word and sum, with no widening, beside the update's own
arithmetic. :func:`word_sums` computes the same values eagerly, for a window verified
outside an update (a skipped update, a checkpoint's certification).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.optim.optimizer as _optim

from torchverity.training._distributed_hook import any_sharded

_SUPPORTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def word_sum(tensor: torch.Tensor) -> torch.Tensor:
    """0-dim int32: the tensor's elements read as signed integers, summed modulo 2**32."""
    t = tensor.detach()
    kind = _INT_OF_SIZE.get(t.element_size())
    words = t.view(kind) if kind is not None else t.reshape(-1).view(torch.int32)
    return words.sum(dtype=torch.int32)


def word_sums(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[n]`` int32 word sums, one per tensor (the values the fused update computes)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int32)
    return torch.stack([word_sum(t) for t in tensors])


def update_with_sums(step: Callable[[torch.optim.Optimizer], Any],
                      optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    before = word_sums(tensors)
    step(optimizer)
    return before, word_sums(tensors)


def _own_step(optimizer: torch.optim.Optimizer) -> Callable[[torch.optim.Optimizer], Any]:
    """The optimizer's update itself. torch wraps ``step`` to run step hooks and to set
    grad mode between two forced graph breaks; traced through those, the sums would be
    compiled apart from the update, as passes of their own. Under ``no_grad`` and with
    no step hook registered the wrappers do nothing else, so the update traced without
    them is the same update."""
    hooks = (optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks,
             _optim._global_optimizer_pre_hooks, _optim._global_optimizer_post_hooks)
    if any(hooks):  # the hooks must run: the sums in passes of their own. The class's
        # step, not the instance's: a trainer integration puts the guard's there.
        return lambda opt: type(opt).step(opt)
    return inspect.unwrap(type(optimizer).step)


def unsupported(optimizer: torch.optim.Optimizer, reducer: object,
                policies: dict[str, str], update_ratio: bool, fused_ok: bool = False
                ) -> str | None:
    """Why this guard cannot fuse the at-rest check into the update; None when it can.
    ``fused_ok``: the native update reproduces this optimizer's fused=True kernel."""
    if type(optimizer) not in _SUPPORTED:
        return f"{type(optimizer).__name__} has no fused verification (SGD, Adam, AdamW do)"
    if any_sharded([p for group in optimizer.param_groups for p in group["params"]]):
        return "DTensor parameters (FSDP2, HSDP, tensor parallel): each rank verifies its " \
               "local shards in two passes"
    for group in optimizer.param_groups:
        if group.get("fused") and not fused_ok:
            return "fused=True optimizers run their own kernel"
        if group.get("differentiable"):
            return "differentiable=True optimizers are not compiled"
    if reducer is not None:
        return "with a reducer the at-rest flag is combined across ranks before the update"
    if policies.get("weights_changed") == "skip":
        return "weights_changed='skip' needs the verification before the update"
    if update_ratio:
        return "update_ratio=True keeps a copy of every tensor before the update"
    if not hasattr(torch, "compile"):
        return "torch.compile is not available"
    return None


def tensor_lrs(optimizer: torch.optim.Optimizer) -> None:
    """Each group's float ``lr`` as a 0-dim tensor, where the optimizer allows it."""
    for group in optimizer.param_groups:
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            continue
        if group.get("foreach") and not group.get("capturable"):
            continue  # torch refuses a tensor lr there; a changed lr recompiles instead
        device = group["params"][0].device if group["params"] else None
        group["lr"] = torch.tensor(lr, dtype=torch.float32, device=device if (
            device is not None and group.get("capturable")) else None)


class FusedUpdate:
    """``optimizer.step()`` compiled with the word sums of ``tensors`` before and after."""

    _made = 0

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        # A code object of its own: torch.compile keeps at most a few compiled versions
        # per code object and runs the rest eagerly, and each optimizer needs one.
        FusedUpdate._made += 1
        code = update_with_sums.__code__.replace(co_name=f"_update_with_sums_{self._made}")
        fn = types.FunctionType(code, update_with_sums.__globals__, code.co_name)
        self._fn: Callable[..., Any] = torch.compile(fn, dynamic=False)

    def __call__(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sums as the update read the tensors, sums as it wrote them)``."""
        with torch.no_grad():
            before, after = self._fn(_own_step(self.optimizer), self.optimizer, tensors)
        return before, after
