"""Determinism records: seeding, RNG capture inside checkpoints, data-order digests, and the
two-run reproducibility check (diverging runs located, identical runs pass)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import torchverity
from torchverity import faults
from torchverity.determinism import (
    RecordingSampler,
    RngState,
    capture_rng,
    order_digest,
    restore_rng,
)
from torchverity.errors import IntegrityError, UsageError


@pytest.fixture(autouse=True)
def _restore_global_flags() -> Iterator[None]:
    deterministic = torch.are_deterministic_algorithms_enabled()
    env = {k: os.environ.get(k) for k in ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG")}
    rng = capture_rng()
    yield
    torch.use_deterministic_algorithms(deterministic)
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    restore_rng(rng)


def _draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_seed_everything_makes_every_rng_repeat_and_turns_on_determinism() -> None:
    record = torchverity.seed_everything(1234)
    first = _draws()
    torchverity.seed_everything(1234)
    assert _draws() == first
    assert record.seed == 1234 and record.deterministic
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert os.environ["PYTHONHASHSEED"] == "1234"
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    torchverity.seed_everything(1234, deterministic=False)
    assert not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(UsageError, match="out of range"):
        torchverity.seed_everything(-1)


def test_rng_state_travels_inside_a_verified_checkpoint(tmp_path: Path) -> None:
    torchverity.seed_everything(7, deterministic=False)
    np.random.randn()  # a cached gaussian must round-trip too
    state = capture_rng()
    expected = _draws()
    path = tmp_path / "ckpt.pt"
    torchverity.save({"rng": state.to_state()}, path)
    _draws()
    loaded = torchverity.load(path, sidecar="require")  # weights_only underneath
    restore_rng(RngState.from_state(loaded["rng"]))
    assert _draws() == expected


def test_bad_rng_record_is_a_format_error() -> None:
    from torchverity.errors import FormatError

    with pytest.raises(FormatError, match="not a valid RNG state record"):
        RngState.from_state({"python": {}})


# ------------------------------------------------------------ data order


def _loader(sampler: RecordingSampler) -> torch.utils.data.DataLoader[torch.Tensor]:
    data = torch.utils.data.TensorDataset(torch.arange(100))
    return torch.utils.data.DataLoader(data, batch_size=10, sampler=sampler)


def _shuffled(seed: int = 0, keep: bool = False) -> RecordingSampler:
    gen = torch.Generator().manual_seed(seed)
    return RecordingSampler(torch.utils.data.RandomSampler(range(100), generator=gen),
                            keep_order=keep)


def test_resumed_run_sees_the_same_order_and_proves_it() -> None:
    sampler = _shuffled(keep=True)
    full = [[int(i) for (b,) in _loader(sampler) for i in b] for _epoch in range(2)]
    assert [r.epoch for r in sampler.records] == [0, 1]
    assert sampler.records[1].order == tuple(full[1])
    assert sampler.records[1].digest == order_digest(full[1])
    assert full[0] != full[1]

    # Interrupted run: epoch 0 whole, epoch 1 stops after 3 batches.
    first = _shuffled()
    list(_loader(first))
    seen = []
    for n, (b,) in enumerate(_loader(first)):
        seen += b.tolist()
        if n == 2:
            break
    state = first.state_dict(position=len(seen))

    # Resumed in a new process: fresh objects, even a differently seeded generator.
    resumed = _shuffled(seed=99)
    resumed.load_state_dict(state)
    rest = [int(i) for (b,) in _loader(resumed) for i in b]
    assert seen + rest == full[1]
    assert resumed.records[0].digest == sampler.records[1].digest
    assert resumed.records[0].epoch == 1


def test_resume_with_other_data_order_is_refused() -> None:
    first = _shuffled()
    next(iter(_loader(first)))
    state = first.state_dict()
    other = RecordingSampler(torch.utils.data.SequentialSampler(range(100)))
    other.load_state_dict(state)
    with pytest.raises(IntegrityError, match="data order of epoch 0 differs"):
        list(_loader(other))


# ------------------------------------------------------------ reproducibility check


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), 1e-2)
    return model, opt, torch.randn(64, 8), torch.randn(64, 1)


def test_reproducibility_check_passes_a_deterministic_loop_and_leaves_state_alone() -> None:
    model, opt, x, y = _setup()
    before = torchverity.fingerprint(model)

    def step(i: int) -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[i * 8: i * 8 + 8]), y[i * 8: i * 8 + 8])
        loss.backward()
        opt.step()
        return loss

    result = torchverity.reproducibility_check(step, steps=6, model=model, optimizer=opt)
    assert result.ok and result.first_step is None and result.steps == 6
    assert torchverity.fingerprint(model) == before


def test_reproducibility_check_names_the_first_diverging_step_and_tensor() -> None:
    model, opt, x, y = _setup()
    calls = {"n": 0}

    def step(i: int) -> torch.Tensor:
        calls["n"] += 1
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if calls["n"] == 6 + 4:  # second run, step 3: one gradient bit goes wrong
            assert model[2].bias.grad is not None
            faults.flip_bit(model[2].bias.grad, index=0, bit=12)
        opt.step()
        return loss

    result = torchverity.reproducibility_check(step, steps=6, model=model, optimizer=opt)
    assert not result.ok
    assert result.first_step == 3
    assert result.tensors == ("model.2.bias", "state1.state.3.exp_avg", "state1.state.3.exp_avg_sq")
    assert result.losses[0] == result.losses[1]
