"""How the guard runs each step, derived once from its settings, policies and devices."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from torchverity.training._config import GuardConfig
from torchverity.training._events import KINDS, SKIPPING


@dataclass(frozen=True)
class StepModes:
    """How each step is applied and undone, for these settings and devices."""

    fused_skip: bool  # the fused optimizer skips a flagged update itself (found_inf)
    needs_backup: bool  # copy the state before the update, to undo it
    host_skip: bool  # decide on the host and simply not run a flagged update
    on_cpu: bool
    host_rules: bool  # the detectors' rules run on Python floats


def step_modes(cfg: GuardConfig, policies: Mapping[str, str], optimizer: torch.optim.Optimizer,
               params: list[torch.Tensor]) -> StepModes:
    skipping = any(policies[k] in SKIPPING for k in KINDS)
    # Fused optimizers skip an update themselves when handed a device-side ``found_inf``
    # (AMP's mechanism): exact, and no copy of anything. The decision must then be known
    # before the step, so not with update ratios.
    fused_skip = cfg.fused_skip and skipping and not cfg.update_ratio and bool(
        getattr(optimizer, "_step_supports_amp_scaling", False))
    # On the CPU reading the decision is a load from memory, not a device sync, so step()
    # can simply not run a skipped update. Update ratios still need the copy: their flag
    # is only known after the update.
    on_cpu = all(p.device.type == "cpu" for p in params)
    host = on_cpu if cfg.host_skip is None else cfg.host_skip
    # On the CPU the rules run on floats: no sync to avoid, and a hundred tiny torch ops
    # per step cost more than the Python arithmetic they stand for.
    host_rules = on_cpu if cfg.stats == "auto" else cfg.stats == "host"
    return StepModes(
        fused_skip=fused_skip,
        needs_backup=(skipping or cfg.update_ratio) and not fused_skip,
        host_skip=host and skipping and not cfg.update_ratio,
        on_cpu=on_cpu, host_rules=host_rules)
