"""A distributed checkpoint's ``.metadata`` (what torch.distributed.checkpoint pickles
beside its shards) holds torch's own metadata dataclasses: data, not unsafe. The rest of
torch.distributed stays dangerous."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from torchverity.pickles import scan_file
from torchverity.pickles._classes import BENIGN, DANGEROUS, classify
from torchverity.pickles._values import GlobalRef


def _saved_metadata(tmp_path: Path) -> Path:
    folder = tmp_path / "dcp"
    model = torch.nn.Linear(3, 2)
    with warnings.catch_warnings():  # a single process, no process group: torch warns
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "step": 3}, checkpoint_id=folder)
    return folder / ".metadata"


def test_distributed_checkpoint_metadata_is_not_unsafe(tmp_path: Path) -> None:
    result = scan_file(_saved_metadata(tmp_path))
    assert result.verdict != "unsafe", result
    names = {g.name: g.category for g in result.globals}
    assert names["torch.distributed.checkpoint.metadata.Metadata"] == BENIGN
    assert names["torch.distributed.checkpoint.metadata.TensorProperties"] == BENIGN
    assert names["torch.distributed.checkpoint.filesystem._StorageInfo"] == BENIGN
    assert not [g for g in result.globals if g.category == DANGEROUS]


def test_the_rest_of_torch_distributed_stays_dangerous() -> None:
    for module, name in (("torch.distributed.run", "main"),
                         ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),
                         ("torch.distributed.checkpoint", "load"),
                         ("torch.distributed.checkpoint.metadata", "os"),
                         ("torch.distributed.rpc", "rpc_sync")):
        category, reason = classify(GlobalRef(module, name, 0, "STACK_GLOBAL"))
        assert category == DANGEROUS, (module, name, reason)
