"""Rolling statistics that live on the device (no host reads).

A ring buffer of the last ``window`` accepted rows; the mean and standard
deviation of each column over the filled slots give a spike threshold
``mean + sigma * max(std, rel_floor * |mean| + abs_floor)``. The floor keeps
a nearly constant series (a converged loss) from flagging tiny wiggles.
Every update is a fixed set of tensor ops with device-side indices, so the
host never waits for the device.
"""

from __future__ import annotations

import torch


class RollingStats:
    """Per-column rolling mean/std over the last ``window`` accepted rows."""

    def __init__(self, dim: int, window: int, device: torch.device) -> None:
        self.window = window
        self.buf = torch.zeros(window, dim, dtype=torch.float32, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.pos = torch.zeros((), dtype=torch.int64, device=device)
        self._slots = torch.arange(window, device=device).unsqueeze(1)
        # The threshold changes only with a push: computed once per push, so the guard can
        # have it computed right after the push, off the path that decides on the update.
        self._cache: tuple[tuple[float, int, float, float],
                           tuple[torch.Tensor, torch.Tensor]] | None = None

    def threshold(
        self, sigma: float, min_samples: int, rel_floor: float, abs_floor: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(threshold per column, ready)``; ready once ``min_samples`` rows were accepted."""
        key = (sigma, min_samples, rel_floor, abs_floor)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        valid = (self._slots < self.count).to(self.buf.dtype)
        n = self.count.clamp(min=1).to(self.buf.dtype)
        mean = (self.buf * valid).sum(0) / n
        var = (((self.buf - mean) * valid) ** 2).sum(0) / (n - 1).clamp(min=1)
        floor = rel_floor * mean.abs() + abs_floor
        result = mean + sigma * torch.maximum(var.sqrt(), floor), self.count >= min_samples
        self._cache = key, result
        return result

    def push(self, values: torch.Tensor, accept: torch.Tensor) -> None:
        """Append ``values`` when ``accept`` (a 0-dim bool tensor) is true; no-op otherwise."""
        index = self.pos.view(1)
        old = self.buf.index_select(0, index)
        row = torch.where(accept, values.to(self.buf.dtype).view(1, -1), old)
        self.buf.index_copy_(0, index, row)
        step = accept.to(torch.int64)
        self.pos.add_(step).remainder_(self.window)
        self.count.add_(step).clamp_(max=self.window)
        self._cache = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"buf": self.buf.clone(), "count": self.count.clone(), "pos": self.pos.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.buf.copy_(state["buf"])
        self.count.copy_(state["count"])
        self.pos.copy_(state["pos"])
        self._cache = None
