"""A pydantic model among the hyper-parameters reaches ``content`` as its fields, like a
dataclass, without pydantic's empty bookkeeping entries; entries that hold data stay."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from torchverity.pickles import migrate

pydantic = pytest.importorskip("pydantic")


class Hyper(pydantic.BaseModel):
    lr: float = 0.1
    layers: list[int] = pydantic.Field(default_factory=lambda: [1, 2])


class Open(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")
    lr: float = 0.1


def test_pydantic_fields_are_keys_and_empty_bookkeeping_is_dropped(tmp_path: Path) -> None:
    src = tmp_path / "run.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)},
                "hyper_parameters": {"default": Hyper(), "set": Hyper(lr=0.5),
                                     "extra": Open(note="kept")}}, src)
    result = migrate(src, tmp_path / "out.safetensors")
    meta = json.loads(Path(result.meta_path or "").read_text())
    hp: dict[str, Any] = meta["user"]["content"]["hyper_parameters"]
    assert hp["default"] == {"$class": f"{__name__}.Hyper", "lr": 0.1, "layers": [1, 2]}
    assert hp["set"] == {"$class": f"{__name__}.Hyper", "lr": 0.5, "layers": [1, 2],
                         "__pydantic_fields_set__": {"$set": ["lr"]}}
    assert hp["extra"]["lr"] == 0.1 and hp["extra"]["__pydantic_extra__"] == {"note": "kept"}
    assert "__dict__" not in hp["extra"] and "__pydantic_private__" not in hp["extra"]
