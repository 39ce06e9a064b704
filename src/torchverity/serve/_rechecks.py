"""What the service knows about its own weights, and the checks that keep it true.

At start-up the in-memory weights are fingerprinted (the baseline) and the
golden check runs once. In the background, every ``interval`` seconds, the
weights are fingerprinted again and compared with the baseline, and the golden
check reruns. The first failure turns readiness off for good: memory that
changed under a running model does not heal, so the service keeps refusing
predictions (503) until it is restarted from verified weights.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from torchverity.checkpoint._fingerprint import DEVICE, Fingerprint, fingerprint
from torchverity.errors import IntegrityError
from torchverity.serve._spec import TensorSpec
from torchverity.serve._weights import WeightsInfo

log = logging.getLogger("torchverity.serve")
FINGERPRINT_HEADER = "TorchVerity-Fingerprint"
GoldenStatus = Literal["passed", "failed", "not-configured"]


@dataclass(frozen=True)
class Readiness:
    """A snapshot of the service's verdict on itself."""

    ready: bool
    reason: str | None
    golden: GoldenStatus
    checks: int
    last_check: float | None


@dataclass
class ServiceState:
    """The served model with its verified identity; thread-safe status updates."""

    model: torch.nn.Module
    name: str
    spec: tuple[TensorSpec, ...]
    weights: WeightsInfo | None
    golden_path: Path | None
    baseline: Fingerprint = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _failure: str | None = field(default=None, init=False)
    _golden: GoldenStatus = field(default="not-configured", init=False)
    _checks: int = field(default=0, init=False)
    _last_check: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.baseline = fingerprint(self.model.state_dict())

    @property
    def fingerprint_header(self) -> str:
        return f"{self.baseline.algo}:{self.baseline.root}"

    def readiness(self) -> Readiness:
        with self._lock:
            return Readiness(self._failure is None, self._failure, self._golden, self._checks,
                             self._last_check)

    def startup_check(self) -> None:
        """The golden check before serving; raises IntegrityError when it fails."""
        failure = self.golden_failure()
        if failure:
            raise IntegrityError(
                f"{failure}: the model does not compute what was recorded, so it is not "
                "served", path=str(self.golden_path),
                hint="see which part moved: torchverity golden check --model MODULE:CALLABLE "
                     f"--weights CKPT --golden {self.golden_path}",
            )

    def record_check(self, failure: str | None) -> None:
        """Count one finished re-check; a failure turns readiness off."""
        with self._lock:
            self._checks += 1
            self._last_check = time.time()
        if failure:
            self.fail(failure)

    def fail(self, reason: str) -> None:
        """Turn readiness off (the first reason is kept) and log it."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = reason
        log.error("torchverity serve: no longer ready: %s", reason)

    def weights_failure(self) -> str | None:
        """Why the in-memory weights no longer match the verified baseline, or None."""
        now = fingerprint(self.model.state_dict(),
                          mode="device" if self.baseline.algo == DEVICE else "exact")
        changed = self.baseline.differing(now)
        if not changed:
            return None
        return (f"in-memory weights changed since they were verified: {len(changed)} tensor(s) "
                f"differ: {', '.join(changed[:10])}")

    def golden_failure(self) -> str | None:
        """Why the golden check fails (None when it passes or is not configured)."""
        if self.golden_path is None:
            return None
        from torchverity.golden import check

        result = check(self.model, self.golden_path)
        with self._lock:
            self._golden = "passed" if result.ok else "failed"
        if result.ok:
            return None
        failures = "; ".join(f.message for f in result.failures[:3])
        return f"golden check failed: {failures or 'outputs differ'}"


async def recheck_forever(state: ServiceState, interval: float, model_thread: Executor) -> None:
    """The background loop. Fingerprinting only reads the weights, so it runs in a
    worker thread beside the requests; the golden forward pass runs on the model's
    own thread (``model_thread``), so the model is never called from two threads."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval)
        try:
            failure = await asyncio.to_thread(state.weights_failure)
            if failure is None:
                failure = await loop.run_in_executor(model_thread, state.golden_failure)
            state.record_check(failure)
        except Exception as exc:  # a broken check must not stop the loop silently
            log.exception("torchverity serve: re-check raised %s", type(exc).__name__)
            state.fail(f"re-check raised {type(exc).__name__}: {exc}")
