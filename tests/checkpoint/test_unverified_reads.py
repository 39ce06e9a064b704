"""Reading refused files for inspect, fingerprint and load: torch's own warnings about a
refusal do not leak, and its terminal escapes do not reach the messages."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import pytest
import torch

import torchverity
from torchverity.errors import UnsafeFileError


class _Scripted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_refusals_print_no_torch_warnings(tmp_path: Path, run_cli) -> None:
    scripted = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(_Scripted()), scripted)
    p4 = tmp_path / "state.pkl"
    p4.write_bytes(pickle.dumps({"w": 1.5}, protocol=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for command, path in (("inspect", scripted), ("fingerprint", scripted),
                              ("inspect", p4)):
            res = run_cli(command, path)
            assert res.code in (0, 1, 2) and "Traceback" not in res.err
    noise = [str(w.message) for w in caught
             if "TorchScript archive" in str(w.message) or "pickle protocol" in str(w.message)]
    assert noise == []


def test_refusal_messages_carry_no_terminal_escapes(tmp_path: Path) -> None:
    omegaconf = pytest.importorskip("omegaconf")
    path = tmp_path / "run.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)},
                "hyper_parameters": omegaconf.OmegaConf.create({"lr": 0.1})}, path)
    with pytest.raises(Exception) as raw:
        torch.load(path, weights_only=True)
    assert "\x1b[" in str(raw.value)  # what torch itself says
    with pytest.raises(UnsafeFileError) as info:
        torchverity.load(path)
    assert "\x1b" not in str(info.value) and "refused by the weights_only loader" in str(info.value)
    assert "omegaconf" in str(info.value)  # the global torch named, in the cause
