"""What the service knows about its own weights, and the checks that keep it true.

At start-up the in-memory weights are fingerprinted (the baseline) and the
golden check runs once. In the background, every ``interval`` seconds, the
weights are fingerprinted again and compared with the baseline, and the golden
check reruns. A failure turns readiness off: memory that changed under a
running model does not heal, so a weights or golden-output failure keeps the
service refusing predictions (503) until it is restarted from verified weights.
A golden file that cannot be read (damaged or replaced on disk) says nothing
about the model: readiness returns when the file reads again and the check
passes. Every failing interval logs one line, without a traceback.
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
from torchverity.errors import IntegrityError, TorchVerityError
from torchverity.serve._spec import TensorSpec
from torchverity.serve._weights import WeightsInfo

log = logging.getLogger("torchverity.serve")
FINGERPRINT_HEADER = "TorchVerity-Fingerprint"
_UNREADABLE = "golden file unreadable"
GoldenStatus = Literal["passed", "failed", "unreadable", "not-configured"]


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
    _recoverable: bool = field(default=False, init=False)  # the golden file, not the model
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

    def startup_check(self, every_part: str) -> None:
        """The golden check before serving: IntegrityError naming what failed (the weights
        or the outputs), with ``every_part``, the command that lists every failed part; a
        golden file that cannot be read raises its own error."""
        if self.golden_path is None:
            return  # nothing recorded to compare with
        from torchverity.golden import check
        from torchverity.golden._run import model_device
        from torchverity.golden._verdict import verdict

        result = check(self.model, self.golden_path)
        with self._lock:
            self._golden = "passed" if result.ok else "failed"
        if result.ok:
            return
        what, step = verdict(result, weights=self.weights.path if self.weights else None,
                             device=model_device(self.model).type, every_part=every_part)
        raise IntegrityError(f"{what}, so the model is not served", path=str(self.golden_path),
                             tensors=result.weights_changed or (), hint=step)

    def record_check(self, failure: str | None) -> None:
        """Count one finished re-check; a failure turns readiness off, a pass after an
        unreadable golden file turns it back on."""
        with self._lock:
            self._checks += 1
            self._last_check = time.time()
        if failure:
            self.fail(failure, recoverable=failure.startswith(_UNREADABLE))
        else:
            self._recover()

    def fail(self, reason: str, *, recoverable: bool = False) -> None:
        """Turn readiness off (the first lasting reason is kept) and log one line."""
        with self._lock:
            first = self._failure is None or (self._recoverable and not recoverable)
            if first:
                self._failure, self._recoverable = reason, recoverable
        if first:
            log.error("torchverity serve: no longer ready: %s", reason)
        else:
            log.error("torchverity serve: still not ready: %s", reason)

    def _recover(self) -> None:
        with self._lock:
            if self._failure is None or not self._recoverable:
                return
            self._failure, self._recoverable = None, False
        log.warning("torchverity serve: ready again: the golden file reads and its check passes")

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

        try:
            result = check(self.model, self.golden_path)
        except TorchVerityError as exc:
            with self._lock:
                self._golden = "unreadable"
            return f"{_UNREADABLE}: {exc.message}"
        with self._lock:
            self._golden = "passed" if result.ok else "failed"
        if result.ok:
            return None
        from torchverity.golden._run import model_device
        from torchverity.golden._verdict import verdict

        # The sentence the start-up check gives (changed weights named whichever part failed
        # first), then the first failed parts.
        what, _step = verdict(result, weights=self.weights.path if self.weights else None,
                              device=model_device(self.model).type)
        failures = "; ".join(f.message for f in result.failures[:3])
        return f"golden check failed: {what}" + (f": {failures}" if failures else "")


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
            state.fail(f"re-check raised {type(exc).__name__}: {exc}")
