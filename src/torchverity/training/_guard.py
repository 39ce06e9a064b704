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

What it detects, every step, with statistics and flags kept on the device (when the
parameters are on the CPU, ``stats="auto"`` runs the same rules on Python floats
instead: one read of the gradient norms and the loss per step, see
:mod:`torchverity.training._host_rules`; the device rules are
:mod:`torchverity.training._device_rules`):

* ``nonfinite_loss`` / ``nonfinite_grad``: NaN or Inf, the gradient named by parameter;
* ``loss_spike`` / ``grad_norm_spike``: value above ``mean + sigma * std`` of a rolling
  window of accepted steps (OLMo's defaults: 6 sigma, 128 steps, 64 before it is armed);
* ``loss_jump``: the relative-change rule ``|Δloss| / |prev| > rel_change`` for
  ``rel_patience`` steps in a row;
* ``layer_grad_spike`` / ``update_ratio_spike`` (opt-in): the same rolling rule per
  parameter, on gradient norms and on ``|Δp| / |p|``;
* ``weights_changed``: a device checksum of every parameter and optimizer-state tensor
  is taken right after an update and compared before the next one: any bit that
  changed in between is caught and the tensor named, however small the change. One
  update window in ``rest_every`` (default 10) is verified, whatever ``check_every``;
  ``rest_every=1`` verifies every window;
* ``replay_mismatch``: with ``replay_every=K`` (and a ``step_fn``) every K-th step is
  run twice from the same RNG state and must give the same loss and gradients.

The host reads the flags every ``check_every`` steps (one transfer); the interval changes
when an anomaly is reported, never what is detected. When every
guarded parameter lives on the CPU (``host_skip=None``, the default, decides at
construction), ``step()`` reads the step's skip decision on the host, which on a
CPU tensor is a memory read and not a device sync, and does not call
``optimizer.step()`` for a skipped update: no copy, exact for every optimizer.
On an accelerator (or with ``host_skip=False``) a step is skipped on the device
(a fused optimizer's ``found_inf``, otherwise parameters and optimizer state
restored from a copy taken before the update) so ``step()`` is always called.
With ``overlap=True`` (CPU parameters, a core to spare) a helper thread sums half of
the bytes of each memory-bound pass and keeps the books beside the next forward pass.
With ``defer_record=True`` (CPU parameters) the at-rest record is summed by the helper
beside the next forward pass: a bit that changes before the helper read it is not
covered.
Policies per kind:
``record``, ``warn``, ``skip``, ``stop`` (raise :class:`TrainingAnomalyError`),
``rollback`` (reload the last checkpoint verified by torchverity and go on) and
``replay`` (re-run the anomalous step to classify it as ``transient`` or
``reproducible``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchverity.errors import TrainingAnomalyError, UsageError
from torchverity.training._at_rest import AtRest, Pair
from torchverity.training._checksum import balanced_cut, checksums, run_beside
from torchverity.training._config import GuardConfig, Reducer
from torchverity.training._device_rules import DeviceDetectors, DevicePending
from torchverity.training._events import (
    ACTIONS,
    DEFAULT_POLICIES,
    KIND_INDEX,
    KINDS,
    LATCHING,
    POLICIES,
    SKIPPING,
    AnomalyEvent,
    AnomalyWarning,
    EventLog,
    GuardSummary,
    Tally,
)
from torchverity.training._host_rules import HostDetectors, HostPending
from torchverity.training._snapshot import Snapshot


@dataclass(frozen=True)
class _Row:
    step: int
    row: torch.Tensor | list[float]  # device path: a tensor read at the flush; host: floats
    rest_names: tuple[str, ...]


@dataclass
class _History:
    """What a replay of one step needs: its batch, RNG state and original results."""

    batch: Any
    rng: tuple[torch.Tensor, tuple[torch.Tensor, ...]]
    grad_sums: torch.Tensor
    loss: torch.Tensor
    grad_norms: torch.Tensor


_N_SCALARS = 5  # loss, grad_norm, loss threshold, grad-norm threshold, applied


def _scalar(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a detached float32 scalar (the mean of a non-scalar loss)."""
    loss = loss.detach()
    if loss.dim() == 0 and loss.dtype == torch.float32:
        return loss  # already the value: no op to dispatch
    return loss.float().mean()


def _row_values(rows: list[_Row]) -> list[list[float]]:
    """Each row's values: device rows read in one transfer, host rows as they are."""
    tensors = [r.row for r in rows if isinstance(r.row, torch.Tensor)]
    flat = torch.cat(tensors).cpu().tolist() if tensors else []
    out, offset = [], 0
    for r in rows:
        if isinstance(r.row, torch.Tensor):
            size = r.row.numel()
            out.append(flat[offset: offset + size])
            offset += size
        else:
            out.append(r.row)
    return out


def _torch_rng() -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else ()
    return torch.get_rng_state(), cuda


def _set_torch_rng(state: tuple[torch.Tensor, tuple[torch.Tensor, ...]]) -> None:
    torch.set_rng_state(state[0])
    if state[1]:
        torch.cuda.set_rng_state_all(list(state[1]))


class _Helper:
    """One background thread for guard work that may run beside the training thread.

    Opt-in (``overlap=True``), for CPU parameters with a core to spare; on an
    accelerator the work is already asynchronous. It sums half of the bytes of each
    memory-bound pass (gradient norms, at-rest verification and record) beside the
    training thread, each pass complete before the guard goes on (the verification
    before the update starts, the record before ``step()`` returns), and takes the
    step's bookkeeping (device rules: statistics, flag row), which touches no guarded
    tensor, beside the next forward pass. With ``defer_record=True`` (alone or with
    ``overlap``) it also takes the whole at-rest record beside the next forward pass.
    Jobs run in submission order; :meth:`join` waits for all of them and re-raises the
    first failure.
    """

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="torchverity-guard")
        self._jobs: list[Future[None]] = []

    def submit(self, fn: Callable[[], None]) -> None:
        self._jobs.append(self.pool.submit(_no_grad_call, fn))

    def join(self) -> None:
        jobs, self._jobs = self._jobs, []
        for job in jobs:
            job.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _no_grad_call(fn: Callable[[], None]) -> None:
    # Grad mode is per thread, and a new thread starts with it on.
    with torch.no_grad():
        fn()


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
        **options: Any,
    ) -> None:
        try:
            self.config = GuardConfig(**options)
        except TypeError:
            unknown = sorted(set(options) - {f.name for f in dataclasses.fields(GuardConfig)})
            raise UsageError(f"TrainingGuard got unknown options: {', '.join(unknown)}") from None
        self.config.validate()
        self.model, self.optimizer, self.step_fn, self.reducer = model, optimizer, step_fn, reducer
        self.policies = self._resolve_policies(policy, policies, checkpoint_dir)
        self._check_policy_needs(checkpoint_dir)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.global_step = self._start_step = start_step
        self.rank = _rank()
        self.events: list[AnomalyEvent] = []
        self.checkpoints: list[Path] = []
        self._tally = Tally()
        self._log = EventLog(log, self.rank)
        self._setup_params()
        self._setup_device_state()
        self._rows: list[_Row] = []
        self._pending: DevicePending | HostPending | None = None
        self._history: dict[int, _History] = {}
        self._rng_next = _torch_rng() if self._replaying else None
        self._steps_since_checkpoint = 0
        self._log.write({"event": "start", "step": start_step, "config": self.config,
                         "policies": self.policies, "parameters": list(self._names),
                         "coverage": self._rest.coverage()})
        if self.checkpoint_dir is not None:
            self.save_checkpoint()

    # ------------------------------------------------------------ setup

    @staticmethod
    def _resolve_policies(policy: str | None, policies: Mapping[str, str] | None,
                          checkpoint_dir: str | Path | None) -> dict[str, str]:
        resolved = dict(DEFAULT_POLICIES)
        if checkpoint_dir is not None:
            resolved["weights_changed"] = "rollback"
        if policy is not None:
            resolved = dict.fromkeys(KINDS, policy)
        resolved.update(policies or {})
        for kind, pol in resolved.items():
            if kind not in KIND_INDEX:
                raise UsageError(f"unknown anomaly kind '{kind}'",
                                 hint=f"kinds: {', '.join(KINDS)}")
            if pol not in POLICIES:
                raise UsageError(f"unknown policy '{pol}' for {kind}",
                                 hint=f"policies: {', '.join(POLICIES)}")
        return resolved

    def _check_policy_needs(self, checkpoint_dir: str | Path | None) -> None:
        used = set(self.policies.values())
        if "rollback" in used and checkpoint_dir is None:
            raise UsageError(
                "policy 'rollback' needs checkpoint_dir= (where verified checkpoints go)")
        if ("replay" in used or self.config.replay_every) and self.step_fn is None:
            raise UsageError(
                "replay needs step_fn=: a function that runs forward on a batch, returns the loss",
                hint="then call guard.train_step(batch), or guard.check(loss, batch=batch)",
            )

    def _setup_params(self) -> None:
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if not named:
            raise UsageError("TrainingGuard: the model has no trainable parameters")
        self._names = tuple(n for n, _ in named)
        self._params: list[torch.Tensor] = [p for _, p in named]
        self._device = self._params[0].device
        self._param_names = {id(p): n for n, p in named}
        self._norm_cut = balanced_cut([p.numel() * p.element_size() for p in self._params])

    def _setup_device_state(self) -> None:
        cfg, dev, n = self.config, self._device, len(self._params)
        self._replaying = "replay" in self.policies.values() or cfg.replay_every is not None
        skipping = [self.policies[k] in SKIPPING for k in KINDS]
        # Fused optimizers skip an update themselves when handed a device-side
        # ``found_inf`` (AMP's mechanism): exact, and no copy of anything. The
        # decision must then be known before the step, so not with update ratios.
        self._fused_skip = cfg.fused_skip and any(skipping) and not cfg.update_ratio and bool(
            getattr(self.optimizer, "_step_supports_amp_scaling", False))
        self._needs_backup = (any(skipping) or cfg.update_ratio) and not self._fused_skip
        # On the CPU reading the decision is a load from memory, not a device sync, so
        # step() can simply not run a skipped update. Update ratios still need the copy:
        # their flag is only known after the update.
        on_cpu = all(p.device.type == "cpu" for p in self._params)
        host = on_cpu if cfg.host_skip is None else cfg.host_skip
        self._host_skip = host and any(skipping) and not cfg.update_ratio
        # A second thread on the CPU; an accelerator already runs the work asynchronously.
        self._helper = _Helper() if (cfg.overlap or cfg.defer_record) and on_cpu else None
        self._split = cfg.overlap and on_cpu  # halves of each pass on the helper
        self._defer = cfg.defer_record and on_cpu
        # On the CPU the rules run on floats: no sync to avoid, and a hundred tiny torch
        # ops per step cost more than the Python arithmetic they stand for.
        use_host = on_cpu if cfg.stats == "auto" else cfg.stats == "host"
        self._host = HostDetectors(cfg, n, self.policies) if use_host else None
        self._rules = None if use_host else DeviceDetectors(cfg, n, self.policies, dev)
        self._zero = torch.zeros((), dtype=torch.float32, device=dev)  # a missing gradient
        self._step_norms: torch.Tensor | None = None  # check()'s per-parameter norms
        self._snapshot = Snapshot()
        self._found_inf: torch.Tensor | None = None
        self._rest = AtRest(cfg, self.optimizer, self._params, self._names,
                            reducer=self.reducer, policies=self.policies, pool=self._pool,
                            split=self._split,
                            defer=self._helper.submit if self._defer and self._helper else None)
        self._applied: torch.Tensor | bool = True  # the last update's decision

    # ------------------------------------------------------------ per-step API

    def check(self, loss: torch.Tensor, *, batch: Any = None) -> None:
        """Compute this step's flags on the device (after backward, before the update)."""
        if self._pending is not None:
            raise UsageError("TrainingGuard.check() called twice in one step",
                             hint="call guard.step() after each check()")
        self._pending = self._detect_step(_scalar(loss), None)
        if self._replaying and batch is not None:
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
        total = torch.linalg.vector_norm(norms)
        # torch's coefficient, clamped to 1; read only where reading is a memory load.
        if self._host is not None and float(torch.clamp(max_norm / (total + 1e-6), max=1.0)) == 1:
            return total
        torch.nn.utils.clip_grads_with_norm_(self._params, max_norm, total)
        return total

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run ``optimizer.step()`` under the guard; a flagged update is skipped, on the host
        (not run at all) when the parameters are on the CPU, else on the device."""
        if not self._host_skip:
            self._prepare(host=False)
            result = self._update(closure)
            self.after_update()
            return result
        if self._prepare(host=True):
            result = self._update(closure)
        else:
            self._found(self._rest.skipped())
            result = None
            if closure is not None:  # the optimizer would have evaluated it once at least
                with torch.enable_grad():
                    result = closure()
        self.after_update()
        return result

    def _update(self, closure: Callable[[], Any] | None) -> Any:
        """The optimizer's update; fused, it verifies the window that has just ended."""
        if self._rest.fused is None:
            return self.optimizer.step() if closure is None else self.optimizer.step(closure)
        result = None
        if closure is not None:  # what the optimizer's own step would do first
            with torch.enable_grad():
                result = closure()
        self._found(self._rest.update())
        return result

    def _found(self, sums: Pair | None) -> None:
        """The at-rest verification of this step's window, into the pending flags (and, when
        the update was already decided, into its decision: the latch holds what follows)."""
        pending = self._pending
        if sums is None or pending is None:
            return
        self._fill_rest(pending, sums)
        latch = self.policies["weights_changed"] in LATCHING
        wc = KIND_INDEX["weights_changed"]
        if isinstance(pending, HostPending):
            if pending.decision is not None and pending.flags[wc] > 0:
                flags = list(pending.decision[0])
                flags[wc] = 1.0
                pending.decision = (flags, True, pending.decision[2])
                if latch and self._host is not None:
                    self._host.latched = True
        elif pending.decision is not None:
            old, _, applied = pending.decision
            new = old.clone()
            new[wc] = torch.maximum(old[wc], pending.rest_vec.any().float())
            hit = new > 0
            if latch:
                self._device_rules().latched.logical_or_(hit[wc])
            pending.decision = (new, hit, applied)

    def _fill_rest(self, pending: DevicePending | HostPending, sums: Pair) -> None:
        now, record, names = sums
        wc = KIND_INDEX["weights_changed"]
        if isinstance(pending, HostPending):
            pending.rest = [float(a != b) for a, b in zip(now.tolist(), record.tolist(),
                                                          strict=True)]
            pending.rest_names = names
            pending.flags[wc] = float(any(pending.rest))
        else:
            pending.rest_vec, pending.rest_names = (now != record).any(dim=1), names
            pending.parts[wc] = pending.rest_vec.any()

    def train_step(self, batch: Any) -> torch.Tensor:
        """One whole guarded step with ``step_fn``: zero_grad, forward, backward, check, step."""
        if self.step_fn is None:
            raise UsageError("train_step() needs step_fn= given to TrainingGuard")
        self._join()
        self._rng_next = _torch_rng()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.step_fn(batch)
        loss.backward()
        loss_d = _scalar(loss)
        every = self.config.replay_every
        replay_vec = None
        if every is not None and self.global_step % every == 0:
            replay_vec = self._audit(batch, loss_d)
        self._pending = self._detect_step(loss_d, replay_vec)
        if self._replaying:
            self._remember(batch, self._pending)
        self.step()
        return loss.detach()

    def before_update(self) -> None:
        """Verify the at-rest checksums; copy parameters and optimizer state so a flagged
        update can be undone on the device (or hand the decision to a fused optimizer).
        For callers that run ``optimizer.step()`` themselves (trainer integrations): the
        at-rest check cannot ride on an update it does not run, so it takes two passes."""
        if self._rest.fused is not None:
            self._found_early(self._rest.to_two_passes(
                "the caller runs optimizer.step() itself (before_update/after_update)"))
            self._log.write({"event": "coverage", "step": self.global_step,
                             "coverage": self._rest.coverage()})
        self._prepare(host=False)

    def _found_early(self, sums: Pair | None) -> None:
        if sums is not None and self._pending is not None:
            self._fill_rest(self._pending, sums)

    @torch.no_grad()
    def _prepare(self, host: bool) -> bool:
        """Before the update: at-rest verification, then the undo copy, the fused optimizer's
        ``found_inf``, or (``host``) the decision read on the host. Returns whether the
        update should run; only the host path ever returns False."""
        pending = self._pending
        if pending is None:
            raise UsageError("TrainingGuard.step() called before check(loss)",
                             hint="call guard.check(loss) after loss.backward()")
        self._join()
        undo = self._needs_backup and not host
        if undo:
            # An undo must restore the optimizer state too.
            self._snapshot.take(self._rest.covered_tensors(with_state=True))
            pending.undo = True
        sums = self._rest.before(self._snapshot, use_copy=undo)
        if sums is not None:
            self._fill_rest(pending, sums)
        if isinstance(pending, HostPending):
            return self._prepare_host(pending, host)
        if host:
            pending.decision = self._decide(pending)
            return bool(pending.decision[2])
        if self._fused_skip:
            pending.decision = self._decide(pending)
            self._hand_found_inf((~pending.decision[2]).float())
        return True

    def _prepare_host(self, pending: HostPending, host: bool) -> bool:
        """:meth:`_prepare` after the at-rest sums, with the rules on floats."""
        assert self._host is not None
        if not (host or self._fused_skip):
            return True  # decided after the update (update ratios), undone from the copy
        pending.decision = self._host.decide(pending.flags, self.reducer)
        applied = pending.decision[2]
        if not host:
            self._hand_found_inf(torch.full((), 0.0 if applied else 1.0, device=self._device))
        return applied

    def _hand_found_inf(self, found_inf: torch.Tensor) -> None:
        # The attribute torch's fused optimizers read (GradScaler sets it too).
        self._found_inf = found_inf
        self.optimizer.found_inf = found_inf  # type: ignore[attr-defined]

    def _take_back_found_inf(self) -> None:
        found_inf, self._found_inf = self._found_inf, None
        if found_inf is not None and getattr(self.optimizer, "found_inf", None) is found_inf:
            del self.optimizer.found_inf  # type: ignore[attr-defined]

    def after_update(self) -> None:
        """Decide on the device whether the update stands, record checksums, maybe read flags."""
        pending, self._pending = self._pending, None
        self._step_norms = None
        assert pending is not None
        if isinstance(pending, HostPending):
            host_row, book = self._conclude_host(pending), None
        else:
            host_row, book = None, self._conclude_device(pending)
        step, self.global_step = self.global_step, self.global_step + 1
        self._steps_since_checkpoint += 1
        if self._replaying:
            self._rng_next = _torch_rng()
        # With the rules on floats a change at rest is known on the host at once: a policy
        # that acts on it (stop, rollback, ...) does so before the next forward pass.
        due = (step + 1 - self._start_step) % self.config.check_every == 0 or (
            host_row is not None and host_row[KIND_INDEX["weights_changed"]] > 0
            and self.policies["weights_changed"] in SKIPPING)
        # The record is complete before step() returns: a bit that changes afterwards,
        # however soon, is a change against it (with a helper, half of it ran there).
        self._rest.after(self._applied, pending.undo)
        if host_row is not None:
            self._rows.append(_Row(step, host_row, pending.rest_names))
        elif book is not None:
            if self._helper is None or not self._split or due:  # a flush reads the row now
                book(step)
            else:  # touches no guarded tensor: runs beside the next forward pass
                self._helper.submit(functools.partial(book, step))
        if due:
            self._read_flags()

    def _conclude_device(self, pending: DevicePending) -> Callable[[int], None]:
        """After the update, on the device: decide if not yet decided, undo; the bookkeeping
        (statistics and the step's row) is returned, to run now or beside the next step."""
        rules = self._device_rules()
        if rules.ratio_stats is None:
            ratio, ratio_vec = rules.zeros_n, rules.false_n
        else:
            ratio = self._ratios()
            ratio_vec = rules.ratio_flags(ratio)
        if pending.decision is None:
            pending.parts[KIND_INDEX["update_ratio_spike"]] = ratio_vec.any()
            flags, hit, applied = self._decide(pending)
        else:
            flags, hit, applied = pending.decision
            self._take_back_found_inf()
        if pending.undo:
            self._select(applied)
        self._applied = applied
        accept = applied & ~hit.any()
        return functools.partial(self._bookkeep, pending=pending, flags=flags, applied=applied,
                                 accept=accept, ratio=ratio, ratio_vec=ratio_vec)

    def _conclude_host(self, pending: HostPending) -> list[float]:
        """After the update, on floats: decide if not yet decided, undo, push; the row."""
        host, n = self._host, len(self._params)
        assert host is not None
        ratio, ratio_hit = [0.0] * n, [0.0] * n
        if host.ratio_stats is not None:
            ratio = self._ratios().tolist()
            ratio_hit = host.ratio_flags(ratio)
        if pending.decision is None:
            pending.flags[KIND_INDEX["update_ratio_spike"]] = float(any(ratio_hit))
            pending.decision = host.decide(pending.flags, self.reducer)
        else:
            self._take_back_found_inf()
        flags, hit, applied = pending.decision
        if pending.undo:
            self._select(applied)
        self._applied = applied
        return host.conclude(pending, applied, hit, flags, ratio, ratio_hit)

    def _bookkeep(self, step: int, pending: DevicePending, flags: torch.Tensor,
                  applied: torch.Tensor, accept: torch.Tensor, ratio: torch.Tensor,
                  ratio_vec: torch.Tensor) -> None:
        """After the update: rolling statistics, and the step's row for the next flush."""
        row = self._device_rules().conclude(pending, flags, applied, accept, ratio, ratio_vec)
        self._rows.append(_Row(step, row, pending.rest_names))

    def _join(self) -> None:
        """Wait for the helper thread's work: call before reading or changing guard state."""
        if self._helper is not None:
            self._helper.join()

    def wait(self) -> None:
        """Wait until the work the guard runs beside training (CPU parameters) is done."""
        self._join()

    def _device_rules(self) -> DeviceDetectors:
        assert self._rules is not None, "the rules run on floats on this guard"
        return self._rules

    def _decide(self, pending: DevicePending) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Combine the flags (across ranks with the reducer) and decide: ``applied`` or not."""
        return self._device_rules().decide(pending, self.reducer)

    # ------------------------------------------------------------ detectors

    def _detect_step(self, loss: torch.Tensor, replay_vec: torch.Tensor | None
                     ) -> DevicePending | HostPending:
        """This step's flags: on floats (one read of the norms and the loss) or the device."""
        self._join()  # the previous step's statistics and flag row
        if self._host is None:
            gvec = self._step_norms = self._grad_norms()
            return self._device_rules().detect(loss, gvec, replay_vec)
        stacked = torch.stack([*self._norm_list(), loss])
        self._step_norms = stacked[:-1]
        values = stacked.tolist()
        replay = replay_vec.tolist() if replay_vec is not None else None
        return self._host.detect(values[-1], values[:-1], replay)

    def _grad_norms(self) -> torch.Tensor:
        return torch.stack(self._norm_list())

    def _norm_list(self) -> list[torch.Tensor]:
        """Per-parameter gradient norms (float32, 0-dim; zero for a missing gradient)."""
        grads = [p.grad for p in self._params]
        present = [g for g in grads if g is not None]
        if len(present) == len(grads):
            cut = self._norm_cut
            if self._helper is None or not self._split or cut == len(grads):
                return list(torch._foreach_norm(present, 2, dtype=torch.float32))
            # Per tensor the same norms whichever list computes them; half on the helper.
            first, second = run_beside(
                self._helper.pool,
                lambda: torch._foreach_norm(present[:cut], 2, dtype=torch.float32),
                lambda: torch._foreach_norm(present[cut:], 2, dtype=torch.float32))
            return [*first, *second]
        norms = iter(torch._foreach_norm(present, 2, dtype=torch.float32) if present else [])
        return [next(norms) if g is not None else self._zero for g in grads]

    def _pool(self) -> ThreadPoolExecutor | None:
        """The helper's pool for the half of a verification that runs beside this thread."""
        return self._helper.pool if self._helper is not None and self._split else None

    def refresh(self) -> None:
        """Re-record the at-rest checksums after changing parameters outside ``step()``."""
        self._join()
        self._rest.refresh()

    @torch.no_grad()
    def _ratios(self) -> torch.Tensor:
        """``|Δp| / |p|`` per parameter, against the copy taken before the update."""
        before = self._snapshot.copies[: len(self._params)]
        delta = torch._foreach_sub(self._params, before)
        dn = torch.stack(torch._foreach_norm(delta, 2, dtype=torch.float32))
        pn = torch.stack(torch._foreach_norm(before, 2, dtype=torch.float32))
        return dn / (pn + 1e-12)

    @torch.no_grad()
    def _select(self, applied: torch.Tensor | bool) -> None:
        """Keep the update where ``applied`` (a device flag, or known on the host), else
        restore the copy."""
        self._snapshot.keep_if(applied)
        current = self._rest.covered_tensors(with_state=True)
        if self._snapshot.same(current) or applied is True:
            return
        # State the optimizer created during this step had no copy: reset it to
        # zero on a skip, the initial value of every built-in optimizer's buffers.
        known = {id(t) for t in self._snapshot.live}
        for value in current:
            if id(value) not in known:
                if isinstance(applied, torch.Tensor):
                    torch.where(applied, value, torch.zeros((), dtype=value.dtype,
                                                            device=value.device), out=value)
                else:
                    value.zero_()

    # ------------------------------------------------------------ replay

    def _remember(self, batch: Any, pending: DevicePending | HostPending) -> None:
        assert self._rng_next is not None
        grads = [p.grad if p.grad is not None else self._zero for p in self._params]
        if isinstance(pending, HostPending):  # the float32 values, exactly
            loss, gvec = (torch.tensor(v, dtype=torch.float32) for v in (pending.loss,
                                                                        pending.gvec))
        else:
            loss, gvec = pending.loss, pending.gvec
        self._history[self.global_step] = _History(batch, self._rng_next, checksums(grads),
                                                   loss, gvec)

    def _rerun(self, batch: Any, rng: tuple[torch.Tensor, tuple[torch.Tensor, ...]]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``step_fn`` again from ``rng``; returns (loss, grad checksums); grads are left."""
        assert self.step_fn is not None
        saved = _torch_rng()
        _set_torch_rng(rng)
        try:
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.step_fn(batch)
            loss.backward()
        finally:
            _set_torch_rng(saved)
        grads = [p.grad if p.grad is not None else self._zero for p in self._params]
        return loss.detach().float().mean(), checksums(grads)

    def _tolerance(self) -> float:
        if self.config.replay_tolerance is not None:
            return self.config.replay_tolerance
        return 0.0 if torch.are_deterministic_algorithms_enabled() else 1e-6

    def _audit(self, batch: Any, loss: torch.Tensor) -> torch.Tensor:
        """Device flag per parameter: the replay's gradient differs from the original."""
        assert self._rng_next is not None
        grads = [p.grad if p.grad is not None else self._zero for p in self._params]
        first_sums, first_norms = checksums(grads), self._grad_norms()
        loss2, sums2 = self._rerun(batch, self._rng_next)
        tol = self._tolerance()
        if tol == 0:
            per_param = (first_sums != sums2).any(dim=1)
            loss_diff = loss.view(1).view(torch.int32) != loss2.view(1).view(torch.int32)
        else:
            norms2 = self._grad_norms()
            per_param = ~torch.isclose(first_norms, norms2, rtol=tol, atol=0.0, equal_nan=True)
            loss_diff = ~torch.isclose(loss, loss2, rtol=tol, atol=0.0, equal_nan=True).view(1)
        return (per_param | loss_diff).float()

    def _replay(self, step: int) -> tuple[str, tuple[str, ...]]:
        """Re-run a flagged step (parameters are still as they were then) and classify it."""
        hist = self._history.get(step)
        if hist is None:
            return "unavailable", ()
        loss2, sums2 = self._rerun(hist.batch, hist.rng)
        norms2 = self._grad_norms()
        self.optimizer.zero_grad(set_to_none=True)
        tol = self._tolerance()
        if tol == 0:
            a, b = hist.grad_sums.cpu().tolist(), sums2.cpu().tolist()
            same = [x == y for x, y in zip(a, b, strict=True)]
        else:
            close = torch.isclose(hist.grad_norms, norms2, rtol=tol, atol=0.0, equal_nan=True)
            same = close.cpu().tolist()
        differing = tuple(n for n, ok in zip(self._names, same, strict=True) if not ok)
        l1, l2 = float(hist.loss), float(loss2)
        same_loss = l1 == l2 or (math.isnan(l1) and math.isnan(l2)) or (
            abs(l1 - l2) <= tol * abs(l1))
        return ("reproducible" if same_loss and not differing else "transient"), differing

    # ------------------------------------------------------------ host side

    def flush(self) -> list[AnomalyEvent]:
        """Read the flags of the steps since the last read (one device-to-host transfer)."""
        self._join()
        return self._read_flags()

    def _read_flags(self) -> list[AnomalyEvent]:
        rows, self._rows = self._rows, []
        if not rows:
            return []
        events: list[AnomalyEvent] = []
        for r, values in zip(rows, _row_values(rows), strict=True):
            events.extend(self._read_row(r, values))
        self._act(events)
        self._history.clear()
        self._log.flush()
        return events

    def _read_row(self, r: _Row, values: list[float]) -> list[AnomalyEvent]:
        k, n = len(KINDS), len(self._params)
        flags = values[:k]
        loss, gnorm, loss_thr, gnorm_thr, applied = values[k: k + _N_SCALARS]
        vec = values[k + _N_SCALARS:]
        gvec, layer, ratio, ratio_hit, replay = (vec[i * n: (i + 1) * n] for i in range(5))
        rest = vec[5 * n:]
        self._log.write({"event": "metrics", "step": r.step, "loss": loss, "grad_norm": gnorm,
                         "applied": bool(applied)})
        if not applied:
            self._tally.skipped += 1
        ctx = _RowContext(self._names, loss, gnorm, loss_thr, gnorm_thr, gvec, layer, ratio,
                          ratio_hit, replay, r.rest_names, rest)
        events = []
        for kind, flag in zip(KINDS, flags, strict=True):
            if flag > 0:
                policy = self.policies[kind]
                values_, thresholds, suspects = ctx.describe(kind)
                events.append(AnomalyEvent(r.step, kind, policy, ACTIONS[policy], values_,
                                           thresholds, suspects, self.rank))
        return events

    def _act(self, events: list[AnomalyEvent]) -> None:
        events = self._resolve_actions(events)
        for event in events:
            self._tally.anomalies[event.kind] += 1
            self.events.append(event)
            self._log.write(event.to_dict())
            if event.policy == "warn":
                warnings.warn(f"torchverity: training anomaly at {event.describe()}",
                              AnomalyWarning, stacklevel=3)
        stops = [e for e in events if e.policy == "stop"]
        rollbacks = [e for e in events if e.action == ACTIONS["rollback"]]
        if rollbacks and not stops:
            self.rollback(rollbacks[0].step)
        if self._host is not None:
            self._host.latched = False
        else:
            self._device_rules().latched.zero_()
        if stops:
            self._stop(stops[0])
        elif not events:
            self._maybe_checkpoint()

    def _resolve_actions(self, events: list[AnomalyEvent]) -> list[AnomalyEvent]:
        """Replay and rollback act once, for the first step that asked; later steps of the
        same read were held by the latch, so for them the action taken was a skip."""
        first: dict[str, int] = {}
        for e in events:
            if e.policy in ("replay", "rollback"):
                first.setdefault(e.policy, e.step)
        verdict = self._do_replay(first["replay"]) if "replay" in first else None
        resolved = []
        for e in events:
            if e.policy in first and e.step != first[e.policy]:
                e = dataclasses.replace(e, action=ACTIONS["skip"])
            elif e.policy == "replay":
                e = dataclasses.replace(e, replay=verdict)
            resolved.append(e)
        return resolved

    def _do_replay(self, step: int) -> str:
        verdict, differing = self._replay(step)
        self._tally.replays[verdict] += 1
        self._log.write({"event": "replay", "step": step, "classification": verdict,
                         "differing": list(differing)})
        return verdict

    def _stop(self, event: AnomalyEvent) -> None:
        self._tally.stopped = True
        self._log.flush()
        where = f"; replay says {event.replay}" if event.replay else ""
        hint = (f"see every event with: torchverity report {self._log.path}"
                if self._log.path else "pass log='events.jsonl' to TrainingGuard to keep events")
        raise TrainingAnomalyError(
            f"training anomaly at {event.describe()}{where}",
            step=event.step, kind=event.kind, values=event.values, thresholds=event.thresholds,
            suspects=event.suspects, rank=event.rank, hint=hint,
        )

    # ------------------------------------------------------------ checkpoints

    def _guard_state(self) -> dict[str, Any]:
        # One layout for both paths: a checkpoint loads into either.
        rules = self._host if self._host is not None else self._device_rules()
        prev_loss = (torch.tensor(self._host.prev_loss, dtype=torch.float32)
                     if self._host is not None else self._device_rules().prev_loss.clone())
        state: dict[str, Any] = {"step": self.global_step, "stats": rules.stats.state_dict(),
                                 "prev_loss": prev_loss}
        if rules.ratio_stats is not None:
            state["ratio_stats"] = rules.ratio_stats.state_dict()
        return state

    def save_checkpoint(self) -> Path:
        """Save model, optimizer, guard statistics and RNG states with ``torchverity.save``."""
        from torchverity.checkpoint._save import save
        from torchverity.determinism import capture_rng

        self._join()
        if self.checkpoint_dir is None:
            raise UsageError("save_checkpoint() needs checkpoint_dir= given to TrainingGuard")
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        path = self.checkpoint_dir / f"guard-step{self.global_step:08d}.pt"
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "guard": self._guard_state(), "rng": capture_rng().to_state()}
        report = save(state, path, meta={"torchverity_guard_step": self.global_step})
        self.checkpoints.append(path)
        self._tally.checkpoints += 1
        self._steps_since_checkpoint = 0
        self._log.write({"event": "checkpoint", "step": self.global_step, "path": str(path),
                         "digest": report.digest, "fingerprint": report.fingerprint})
        self._prune_checkpoints()
        return path

    def _prune_checkpoints(self) -> None:
        while len(self.checkpoints) > self.config.keep_checkpoints:
            old = self.checkpoints.pop(0)
            for p in old.parent.glob(old.name + "*"):
                p.unlink(missing_ok=True)

    def _maybe_checkpoint(self) -> None:
        every = self.config.checkpoint_every
        if self.checkpoint_dir is None or every is None or self._steps_since_checkpoint < every:
            return
        self._join()
        if self._rest.changed():  # corrupted since the last update: never checkpoint it
            return
        self.save_checkpoint()

    def rollback(self, step: int | None = None) -> Path:
        """Reload the newest checkpoint (verified by ``torchverity.load``) and continue."""
        from torchverity.checkpoint._load import load
        from torchverity.determinism import RngState, restore_rng

        self._join()
        if not self.checkpoints:
            raise UsageError("no checkpoint to roll back to", hint="give checkpoint_dir=")
        path = self.checkpoints[-1]
        state = load(path, sidecar="require")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        rules = self._host if self._host is not None else self._device_rules()
        rules.stats.load_state_dict(state["guard"]["stats"])
        if rules.ratio_stats is not None:
            rules.ratio_stats.load_state_dict(state["guard"]["ratio_stats"])
        if self._host is not None:
            self._host.reset_rules(float(state["guard"]["prev_loss"]))
        else:
            self._device_rules().reset_rules(state["guard"]["prev_loss"])
        restore_rng(RngState.from_state(state["rng"]))
        self._snapshot = Snapshot()
        self.refresh()
        self._tally.rollbacks += 1
        self._log.write({"event": "rollback", "step": self.global_step, "anomaly_step": step,
                         "checkpoint": str(path), "restored_step": state["guard"]["step"]})
        return path

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


@dataclass(frozen=True)
class _RowContext:
    """Host copy of one step's row, turned into event values and suspects per kind."""

    names: tuple[str, ...]
    loss: float
    gnorm: float
    loss_thr: float
    gnorm_thr: float
    gvec: list[float]
    layer: list[float]
    ratio: list[float]
    ratio_hit: list[float]
    replay: list[float]
    rest_names: tuple[str, ...]
    rest: list[float]

    def _named(self, flags: list[float]) -> tuple[str, ...]:
        return tuple(n for n, f in zip(self.names, flags, strict=True) if f > 0)

    def _top(self, k: int = 3) -> tuple[str, ...]:
        # NaN norms sort last: the finite largest contributors are the suspects.
        pairs = zip(self.gvec, self.names, strict=True)
        ranked = sorted(pairs, key=lambda x: -x[0] if x[0] == x[0] else 0)
        return tuple(n for _, n in ranked[:k])

    def describe(self, kind: str) -> tuple[dict[str, float], dict[str, float], tuple[str, ...]]:
        base = {"loss": self.loss, "grad_norm": self.gnorm}
        if kind == "nonfinite_loss":
            return base, {}, self._named([0.0 if math.isfinite(g) else 1.0 for g in self.gvec])
        if kind == "nonfinite_grad":
            return base, {}, self._named([0.0 if math.isfinite(g) else 1.0 for g in self.gvec])
        if kind == "loss_spike":
            return base, {"loss": self.loss_thr}, self._top()
        if kind == "grad_norm_spike":
            return base, {"grad_norm": self.gnorm_thr}, self._top()
        if kind == "loss_jump":
            return base, {}, ()
        if kind == "layer_grad_spike":
            hit = self._named(self.layer)
            return {f"grad_norm[{n}]": self.gvec[self.names.index(n)] for n in hit}, {}, hit
        if kind == "update_ratio_spike":
            hit = self._named(self.ratio_hit)
            return {f"update_ratio[{n}]": self.ratio[self.names.index(n)] for n in hit}, {}, hit
        if kind == "weights_changed":
            hit = tuple(n for n, f in zip(self.rest_names, self.rest, strict=True) if f > 0)
            return base, {}, hit
        return base, {}, self._named(self.replay)
