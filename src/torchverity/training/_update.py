"""What happens around one update: the at-rest result into the step's flags, the decision,
the undo from a copy or a fused optimizer's ``found_inf``, and the step's row.

:class:`Update` works for one :class:`~torchverity.training._guard.TrainingGuard` (it
reads the guard's rule engine, policies and covered tensors) and holds the undo copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchverity.training._at_rest import Pair
from torchverity.training._device_rules import DevicePending
from torchverity.training._events import KIND_INDEX, LATCHING
from torchverity.training._host_rules import HostPending
from torchverity.training._snapshot import Snapshot

if TYPE_CHECKING:
    from torchverity.training._guard import TrainingGuard

_WC = KIND_INDEX["weights_changed"]
_RATIO = KIND_INDEX["update_ratio_spike"]
Pending = DevicePending | HostPending


class Update:
    """The undo copy and the decision steps of the guard's updates."""

    def __init__(self, guard: TrainingGuard) -> None:
        self.guard = guard
        self.snapshot = Snapshot()
        self.applied: torch.Tensor | bool = True  # the last update's decision
        self._found_inf: torch.Tensor | None = None

    # ------------------------------------------------------------ at-rest results

    def fill_rest(self, pending: Pending, sums: Pair) -> None:
        """The verification of this step's window into its pending flags."""
        now, record, names = sums
        if isinstance(pending, HostPending):
            pending.rest = [0.0] * now.shape[0] if torch.equal(now, record) else [
                float(a != b) for a, b in zip(now.tolist(), record.tolist(), strict=True)]
            pending.rest_names = names
            pending.flags[_WC] = float(any(pending.rest))
        else:
            pending.rest_vec, pending.rest_names = (now != record).any(dim=1), names
            pending.parts[_WC] = pending.rest_vec.any()

    def found(self, pending: Pending | None, sums: Pair | None) -> None:
        """As :meth:`fill_rest`, also when the update was already decided (the fused check
        comes with the update): the flag joins the decision, and the latch holds what
        follows."""
        if sums is None or pending is None:
            return
        self.fill_rest(pending, sums)
        g = self.guard
        latch = g.policies["weights_changed"] in LATCHING
        if isinstance(pending, HostPending):
            if pending.decision is not None and pending.flags[_WC] > 0:
                flags = list(pending.decision[0])
                flags[_WC] = 1.0
                pending.decision = (flags, True, pending.decision[2])
                if latch and g._host is not None:
                    g._host.latched = True
        elif pending.decision is not None:
            old, _, applied = pending.decision
            new = old.clone()
            new[_WC] = torch.maximum(old[_WC], pending.rest_vec.any().float())
            hit = new > 0
            if latch:
                g._device_rules().latched.logical_or_(hit[_WC])
            pending.decision = (new, hit, applied)

    # ------------------------------------------------------------ before the update

    @torch.no_grad()
    def prepare(self, pending: Pending, host: bool) -> bool:
        """Before the update: at-rest verification, then the undo copy, the fused optimizer's
        ``found_inf``, or (``host``) the decision read on the host. Returns whether the
        update should run; only the host path ever returns False."""
        g = self.guard
        undo = g._modes.needs_backup and not host
        if undo:
            # An undo must restore the optimizer state too.
            self.snapshot.take(g._rest.covered_tensors(with_state=True))
            pending.undo = True
        sums = g._rest.before(self.snapshot, use_copy=undo)
        if sums is not None:
            self.fill_rest(pending, sums)
        if isinstance(pending, HostPending):
            return self._prepare_host(pending, host)
        if host:
            pending.decision = g._device_rules().decide(pending, g.reducer)
            return bool(pending.decision[2])
        if g._modes.fused_skip:
            pending.decision = g._device_rules().decide(pending, g.reducer)
            self.hand_found_inf((~pending.decision[2]).float())
        return True

    def _prepare_host(self, pending: HostPending, host: bool) -> bool:
        """:meth:`prepare` after the at-rest sums, with the rules on floats."""
        g = self.guard
        assert g._host is not None
        if not (host or g._modes.fused_skip):
            return True  # decided after the update (update ratios), undone from the copy
        pending.decision = g._host.decide(pending.flags, g.reducer)
        applied = pending.decision[2]
        if not host:
            self.hand_found_inf(torch.full((), 0.0 if applied else 1.0, device=g._device))
        return applied

    # ------------------------------------------------------------ fused optimizers

    def hand_found_inf(self, found_inf: torch.Tensor) -> None:
        # The attribute torch's fused optimizers read (GradScaler sets it too).
        self._found_inf = found_inf
        self.guard.optimizer.found_inf = found_inf  # type: ignore[attr-defined]

    def take_back_found_inf(self) -> None:
        found_inf, self._found_inf = self._found_inf, None
        opt = self.guard.optimizer
        if found_inf is not None and getattr(opt, "found_inf", None) is found_inf:
            del opt.found_inf  # type: ignore[attr-defined]

    # ------------------------------------------------------------ after the update

    def conclude_device(self, pending: DevicePending) -> dict[str, torch.Tensor]:
        """After the update, on the device: decide if not yet decided, undo; what the
        bookkeeping (statistics and the step's row) needs, to run now or later."""
        g = self.guard
        rules = g._device_rules()
        if rules.ratio_stats is None:
            ratio, ratio_vec = rules.zeros_n, rules.false_n
        else:
            ratio = self.ratios()
            ratio_vec = rules.ratio_flags(ratio)
        if pending.decision is None:
            pending.parts[_RATIO] = ratio_vec.any()
            flags, hit, applied = rules.decide(pending, g.reducer)
        else:
            flags, hit, applied = pending.decision
            self.take_back_found_inf()
        if pending.undo:
            self.select(applied)
        self.applied = applied
        return {"flags": flags, "applied": applied, "accept": applied & ~hit.any(),
                "ratio": ratio, "ratio_vec": ratio_vec}

    def conclude_host(self, pending: HostPending) -> list[float]:
        """After the update, on floats: decide if not yet decided, undo, push; the row."""
        g = self.guard
        host, n = g._host, len(g._params)
        assert host is not None
        ratio, ratio_hit = [0.0] * n, [0.0] * n
        if host.ratio_stats is not None:
            ratio = self.ratios().tolist()
            ratio_hit = host.ratio_flags(ratio)
        if pending.decision is None:
            pending.flags[_RATIO] = float(any(ratio_hit))
            pending.decision = host.decide(pending.flags, g.reducer)
        else:
            self.take_back_found_inf()
        flags, hit, applied = pending.decision
        if pending.undo:
            self.select(applied)
        self.applied = applied
        return host.conclude(pending, applied, hit, flags, ratio, ratio_hit)

    @torch.no_grad()
    def ratios(self) -> torch.Tensor:
        """``|Δp| / |p|`` per parameter, against the copy taken before the update."""
        params = self.guard._rest.covered_tensors(with_state=False)  # local shards
        before = self.snapshot.copies[: len(params)]
        delta = torch._foreach_sub(params, before)
        dn = torch.stack(torch._foreach_norm(delta, 2, dtype=torch.float32))
        pn = torch.stack(torch._foreach_norm(before, 2, dtype=torch.float32))
        return dn / (pn + 1e-12)

    @torch.no_grad()
    def select(self, applied: torch.Tensor | bool) -> None:
        """Keep the update where ``applied`` (a device flag, or known on the host), else
        restore the copy."""
        self.snapshot.keep_if(applied)
        current = self.guard._rest.covered_tensors(with_state=True)
        if self.snapshot.same(current) or applied is True:
            return
        # State the optimizer created during this step had no copy: reset it to
        # zero on a skip, the initial value of every built-in optimizer's buffers.
        known = {id(t) for t in self.snapshot.live}
        for value in current:
            if id(value) not in known:
                if isinstance(applied, torch.Tensor):
                    torch.where(applied, value, torch.zeros((), dtype=value.dtype,
                                                            device=value.device), out=value)
                else:
                    value.zero_()
