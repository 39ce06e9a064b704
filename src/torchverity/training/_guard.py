"""TrainingGuard: catch, locate and recover from training anomalies without host syncs.

Three lines in a plain loop::

    guard = TrainingGuard(model, optimizer, log="events.jsonl")
    for batch in loader:
        optimizer.zero_grad()
        loss = loss_fn(model(batch.x), batch.y)
        loss.backward()
        guard.check(loss)          # after backward, before the update
        guard.step()               # replaces optimizer.step(); skips the update when told to
    guard.close()                  # reads the last flags, writes the summary

With clipping, ``guard.clip_grad_norm_(max_norm)`` between ``check`` and ``step`` clips
with the norms ``check`` took (torch's result, bit for bit; one read of the gradients).

Every step, with statistics and flags kept on the device (on floats when the parameters
are on the CPU: :mod:`~torchverity.training._host_rules`, else
:mod:`~torchverity.training._device_rules`), it detects NaN/Inf, loss and gradient-norm
spikes, relative loss jumps, optionally per-layer and update-ratio spikes and replay
mismatches, and ``weights_changed``: any bit of a parameter or optimizer-state tensor
that changed between two updates, in every window by default
(:mod:`~torchverity.training._at_rest`; for SGD, Adam and AdamW inside the update
itself, :mod:`~torchverity.training._native` and :mod:`~torchverity.training._fused`).

The host reads the flags every ``check_every`` steps (one transfer); the interval changes
when an anomaly is reported, never what is detected. On the CPU a skipped update is
simply not run; on an accelerator it is skipped on the device (a fused optimizer's
``found_inf``, else a copy restored: :mod:`~torchverity.training._update`). Policies per
kind (:mod:`~torchverity.training._policy`): ``record``, ``warn``, ``skip``, ``stop``
(raise :class:`TrainingAnomalyError`), ``rollback`` (reload the last certified
checkpoint, :mod:`~torchverity.training._recovery`) and ``replay`` (re-run the step to
classify it, :mod:`~torchverity.training._replay`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from torchverity.errors import UsageError
from torchverity.training._at_rest import AtRest, frozen_parameters
from torchverity.training._config import GuardConfig, Reducer
from torchverity.training._device_rules import DeviceDetectors, DevicePending
from torchverity.training._distributed_hook import DistributedHook, any_sharded
from torchverity.training._events import (
    ACTIONS,
    KIND_INDEX,
    SKIPPING,
    AnomalyEvent,
    AnomalyWarning,
    EventLog,
    GuardSummary,
    Tally,
)
from torchverity.training._helper import Helper
from torchverity.training._host_rules import HostDetectors, HostPending
from torchverity.training._modes import step_modes
from torchverity.training._norms import GradNorms, clip_with_norms
from torchverity.training._policy import (
    check_policy_needs,
    resolve_actions,
    resolve_policies,
    stop_error,
)
from torchverity.training._recovery import Recovery
from torchverity.training._replay import Replayer, torch_rng
from torchverity.training._rows import Row, Rules, parse_row, row_values
from torchverity.training._update import Update


def _scalar(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a detached float32 scalar (the mean of a non-scalar loss)."""
    loss = loss.detach()
    if loss.dim() == 0 and loss.dtype == torch.float32:
        return loss  # already the value: no op to dispatch
    return loss.float().mean()


def _unwrapped(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model and the modules it wraps (DDP's and DataParallel's ``module``,
    ``torch.compile``'s ``_orig_mod``): a checkpoint is loaded into any of them."""
    chain = [model]
    parallel = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    while True:
        inner = chain[-1].module if isinstance(chain[-1], parallel) else getattr(
            chain[-1], "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module) or inner in chain:
            return chain
        chain.append(inner)


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class TrainingGuard:
    """Guards a model/optimizer pair; see the module documentation for the loop."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        log: str | Path | None = None,
        policy: str | None = None,
        policies: Mapping[str, str] | None = None,
        step_fn: Callable[[Any], torch.Tensor] | None = None,
        checkpoint_dir: str | Path | None = None,
        reducer: Reducer | None = None,
        start_step: int = 0,
        fused_unavailable: str | None = None,
        **options: Any,
    ) -> None:
        # fused_unavailable: why a caller that runs optimizer.step() itself (a trainer
        # integration) cannot let update() stand in for it; the at-rest check then takes
        # two passes from the start, and the first log event says why.
        try:
            self.config = GuardConfig(**options)
        except TypeError:
            unknown = sorted(set(options) - {f.name for f in dataclasses.fields(GuardConfig)})
            raise UsageError(f"TrainingGuard got unknown options: {', '.join(unknown)}") from None
        self.config.validate()
        self.model, self.optimizer, self.step_fn, self.reducer = model, optimizer, step_fn, reducer
        self.policies = resolve_policies(policy, policies, checkpoint_dir)
        check_policy_needs(self.policies, checkpoint_dir, step_fn, self.config.replay_every)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.global_step = self._start_step = start_step
        self.rank = _rank()
        self._fused_unavailable = fused_unavailable
        self.events: list[AnomalyEvent] = []
        self._tally = Tally()
        self._log = EventLog(log, self.rank)
        self._setup_params()
        self._setup_device_state()
        self._rows: list[Row] = []
        self._pending: DevicePending | HostPending | None = None
        self._recovery = Recovery(self, self.checkpoint_dir)
        self._distributed = DistributedHook(self, self.config.replica_every)
        self._log.write({"event": "start", "step": start_step, "config": self.config,
                         "policies": self.policies, "parameters": list(self._names),
                         "coverage": self._rest.coverage()})
        # The window before the first update is covered too: after a resume it lies between
        # two updates (the one before the save and the one after the load). A load through
        # load_state_dict later (a resume after the guard was made) records again.
        self._rest.refresh()
        self._load_hooks: tuple[Any, ...] = (
            *(m.register_load_state_dict_post_hook(self._loaded) for m in _unwrapped(model)),
            optimizer.register_load_state_dict_post_hook(self._loaded))
        if self.checkpoint_dir is not None:
            # The starting point, recorded and saved at the same instant: a checkpoint that
            # rollback can always go back to.
            self.save_checkpoint()

    def _setup_params(self) -> None:
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if not named:
            raise UsageError("TrainingGuard: the model has no trainable parameters")
        self._names = tuple(n for n, _ in named)
        self._params: list[torch.Tensor] = [p for _, p in named]
        self._device = self._params[0].device
        self._sharded = any_sharded(self._params)  # DTensors: the guard sees local shards

    def _setup_device_state(self) -> None:
        cfg, dev, n = self.config, self._device, len(self._params)
        replaying = "replay" in self.policies.values() or cfg.replay_every is not None
        self._modes = modes = step_modes(cfg, self.policies, self.optimizer, self._params)
        # A second thread on the CPU; an accelerator already runs the work asynchronously.
        self._helper = Helper() if (cfg.overlap or cfg.defer_record) and modes.on_cpu else None
        self._split = cfg.overlap and modes.on_cpu  # halves of each pass on the helper
        self._host = HostDetectors(cfg, n, self.policies) if modes.host_rules else None
        self._rules = None if modes.host_rules else DeviceDetectors(cfg, n, self.policies, dev)
        self._step_norms: torch.Tensor | None = None  # check()'s per-parameter norms
        self._upd = Update(self)
        defer = self._helper.submit if cfg.defer_record and self._helper else None
        self._rest = AtRest(cfg, self.optimizer, self._params, self._names,
                            reducer=self.reducer, policies=self.policies, pool=self._pool,
                            split=self._split, defer=defer, said=self._say_coverage,
                            fallback=self._fused_unavailable,
                            frozen=frozen_parameters(self.model, cfg.frozen_parameters))
        self._norms = GradNorms(self._params)
        self._replay = Replayer(cfg, self.optimizer, self._params, self._names, self.step_fn,
                                lambda: self._norms.stacked(self._pool()), replaying)

    def _say_coverage(self) -> None:
        self._log.write({"event": "coverage", "step": self.global_step,
                         "coverage": self._rest.coverage()})

    @property
    def fused(self) -> bool:
        """Whether the at-rest check runs inside the optimizer's update (native or compiled)."""
        return self._rest.fused is not None

    @property
    def checked(self) -> bool:
        """Whether this step's ``check()`` has run and its update is still to come."""
        return self._pending is not None

    @property
    def checkpoints(self) -> list[Path]:
        """The guard's checkpoints still on disk, oldest first."""
        return self._recovery.checkpoints

    # ------------------------------------------------------------ per-step API

    def check(self, loss: torch.Tensor, *, batch: Any = None) -> None:
        """Compute this step's flags on the device (after backward, before the update)."""
        if self._pending is not None:
            raise UsageError("TrainingGuard.check() called twice in one step",
                             hint="call guard.step() after each check()")
        self._pending = self._detect_step(_scalar(loss), None)
        if self._replay.enabled and batch is not None:
            self._remember(batch, self._pending)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(params, max_norm)`` with the per-parameter norms
        ``check()`` has just taken: one read of the gradients serves the detectors and the
        clipping. Call it between ``check()`` and ``step()`` (the rules see the norms before
        clipping); it returns the total norm, as torch's does. Float32 gradients come out
        bit-identical to torch's (lower-precision norms are accumulated in float32). With
        the rules on floats (CPU parameters) an update that needs no clipping skips the
        multiply by 1.0 that torch does, saving a read and a write of every gradient."""
        norms, self._step_norms = self._step_norms, None  # the norms of unclipped gradients
        if self._pending is None or norms is None:
            raise UsageError("TrainingGuard.clip_grad_norm_() called before this step's check(), "
                             "or twice in one step",
                             hint="call guard.check(loss), then guard.clip_grad_norm_(max_norm), "
                                  "then guard.step()")
        return clip_with_norms(self._params, norms, max_norm, sharded=self._sharded,
                               read_coefficient=self._host is not None)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run ``optimizer.step()`` under the guard; a flagged update is skipped, on the host
        (not run at all) when the parameters are on the CPU, else on the device."""
        result = self.update(closure)
        self.after_update()
        return result

    def update(self, closure: Callable[[], Any] | None = None) -> Any:
        """:meth:`step` without concluding the step, for a trainer that calls
        ``optimizer.step()`` itself and lets this stand in for it (the trainer
        integrations): fused, the window that has just ended is verified inside the
        update; :meth:`after_update` then concludes the step."""
        if not self._modes.host_skip:
            self._prepare(host=False)
            result = self._run_update(closure)
        elif self._prepare(host=True):
            result = self._run_update(closure)
        else:
            self._upd.found(self._pending, self._rest.skipped())
            result = None
            if closure is not None:  # the optimizer would have evaluated it once at least
                with torch.enable_grad():
                    result = closure()
        return result

    def _run_update(self, closure: Callable[[], Any] | None) -> Any:
        """The optimizer's update; fused, it verifies the window that has just ended."""
        if self._rest.fused is None:
            return self.optimizer.step() if closure is None else self.optimizer.step(closure)
        result = None
        if closure is not None:  # what the optimizer's own step would do first
            with torch.enable_grad():
                result = closure()
        self._upd.found(self._pending, self._rest.update())
        return result

    def train_step(self, batch: Any) -> torch.Tensor:
        """One whole guarded step with ``step_fn``: zero_grad, forward, backward, check, step."""
        if self.step_fn is None:
            raise UsageError("train_step() needs step_fn= given to TrainingGuard")
        self.wait()
        self._replay.rng_next = torch_rng()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.step_fn(batch)
        loss.backward()
        loss_d = _scalar(loss)
        every = self.config.replay_every
        replay_vec = None
        if every is not None and self.global_step % every == 0:
            replay_vec = self._replay.audit(batch, loss_d)
        self._pending = self._detect_step(loss_d, replay_vec)
        if self._replay.enabled:
            self._remember(batch, self._pending)
        self.step()
        return loss.detach()

    def before_update(self, reason: str | None = None) -> None:
        """Verify the at-rest checksums; copy parameters and optimizer state so a flagged
        update can be undone on the device (or hand the decision to a fused optimizer).
        For callers that run ``optimizer.step()`` themselves and cannot let :meth:`update`
        stand in for it: the at-rest check cannot ride on an update it does not run, so
        it takes two passes (``reason``, said once in the log, says why)."""
        if self._rest.fused is not None:
            sums = self._rest.to_two_passes(reason or (
                "the caller runs optimizer.step() itself (before_update/after_update)"))
            if sums is not None and self._pending is not None:
                self._upd.fill_rest(self._pending, sums)
        self._prepare(host=False)

    def _prepare(self, host: bool) -> bool:
        if self._pending is None:
            raise UsageError("TrainingGuard.step() called before check(loss)",
                             hint="call guard.check(loss) after loss.backward()")
        self.wait()
        return self._upd.prepare(self._pending, host)

    def after_update(self) -> None:
        """Decide on the device whether the update stands, record checksums, maybe read flags."""
        pending, self._pending = self._pending, None
        self._step_norms = None
        assert pending is not None
        if isinstance(pending, HostPending):
            host_row, book = self._upd.conclude_host(pending), None
        else:
            host_row, book = None, self._upd.conclude_device(pending)
        step, self.global_step = self.global_step, self.global_step + 1
        self._recovery.since_checkpoint += 1
        if self._replay.enabled:
            self._replay.rng_next = torch_rng()
        # With the rules on floats a change at rest is known on the host at once: a policy
        # that acts on it (stop, rollback, ...) does so before the next forward pass.
        due = (step + 1 - self._start_step) % self.config.check_every == 0 or (
            host_row is not None and host_row[KIND_INDEX["weights_changed"]] > 0
            and self.policies["weights_changed"] in SKIPPING)
        # The record is complete before step() returns: a bit that changes afterwards,
        # however soon, is a change against it (with a helper, half of it ran there).
        self._rest.after(self._upd.applied, pending.undo)
        if host_row is not None:
            self._rows.append(Row(step, host_row, pending.rest_names))
        elif book is not None:
            assert isinstance(pending, DevicePending)
            keep = functools.partial(self._bookkeep, step, pending, book)
            if self._helper is None or not self._split or due:  # a flush reads the row now
                keep()
            else:  # touches no guarded tensor: runs beside the next forward pass
                self._helper.submit(keep)
        if due:
            self._read_flags()
        self._distributed.after_update(step)

    def _bookkeep(self, step: int, pending: DevicePending, book: dict[str, torch.Tensor]
                  ) -> None:
        """After the update: rolling statistics, and the step's row for the next flush."""
        row = self._device_rules().conclude(pending, book["flags"], book["applied"],
                                            book["accept"], book["ratio"], book["ratio_vec"])
        self._rows.append(Row(step, row, pending.rest_names))

    def wait(self) -> None:
        """Wait until the work the guard runs beside training (CPU parameters) is done:
        called before the guard's own state is read or changed."""
        if self._helper is not None:
            self._helper.join()

    def _device_rules(self) -> DeviceDetectors:
        assert self._rules is not None, "the rules run on floats on this guard"
        return self._rules

    def _engine(self) -> Rules:
        return self._host if self._host is not None else self._device_rules()

    # ------------------------------------------------------------ detectors

    def _detect_step(self, loss: torch.Tensor, replay_vec: torch.Tensor | None
                     ) -> DevicePending | HostPending:
        """This step's flags: on floats (one read of the norms and the loss) or the device."""
        self.wait()  # the previous step's statistics and flag row
        if self._host is None:
            gvec = self._step_norms = self._norms.stacked(self._pool())
            return self._device_rules().detect(loss, gvec, replay_vec)
        stacked = torch.stack([*self._norms.norms(self._pool()), loss])
        self._step_norms = stacked[:-1]
        values = stacked.tolist()
        replay = replay_vec.tolist() if replay_vec is not None else None
        return self._host.detect(values[-1], values[:-1], replay)

    def _remember(self, batch: Any, pending: DevicePending | HostPending) -> None:
        if isinstance(pending, HostPending):  # the float32 values, exactly
            loss, gvec = (torch.tensor(v, dtype=torch.float32) for v in (pending.loss,
                                                                        pending.gvec))
        else:
            loss, gvec = pending.loss, pending.gvec
        self._replay.remember(self.global_step, batch, loss, gvec)

    def _pool(self) -> ThreadPoolExecutor | None:
        """The helper's pool for the half of a verification that runs beside this thread."""
        return self._helper.pool if self._helper is not None and self._split else None

    def refresh(self) -> None:
        """Re-record the at-rest checksums after changing parameters outside ``step()``
        (a ``load_state_dict`` of the model or the optimizer does this itself)."""
        self.wait()
        self._rest.refresh()

    def _loaded(self, *_: Any) -> None:
        """A ``load_state_dict`` of the model or the optimizer: its bytes are the record."""
        if self._pending is None:  # not between check() and step(), where nothing loads
            self.refresh()

    # ------------------------------------------------------------ host side

    def flush(self) -> list[AnomalyEvent]:
        """Read the flags of the steps since the last read (one device-to-host transfer)."""
        self.wait()
        return self._read_flags()

    def _read_flags(self) -> list[AnomalyEvent]:
        rows, self._rows = self._rows, []
        if not rows:
            return []
        events: list[AnomalyEvent] = []
        for r, values in zip(rows, row_values(rows), strict=True):
            ctx = parse_row(values, self._names, r.rest_names)
            self._log.write({"event": "metrics", "step": r.step, "loss": ctx.loss,
                             "grad_norm": ctx.gnorm, "applied": ctx.applied})
            self._tally.skipped += not ctx.applied
            events.extend(ctx.events(r.step, self.policies, self.rank))
        self._act(events)
        self._replay.history.clear()
        self._log.flush()
        return events

    def _act(self, events: list[AnomalyEvent]) -> None:
        events = resolve_actions(events, self._do_replay)
        for event in events:
            self._tally.anomalies[event.kind] += 1
            self.events.append(event)
            self._log.write(event.to_dict())
            if event.policy == "warn":
                warnings.warn(f"torchverity: training anomaly at {event.describe()}",
                              AnomalyWarning, stacklevel=3)
        self._recovery.note(events)
        stops = [e for e in events if e.policy == "stop"]
        rollbacks = [e for e in events if e.action == ACTIONS["rollback"]]
        if rollbacks and not stops:
            self.rollback(rollbacks[0].step)
        self._engine().clear_latch()
        if stops:
            self._tally.stopped = True
            self._log.flush()
            raise stop_error(stops[0], self._log.path)
        if not events:
            self._recovery.maybe_save()

    def _do_replay(self, step: int) -> str:
        verdict, differing = self._replay.replay(step)
        self._tally.replays[verdict] += 1
        self._log.write({"event": "replay", "step": step, "classification": verdict,
                         "differing": list(differing)})
        return verdict

    # ------------------------------------------------------------ checkpoints

    def certify(self) -> dict[str, Any]:
        """Verify the covered tensors at rest now: the certification a checkpoint records."""
        self.wait()
        return self._recovery.certify()

    def save_checkpoint(self) -> Path:
        """Save model, optimizer, guard statistics and RNG states with ``torchverity.save``
        and the certification (a sharded model: ``save_dcp`` on every rank together)."""
        return self._recovery.save()

    def rollback(self, step: int | None = None) -> Path:
        """Reload the newest certified checkpoint (verified by torchverity.load / load_dcp)."""
        return self._recovery.rollback(step)

    def state_dict(self) -> dict[str, Any]:
        """The guard's own state (rolling windows, rule state, counters), for a trainer's
        checkpoint; :meth:`load_state_dict` restores it on resume."""
        self.wait()
        return self._recovery.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait()
        self._recovery.load_state_dict(state)

    # ------------------------------------------------------------ end

    def summary(self) -> GuardSummary:
        return self._tally.summary(self.global_step, self.rank)

    def close(self) -> GuardSummary:
        """Read the remaining flags, write the summary event and close the log."""
        try:
            self.flush()
        finally:
            self._close_helper()
            summary = self.summary()
            self._log.write({"event": "summary", **dataclasses.asdict(summary)})
            self._log.close()
        return summary

    def _close_helper(self) -> None:
        for hook in self._load_hooks:
            hook.remove()
        self._load_hooks = ()
        if self._helper is not None:
            self._helper.close()
            self._helper = None

    def __enter__(self) -> TrainingGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._close_helper()
            self._log.close()
