"""Demo step: a legacy checkpoint is scanned, planned and migrated; a malicious one is named,
its tensors rescued inertly."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchverity.demo import DemoContext, small_model

TITLE = ("Pickle safety: scan, weights_only plan, migrate, a payload named and never run, and "
         "a model folder judged by content")


@dataclass
class RunConfig:
    """A training script's own config class, pickled into an old-style checkpoint."""

    lr: float = 3e-4
    layers: list[int] = field(default_factory=lambda: [16, 32, 4])


class _Payload:
    """What an attacker would put in a checkpoint: a command run at unpickling time."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.sentinel}",)


def run(ctx: DemoContext) -> None:
    import torch

    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    legacy = ctx.workdir / "legacy.pt"
    torch.save({"model": model, "optimizer": opt, "config": RunConfig(), "epoch": 9}, legacy)
    ctx.say("an old-style checkpoint pickles the whole model, optimizer and a config class;")
    try:
        torch.load(legacy, weights_only=True)
        refused = False
    except Exception as exc:
        refused = "Unsupported global" in str(exc)
    ctx.expect(refused, "plain torch.load(weights_only=True) refuses it, naming one global")
    _, out, _ = ctx.cli("scan", str(legacy), expect=1)
    ctx.expect("RunConfig" in out and "torch.optim.sgd.SGD" in out,
               "scan names every global at once without running any")
    ctx.expect("needs-review" in out and "unknown" in out and "dangerous" not in out,
               "a config class of your own needs review: it is not called dangerous")

    clean = ctx.workdir / "clean.safetensors"
    ctx.cli("migrate", str(legacy), str(clean))
    state = torch.load(clean, weights_only=True) if clean.suffix == ".pt" else _st_load(clean)
    ctx.expect(all(torch.equal(state[f"model.{k}"], v) for k, v in model.state_dict().items()),
               "migrate wrote a clean state_dict, equal bit for bit, loadable weights-only")

    sentinel = ctx.workdir / "PAYLOAD-RAN"
    evil = ctx.workdir / "evil.pt"
    torch.save({"w": torch.ones(2), "x": _Payload(sentinel)}, evil)
    ctx.say("a checkpoint with a payload that would run 'touch' when unpickled:")
    ctx.cli("scan", str(evil), expect=1)
    rescued = ctx.workdir / "evil.safetensors"
    _rc, _out, err = ctx.cli("migrate", str(evil), str(rescued))
    ctx.expect("posix.system" in err and torch.equal(_st_load(rescued)["w"], torch.ones(2)),
               "migrate names the payload's global and rescues the tensors to safetensors, "
               "read inertly")
    ctx.expect(not sentinel.exists(), "the payload never ran")
    _folder(ctx, model)


def _folder(ctx: DemoContext, model: Any) -> None:
    """A model folder as people have it: weights next to text files and a broken download."""
    import torch

    folder = ctx.workdir / "model"
    folder.mkdir()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    (folder / ".gitattributes").write_text("*.bin filter=lfs diff=lfs merge=lfs -text\n")
    (folder / "config.json").write_text('{"hidden_size": 32}\n')
    _, out, _ = ctx.cli("scan", str(folder))
    ctx.expect("skipped (text file, no pickle)" in out and "malformed" not in out,
               "a folder scan judges only files that can hold a pickle and names the rest")
    (folder / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 9\n")
    _, out, _ = ctx.cli("scan", str(folder / "model.safetensors"), expect=1)
    ctx.expect("Git LFS pointer" in out and "git lfs pull" in out,
               "a Git LFS pointer saved as weights is named, with the command that fetches it")


def _st_load(path: Path) -> dict[str, Any]:
    from torchverity.checkpoint._safetensors import read_header, read_tensors

    return read_tensors(path, read_header(path))
