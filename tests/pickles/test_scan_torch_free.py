"""scan of a plain torch.save file answers without importing torch, exactly as torch's
weights_only allowlist does; a name outside the names known here is still torch's call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import _weights_only_unpickler as wo

from torch_free_probe import cli
from torch_zip_artifacts import bert, save_bin_shards

_ALLOWED = "in torch's weights_only allowlist"


def _checked_like_torch(path: Path, run_cli: Any, *, torch_free: bool) -> dict[str, Any]:
    """The ``scan --json`` report of one file, run in a fresh interpreter: equal to the
    in-process one, every global classed by torch's own allowlist."""
    got = cli("scan", "--json", path)
    assert got["code"] == 0 and got["torch"] is (not torch_free)
    assert got["out"] == run_cli("scan", "--json", path).out
    (report,) = json.loads(str(got["out"]))["files"]
    allowed = set(wo._get_allowed_globals())
    assert report["globals"]
    for g in report["globals"]:
        assert (g["category"], g["reason"]) == ("torch", _ALLOWED), g
        assert g["name"] in allowed
    assert (report["verdict"], report["plan"]["needs"]) == ("safe", [])
    return report


def test_a_plain_state_dict_scans_without_torch(tmp_path: Path, run_cli: Any) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    torch.save(net.state_dict(), tmp_path / "model.pt")
    _checked_like_torch(tmp_path / "model.pt", run_cli, torch_free=True)


def test_an_optimizer_state_dict_scans_without_torch(tmp_path: Path, run_cli: Any) -> None:
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(torch.ones(2, 3)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "optim.pt")
    _checked_like_torch(tmp_path / "optim.pt", run_cli, torch_free=True)


def test_a_transformers_pytorch_model_bin_scans_without_torch(tmp_path: Path,
                                                              run_cli: Any) -> None:
    save_bin_shards(bert(), tmp_path / "bert", max_shard_size="10GB")
    (weights,) = (tmp_path / "bert").glob("pytorch_model*.bin")
    _checked_like_torch(weights, run_cli, torch_free=True)


def test_a_name_outside_the_known_ones_gets_torchs_answer(tmp_path: Path,
                                                          run_cli: Any) -> None:
    torch.save({"s": torch.randn(3, 3).to_sparse()}, tmp_path / "sparse.pt")
    report = _checked_like_torch(tmp_path / "sparse.pt", run_cli, torch_free=False)
    assert "torch._utils._rebuild_sparse_tensor" in {g["name"] for g in report["globals"]}
