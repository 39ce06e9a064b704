"""A golden file damaged on disk while the service runs: each re-check fails with a clear
reason and one log line (no traceback), and readiness returns once the file is restored.
A model whose outputs moved does not recover that way.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from torchverity.golden import record
from torchverity.serve._rechecks import ServiceState, recheck_forever


def _state(tmp_path: Path) -> tuple[ServiceState, Path]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).eval()
    golden = tmp_path / "golden.json"
    record(model, torch.ones(1, 4), golden)
    return ServiceState(model, "m", (), None, golden), golden


async def _until(state: ServiceState, condition: str, checks: int = 0) -> None:
    start = state.readiness().checks
    for _ in range(1000):
        r = state.readiness()
        if r.checks >= start + checks and (r.ready if condition == "ready" else not r.ready):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never {condition}: {state.readiness()}")


def test_a_damaged_golden_file_fails_each_recheck_and_recovers(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state, golden = _state(tmp_path)
    good = golden.read_bytes()

    async def scenario() -> str:
        with ThreadPoolExecutor(1) as pool:
            task = asyncio.create_task(recheck_forever(state, 0.02, pool))
            await _until(state, "ready", checks=2)  # clean re-checks: no false alarm
            golden.write_bytes(good[: len(good) // 2])
            await _until(state, "not ready", checks=4)
            reason = str(state.readiness().reason)
            golden.write_bytes(good)
            await _until(state, "ready", checks=1)
            task.cancel()
            return reason

    with caplog.at_level(logging.INFO, logger="torchverity.serve"):
        reason = asyncio.run(scenario())
    assert reason.startswith("golden file unreadable") and "golden.json" in reason
    lines = [r for r in caplog.records if r.name == "torchverity.serve"]
    assert all(r.exc_info is None for r in lines)  # one line each, never a traceback
    failing = [r for r in lines if "ready: golden file unreadable" in r.getMessage()]
    assert len(failing) >= 4 and all("\n" not in r.getMessage() for r in failing)
    assert "ready again" in lines[-1].getMessage()


def test_a_model_that_computes_otherwise_stays_not_ready(tmp_path: Path) -> None:
    state, golden = _state(tmp_path)

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as pool:
            task = asyncio.create_task(recheck_forever(state, 0.02, pool))
            await _until(state, "ready", checks=1)
            golden.write_text("{}")  # unreadable first: recoverable
            await _until(state, "not ready", checks=1)
            with torch.no_grad():
                state.model.bias.add_(1.0)  # the weights themselves change
            await _until(state, "not ready", checks=3)
            assert "weights changed" in str(state.readiness().reason)
            task.cancel()

    asyncio.run(scenario())
