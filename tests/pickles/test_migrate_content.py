"""What ``migrate`` writes to ``content`` for objects that refer back to themselves and for
config classes that pickle their fields outside ``__dict__`` (``__slots__``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from torchverity.pickles import migrate

DOC = Path(__file__).parents[2] / "docs/formats/migrate.md"


class Node:
    """A user's object graph with a back-reference, as trees with parent links are saved."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.child: Node | None = None
        self.back: Node | None = None


@dataclasses.dataclass
class SlotConfig:
    """A dataclass with ``__slots__``: pickle gives its state as ``(None, {slot: value})``."""

    __slots__ = ("act", "width")
    width: int
    act: str


@dataclasses.dataclass(slots=True)
class SlotsTrue:
    """``slots=True`` writes the slots itself."""

    depth: int
    tags: list[str]


class SlotsAndDict:
    """Slots beside an instance ``__dict__``: pickle gives ``({attr: value}, {slot: value})``."""

    __slots__ = ("__dict__", "fixed")

    def __init__(self) -> None:
        self.fixed = 1
        self.free = 2


def _content(tmp_path: Path, obj: dict[str, Any]) -> dict[str, Any]:
    src = tmp_path / "src.pt"
    torch.save({"w": torch.zeros(2), **obj}, src)
    result = migrate(src, tmp_path / "out.safetensors")
    meta = json.loads(Path(result.meta_path or "").read_text())
    content: dict[str, Any] = meta["user"]["content"]
    return content


def test_a_cycle_names_the_object_it_refers_back_to(tmp_path: Path) -> None:
    root = Node("root")
    root.child = Node("leaf")
    root.child.back = root
    loop: list[Any] = [1]
    loop.append(loop)
    content = _content(tmp_path, {"tree": root, "loop": loop, "nested": {"inner": loop}})
    assert content["tree"]["child"]["back"] == {"$cycle": "tree"}
    assert '`{"$cycle": "obj"}`' in DOC.read_text()  # the format's own example, as written
    assert content["loop"] == [1, {"$cycle": "loop"}]
    assert content["nested"]["inner"] == [1, {"$cycle": "nested.inner"}]
    # Each $cycle value is a path in content that leads to the object it stands for.
    for path, holder in (("tree", content["tree"]["child"]["back"]),
                         ("loop", content["loop"][1])):
        target = content
        for part in holder["$cycle"].split("."):
            target = target[part]
        assert holder["$cycle"] == path and isinstance(target, (dict, list))


def test_slot_fields_are_keys_like_any_attribute(tmp_path: Path) -> None:
    content = _content(tmp_path, {"hparams": {
        "slots": SlotConfig(3, "gelu"), "slots_true": SlotsTrue(2, ["a"]),
        "both": SlotsAndDict()}})
    hp = content["hparams"]
    assert hp["slots"] == {"$class": f"{__name__}.SlotConfig", "width": 3, "act": "gelu"}
    assert hp["slots_true"] == {"$class": f"{__name__}.SlotsTrue", "depth": 2, "tags": ["a"]}
    assert hp["both"] == {"$class": f"{__name__}.SlotsAndDict", "free": 2, "fixed": 1}
