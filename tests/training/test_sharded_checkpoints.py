"""The guard's distributed checkpoints of a sharded model, on a one-rank FSDP2 mesh in this
process (real gloo, real torch.distributed.checkpoint): the record it writes is the one
docs/formats/distributed.md documents, and a rollback to its first checkpoint restores an
optimizer that had not stepped. The 2-rank runs are in tests/distributed/test_sharded.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchverity
import torchverity.distributed as tvd
from torchverity.errors import FormatError
from torchverity.verify import verify_path

DOC = Path(__file__).parents[2] / "docs/formats/distributed.md"


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def _fsdp2() -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(guard: Any, model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        guard.check(loss)
        guard.step()


def _held(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = [v.to_local().clone() if hasattr(v, "to_local") else v.clone()
             for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [p.to_local().clone() for p in model.parameters()] + state  # type: ignore[operator]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _documented() -> dict[str, Any]:
    block = DOC.read_text().split("### `certification` (a training guard's", 1)[1]
    return dict(json.loads("{" + block.split("```json", 1)[1].split("```", 1)[0] + "}"))


def test_rollback_to_the_first_checkpoint_restores_an_optimizer_that_had_not_stepped(
    group: None, tmp_path: Path,
) -> None:
    model, opt = _fsdp2()
    initial = _held(model, opt)
    guard = torchverity.TrainingGuard(model, opt, checkpoint_dir=tmp_path / "ckpt")
    _train(guard, model, opt, 3)
    after_three = _held(model, opt)
    assert not _same(initial, after_three)
    plain_model, plain_opt = _fsdp2()  # saving changed nothing the training computes
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        plain_opt.zero_grad()
        nn.functional.mse_loss(plain_model(x), y).backward()
        plain_opt.step()
    assert _same(after_three, _held(plain_model, plain_opt))
    first = guard.rollback()
    assert first.name == "guard-step00000000"
    assert not opt.state and _same(initial, _held(model, opt))
    _train(guard, model, opt, 3)  # AdamW starts again from step 0: the same updates, bit for bit
    assert _same(after_three, _held(model, opt))
    assert guard.close().anomalies == {}


def test_the_recorded_certification_is_the_documented_one(group: None, tmp_path: Path) -> None:
    model, opt = _fsdp2()
    guard = torchverity.TrainingGuard(model, opt, checkpoint_dir=tmp_path / "ckpt")
    _train(guard, model, opt, 2)
    path = guard.save_checkpoint()
    record = tvd.read_certification(path)
    assert record is not None and record["certified"] is True
    assert record["optimizer_state"] is True and record["world_size"] == 1
    documented = _documented()["certification"]
    assert set(record) == set(documented)
    assert set(record["ranks"]["0"]) == set(documented["ranks"]["0"])
    assert set(record["verified"]) == set(documented["verified"])
    assert set(record["guard"]) == set(documented["guard"])
    assert verify_path(path).certification == record  # torchverity verify reads the same
    first = tvd.read_certification(guard.checkpoints[0])
    assert first is not None and first["optimizer_state"] is False
    guard.close()


def test_save_dcp_keeps_any_certification_and_refuses_a_malformed_one(
    group: None, tmp_path: Path,
) -> None:
    state = {"model": {"w": torch.arange(6.0)}}
    tvd.save_dcp(state, tmp_path / "plain")
    assert tvd.read_certification(tmp_path / "plain") is None
    assert verify_path(tmp_path / "plain").certification is None
    doubtful = {"certified": False, "step": 3, "changed": ["w (rank 0)"], "unresolved": []}
    tvd.save_dcp(state, tmp_path / "doubtful", certification=doubtful)
    assert tvd.read_certification(tmp_path / "doubtful") == doubtful
    assert verify_path(tmp_path / "doubtful").certified is False
    shards = next((tmp_path / "doubtful").glob("gen-*/torchverity.shards.json"))
    record = json.loads(shards.read_text())
    shards.write_text(json.dumps({**record, "certification": {"certified": "yes"}}))
    with pytest.raises(FormatError, match="certification it records is malformed"):
        tvd.read_certification(tmp_path / "doubtful")
