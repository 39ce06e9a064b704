"""The guard's at-rest check: every bit of every parameter and optimizer-state tensor,
from the end of one update to the start of the next.

Two ways to take it, chosen once per guard:

* **fused** (SGD, Adam, AdamW): a word sum of each tensor as the update reads it (the
  verification of the window that has just ended) and as it writes it (the record of
  the next one), in the native update on the CPU (:mod:`torchverity.training._native`,
  bit for bit the eager step) where it is proven to reproduce the optimizer, else
  compiled together with the optimizer's step (:mod:`torchverity.training._fused`);
* **two passes** (any other optimizer, or no compiler): a record of every tensor after
  the update and a verification before the next one
  (:mod:`torchverity.training._checksum`), one window in ``rest_every``.

Parameters the optimizer never updates (``requires_grad=False``: a frozen backbone,
the base model under LoRA) are covered too: their sums are recorded once, after the
first update, and verified in a pass of their own with every covered window, since no
update reads them.

Either way a verification yields ``(sums now, record, names)``: two ``[n, k]`` tensors
whose rows differ exactly for the tensors that changed, and the names of those rows.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from torchverity.errors import UsageError
from torchverity.training import _native
from torchverity.training._checksum import PairedSums
from torchverity.training._config import GuardConfig
from torchverity.training._distributed_hook import (
    any_sharded,
    local_params,
    local_shard,
    shard_suffix,
)
from torchverity.training._fused import (
    FusedUpdate,
    tensor_lrs,
    unsupported,
    update_with_sums,
    word_sums,
)
from torchverity.training._snapshot import Snapshot

log = logging.getLogger("torchverity.training")

Pair = tuple[torch.Tensor, torch.Tensor, tuple[str, ...]]


def frozen_parameters(model: torch.nn.Module, covered: bool = True
                      ) -> tuple[list[torch.Tensor], tuple[str, ...]]:
    """The model's ``requires_grad=False`` parameters and their names (none if not
    ``covered``)."""
    named = [(n, p) for n, p in model.named_parameters() if covered and not p.requires_grad]
    return [p for _, p in named], tuple(n for n, _ in named)


class FrozenSums:
    """The at-rest record and verification of parameters no update touches.

    A parameter unfrozen later (``requires_grad`` set again, e.g. gradual unfreezing)
    leaves this set at the next verification, before any update can change it.
    """

    def __init__(self, tensors: list[torch.Tensor], names: tuple[str, ...], split: bool
                 ) -> None:
        self.tensors, self.names, self._split = tensors, names, split
        self._sums = PairedSums(tensors, weighted=False, split=split) if tensors else None
        self.record: torch.Tensor | None = None

    def take(self, pool: ThreadPoolExecutor | None) -> None:
        """Record the sums now (the tensors are as they should stay)."""
        self._drop_unfrozen()
        if self._sums is not None:
            self.record = self._sums(pool)

    def pair(self, pool: ThreadPoolExecutor | None, *, window_ends: bool = True
             ) -> Pair | None:
        """``(sums now, record, names)``; None when nothing is recorded. Where a window
        ends (an update), the sums now become the record of the next, as an update's
        write does for the other tensors: a change is reported once."""
        self._drop_unfrozen()
        if self._sums is None or self.record is None:
            return None
        now, record = self._sums(pool), self.record
        if window_ends:
            self.record = now
        return now, record, self.names

    def _drop_unfrozen(self) -> None:
        keep = [i for i, t in enumerate(self.tensors) if not t.requires_grad]
        if len(keep) == len(self.tensors):
            return
        self.tensors = [self.tensors[i] for i in keep]
        self.names = tuple(self.names[i] for i in keep)
        self._sums = PairedSums(self.tensors, weighted=False, split=self._split) if keep else None
        if self.record is not None:
            self.record = self.record[keep] if keep else None


def join(pair: Pair | None, frozen: Pair | None) -> Pair | None:
    """``pair`` with the frozen rows appended (as many columns as it has)."""
    if pair is None or frozen is None:
        return pair
    width = pair[0].shape[1]
    return (torch.cat([pair[0], _widen(frozen[0], width)]),
            torch.cat([pair[1], _widen(frozen[1], width)]), pair[2] + frozen[2])


def _widen(sums: torch.Tensor, width: int) -> torch.Tensor:
    extra = width - sums.shape[1]
    return torch.cat([sums, sums.new_zeros(sums.shape[0], extra)], dim=1) if extra else sums


class AtRest:
    """Records and verifies the covered tensors; runs the fused update when it can."""

    def __init__(self, config: GuardConfig, optimizer: torch.optim.Optimizer,
                 params: list[torch.Tensor], names: tuple[str, ...], *, reducer: object,
                 policies: dict[str, str], pool: Callable[[], ThreadPoolExecutor | None],
                 split: bool, defer: Callable[[Callable[[], None]], None] | None,
                 said: Callable[[], None] = lambda: None, fallback: str | None = None,
                 frozen: tuple[Sequence[torch.Tensor], tuple[str, ...]] = ((), ())
                 ) -> None:
        self.config, self.optimizer = config, optimizer
        self._param_names = dict(zip(map(id, params), names, strict=True))
        # Under FSDP2, HSDP or TP each rank verifies the shards it holds, named by shard.
        self._params, self._names = local_params(params, names)
        self._device, self._sharded = params[0].device, any_sharded(params)
        self._pool, self._split, self._defer = pool, split, defer
        # The frozen ones this rank holds, on the guard's device (offloaded ones are not read).
        held = [(n, t) for t, n in zip(*local_params(*frozen), strict=True)
                if t.device == self._device]
        self.frozen = FrozenSums([t for _, t in held], tuple(n for n, _ in held), split)
        self._said = said  # writes the coverage to the event log when it changes
        self.record: torch.Tensor | None = None
        self.names: tuple[str, ...] = ()
        self._sums: PairedSums | None = None
        self._copy_sums: PairedSums | None = None
        self._updates = 0  # updates concluded under this guard: the two-pass cadence
        self._native_reason: tuple[str | None] | None = None  # once known
        self.reason = self._fallback_reason(reducer, policies, fallback)
        self.fused: FusedUpdate | _native.NativeUpdate | None = None
        # The compiled step for the updates the native one leaves (compiled arithmetic).
        self._compiled: FusedUpdate | None = None
        self._compiled_reason: str | None = None  # why the compiled step is not native
        if self.reason is not None and config.fused:
            raise UsageError(f"TrainingGuard: fused=True, but {self.reason}",
                             hint="leave fused unset: the guard then verifies in two passes")
        if self.reason is None:
            self.fused = self._fused_update(optimizer)
        self._fused_tensors: list[torch.Tensor] = []
        self._fused_ptrs: list[int] = []
        self._after: torch.Tensor | None = None  # sums the fused update wrote, until settled
        self._listed = False  # the tensors the last update ran on are those of the record
        self._before: torch.Tensor | None = None  # and those it read

    def _fused_update(self, optimizer: torch.optim.Optimizer
                      ) -> FusedUpdate | _native.NativeUpdate:
        """The one-pass kernel where it reproduces ``optimizer.step()`` here; else the
        step ``torch.compile`` makes of it, by the same kernel where it reproduces that
        one, or compiled with the sums."""
        if self.native_reason is None:
            return _native.NativeUpdate(optimizer)
        tensor_lrs(optimizer)
        compiled = FusedUpdate(optimizer)
        self._compiled_reason = self._compiled_native_reason(optimizer)
        if self.config.arithmetic == "eager" and self.config.native:
            log.info("torchverity: the at-rest check rides in torch.compile's arithmetic "
                     "of the update (%s)", self.native_reason)
        if self._compiled_reason is not None:
            return compiled
        self._compiled = compiled
        return _native.NativeUpdate(optimizer, compiled=True)

    def _compiled_native_reason(self, optimizer: torch.optim.Optimizer) -> str | None:
        """Why the native update cannot take the compiled step's arithmetic here."""
        if not self.config.native or self._device.type != "cpu":
            return self.native_reason  # the same cause
        try:
            return (_native.unsupported(optimizer, compiled=True)
                    or _native.agrees(optimizer, compiled=True))
        except Exception as exc:  # the proof compiles: the compiled update will say why
            return f"torch.compile failed: {type(exc).__name__}"

    @property
    def native_reason(self) -> str | None:
        """Why the native update does not run this optimizer here (None: it does), proven
        once per guard."""
        if self._native_reason is None:
            cfg = self.config
            why = "native=False" if not cfg.native else (
                "arithmetic='compiled'" if cfg.arithmetic == "compiled" else (
                    _native.unsupported(self.optimizer) or _native.agrees(self.optimizer)))
            self._native_reason = (why,)
        return self._native_reason[0]

    def _fallback_reason(self, reducer: object, policies: dict[str, str],
                         fallback: str | None) -> str | None:
        cfg = self.config
        if not cfg.at_rest:
            return "at_rest=False"
        if cfg.fused is False:
            return "fused=False"
        if fallback is not None:
            return fallback
        if cfg.rest_every != 1:
            return f"rest_every={cfg.rest_every} verifies one window in {cfg.rest_every}"
        if cfg.defer_record:
            return "defer_record=True takes the record on a helper thread"
        # A fused=True optimizer's own kernel takes no sums; the native update stands in
        # for it where it is proven to compute the same.
        fused_ok = any(g.get("fused") for g in self.optimizer.param_groups) and (
            self.native_reason is None)
        return unsupported(self.optimizer, reducer, policies, cfg.update_ratio, fused_ok)

    def coverage(self) -> dict[str, Any]:
        """What is verified, for the guard's first log event."""
        cfg = self.config
        if not cfg.at_rest:
            return {"windows": "none", "tensors": "none", "verification": None}
        windows = "every" if cfg.rest_every == 1 else f"1 in {cfg.rest_every}"
        tensors = "parameters and optimizer state" if cfg.optimizer_state else "parameters"
        how = "fused into the update" if self.fused is not None else "two passes"
        native = isinstance(self.fused, _native.NativeUpdate)
        update = None if self.fused is None else ("native" if native else "compiled")
        arithmetic = None if self.fused is None else (
            "compiled" if not native or self._compiled is not None else "eager")
        reasons = [r for r in (self.native_reason, self._compiled_reason) if r is not None]
        return {"windows": windows, "tensors": tensors, "verification": how,
                "update": update, "arithmetic": arithmetic,
                "update_reason": "; ".join(dict.fromkeys(reasons))
                if arithmetic == "compiled" else None,
                "fallback_reason": self.reason if self.fused is None else None,
                "frozen_parameters": len(self.frozen.names)}

    # ------------------------------------------------------------ tensors covered

    def _state_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for p, state in self.optimizer.state.items():
            name = self._param_names.get(id(p))
            if name is None:
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device == self._device:
                    yield f"optimizer.{name}.{key}{shard_suffix(value)}", local_shard(value)

    def covered_tensors(self, with_state: bool) -> list[torch.Tensor]:
        """The tensors of :meth:`covered` without their names: the per-step path."""
        tensors = list(self._params)
        if with_state:
            dev, known = self._device, self._param_names
            cpu = dev.type == "cpu"  # is_cpu costs less than building a device to compare
            for p, state in self.optimizer.state.items():
                if id(p) in known:
                    values = [v for v in state.values() if isinstance(v, torch.Tensor)
                              and (v.is_cpu if cpu else v.device == dev)]
                    tensors.extend(map(local_shard, values) if self._sharded else values)
        return tensors

    def covered(self, with_state: bool) -> tuple[tuple[str, ...], list[torch.Tensor]]:
        """Parameters, then (``with_state``) optimizer-state tensors on the guard's device."""
        names: list[str] = list(self._names)
        tensors: list[torch.Tensor] = list(self._params)
        if with_state:
            for name, value in self._state_items():
                names.append(name)
                tensors.append(value)
        return tuple(names), tensors

    # ------------------------------------------------------------ around an update

    def before(self, snapshot: Snapshot, use_copy: bool) -> Pair | None:
        """Two passes: verify before the update (None when this window is not covered).
        Fused: nothing yet, the update verifies."""
        if self.fused is not None:
            return None
        record, self.record = self.record, None
        sums = self._sums
        if record is None or sums is None:
            return None
        # Right after the undo copy, the copy holds the same bits as the live tensors and
        # is still in cache: summing it instead saves a read from memory.
        copied = snapshot.copies_of(sums.tensors) if use_copy else None
        if copied is not None:
            if self._copy_sums is None or not self._copy_sums.matches(copied):
                self._copy_sums = PairedSums(copied, weighted=sums.weighted, split=self._split)
            pair = self._copy_sums(self._pool()), record, self.names
        else:
            pair = sums(self._pool()), record, self.names
        return join(pair, self.frozen.pair(self._pool()))

    def update(self) -> Pair | None:
        """Run ``optimizer.step()``; fused, with the window's verification in the same pass
        (and the frozen parameters' in a pass of their own)."""
        frozen = self.frozen.pair(self._pool())  # before the update: nothing can blur it
        return join(self._update(), frozen)

    def _update(self) -> Pair | None:
        if self.fused is None:
            self.optimizer.step()
            return None
        tensors = self.covered_tensors(self.config.optimizer_state)
        ptrs = list(map(torch.Tensor.data_ptr, tensors))
        same = self._same(tensors, ptrs)
        # The names are rebuilt only when the set changed: formatting them for every
        # state tensor at every update costs more than the guard's other Python.
        names = self.names if same else self.covered(self.config.optimizer_state)[0]
        pair = None if same or self.record is None else (
            word_sums(self._fused_tensors).unsqueeze(1), self.record, self.names)
        try:
            fused = self.fused
            if isinstance(fused, _native.NativeUpdate):
                sums = fused(tensors, ptrs)
                # It creates no state and moves no storage: after() need not list the
                # tensors again (the next update's comparison still would see it).
                self._listed = sums is not None
            else:
                sums, self._listed = fused(tensors), False
            if sums is None:  # the native update leaves this one (it creates state)
                sums = self._compiled(tensors) if self._compiled is not None else (
                    update_with_sums(lambda opt: type(opt).step(opt), self.optimizer, tensors))
            before, after = sums
            # What the LR scheduler's wrapper of ``optimizer.step`` would have noted: it
            # warns of a schedule stepped before the optimizer otherwise.
            self.optimizer._opt_called = True  # type: ignore[attr-defined]
        except Exception as exc:  # compiling raises before anything runs: step eagerly
            if pair is None and self.record is not None:  # verify the window in a pass
                pair = word_sums(self._fused_tensors).unsqueeze(1), self.record, self.names
            self._give_up(exc)
            self.optimizer.step()
            return pair
        if pair is None and self.record is not None:
            pair = before.unsqueeze(1), self.record, names
        self._before = before.unsqueeze(1)
        # The native update moves no storage; another way of stepping may have.
        self._set_fused(names, tensors, after, ptrs if self._listed else None)
        return pair

    def _same(self, tensors: list[torch.Tensor], ptrs: list[int] | None = None) -> bool:
        """Whether ``tensors`` (at ``ptrs``) are those of the record, in the same storage
        (not so when the last update created state, or storage moved: the recorded ones
        are then verified in a pass of their own)."""
        return (len(tensors) == len(self._fused_tensors)
                and all(map(operator.is_, tensors, self._fused_tensors))
                and (ptrs if ptrs is not None else list(map(torch.Tensor.data_ptr, tensors)))
                == self._fused_ptrs)

    def _set_fused(self, names: tuple[str, ...], tensors: list[torch.Tensor],
                   after: torch.Tensor, ptrs: list[int] | None = None) -> None:
        self.names, self._fused_tensors = names, tensors
        self._fused_ptrs = ptrs if ptrs is not None else list(map(torch.Tensor.data_ptr,
                                                                  tensors))
        self.record = after.unsqueeze(1)
        self._after = self.record

    def _give_up(self, exc: Exception) -> None:
        log.warning("torchverity: the fused at-rest check is not available here (%s: %s); "
                    "verifying in two passes", type(exc).__name__, exc)
        self.reason = f"torch.compile failed: {type(exc).__name__}"
        self.fused = self._compiled = None
        self.record, self._fused_tensors = None, []
        self._said()

    def to_two_passes(self, reason: str) -> Pair | None:
        """From the fused check to two passes, for good: the window under way is verified
        now (its record is a fused one), the next one recorded after the update."""
        pair = self.now()
        self.reason, self.fused, self._compiled = reason, None, None
        self.record, self._fused_tensors, self._after = None, [], None
        self._said()
        return pair

    def skipped(self) -> Pair | None:
        """Fused, the update not run: verify the window now, in a pass of its own."""
        if self.fused is None or self.record is None:
            return None
        now = word_sums(self._fused_tensors).unsqueeze(1)
        pair = now, self.record, self.names
        self.record = now
        return join(pair, self.frozen.pair(self._pool()))

    def after(self, applied: torch.Tensor | bool, undone: bool) -> None:
        """After the update is concluded: record the next window (two passes, on the
        cadence), or settle the fused record when the update was undone from a copy."""
        self._updates += 1
        if self.config.at_rest and self.frozen.record is None:
            self.frozen.take(self._pool())
        if self.fused is not None:
            written, self._after = self._after, None
            listed, self._listed = self._listed, False
            moved = not listed and not self._same(
                self.covered_tensors(self.config.optimizer_state))
            if moved or self.record is None:
                self.names, tensors = self.covered(self.config.optimizer_state)
                self._set_fused(self.names, tensors, word_sums(tensors))
            elif undone and written is not None and self._before is not None:
                self.record = torch.where(torch.as_tensor(applied), written, self._before)
            return
        cfg = self.config
        if not cfg.at_rest or (self._updates + 1) % cfg.rest_every:
            return
        if self._defer is not None:
            # Opt-in: the whole pass on the helper, beside the next forward and backward
            # (waited for by the next check()). A bit that changes before the helper has
            # summed its word is part of the record: that stretch is not covered.
            self.record = None
            self._defer(functools.partial(self._deferred_record, self._current_sums()))
        else:
            self.record = self._current_sums()(self._pool())

    def _deferred_record(self, sums: PairedSums) -> None:
        self.record = sums()

    def _current_sums(self) -> PairedSums:
        """The checksum plan of the covered tensors; re-listed when they changed."""
        with_state = self.config.optimizer_state
        sums = self._sums
        if sums is None or not sums.matches(self.covered_tensors(with_state)):
            self.names, tensors = self.covered(with_state)
            sums = self._sums = PairedSums(tensors, weighted=self.config.rest_weighted,
                                           split=self._split)
        return sums

    # ------------------------------------------------------------ outside an update

    def now(self) -> Pair | None:
        """``(sums now, record)`` without consuming the record; None when nothing is
        recorded (a certification then has nothing to stand on)."""
        if self.record is None:
            return None
        if self.fused is not None:
            pair = word_sums(self._fused_tensors).unsqueeze(1), self.record, self.names
        elif self._sums is None:
            return None
        else:
            pair = self._sums(), self.record, self.names
        return join(pair, self.frozen.pair(None, window_ends=False))

    def changed(self) -> tuple[str, ...] | None:
        """The covered tensors that changed since the record; None when none is kept."""
        pair = self.now()
        if pair is None:
            return None
        flags = (pair[0] != pair[1]).any(dim=1).tolist()
        return tuple(n for n, f in zip(pair[2], flags, strict=True) if f)

    def refresh(self) -> None:
        """Record again: parameters were changed on purpose outside an update."""
        if not self.config.at_rest:
            return
        self.frozen.take(self._pool())
        if self.fused is not None:
            self.names, tensors = self.covered(self.config.optimizer_state)
            self._set_fused(self.names, tensors, word_sums(tensors))
            self._after = None
        else:
            self.record = self._current_sums()(self._pool())
