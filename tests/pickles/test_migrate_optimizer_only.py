"""``migrate --nested`` of a file holding an optimizer alone: a saved
``optimizer.state_dict()`` or the pickled optimizer, as training scripts write them beside
the model's weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import torchverity


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW([{"params": model[0].parameters()},
                             {"params": model[2].parameters(), "lr": 1e-2}], lr=1e-3)
    for _ in range(2):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("saved", ["state_dict", "optimizer"])
def test_nested_output_of_an_optimizer_alone_loads_into_an_optimizer(
        tmp_path: Path, saved: str, run_cli: Callable[..., Any]) -> None:
    model, opt = _trained()
    src = tmp_path / "optim.pt"
    torch.save(opt.state_dict() if saved == "state_dict" else opt, src)
    dst = tmp_path / "optim_nested.pt"
    result = run_cli("migrate", "--json", src, dst, "--nested")
    assert result.code == 0, result.err
    # step, exp_avg and exp_avg_sq of 4 parameters
    assert json.loads(result.out)["result"]["tensors"] == 12
    out = torchverity.load(dst, sidecar="require")
    assert list(out) == ["optimizer"]
    fresh = torch.optim.AdamW([{"params": model[0].parameters()},
                               {"params": model[2].parameters(), "lr": 1e-2}], lr=1e-3)
    fresh.load_state_dict(out["optimizer"])
    want, got = opt.state_dict(), fresh.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for index, per in want["state"].items():
        assert per.keys() == got["state"][index].keys()
        assert all(torch.equal(per[k], got["state"][index][k]) for k in per)
