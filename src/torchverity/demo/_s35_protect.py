"""Demo step: code you don't own, protected: a swallowed load failure made loud, damage refused."""

from __future__ import annotations

import contextlib
import io
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchverity.demo import DemoContext

TITLE = "Protect code you don't own: a swallowed load failure is named, a damaged file refused"


@dataclass
class TrainerState:
    """A training script's own object inside an old checkpoint: weights_only=True refuses it."""

    epoch: int = 10


def users_loader(path: Path) -> Any:
    """The loader from the articles: the error is printed and the run goes on from scratch."""
    import torch

    try:
        return torch.load(path)
    except Exception:
        print("load failed, use default init")
        return None


def run(ctx: DemoContext) -> None:
    import torch

    from torchverity.protection import protect, protected, unprotect

    old = ctx.workdir / "protect-old.pt"
    torch.save({"model": {"w": torch.ones(4)}, "state": TrainerState()}, old)
    ctx.say("an old checkpoint holds a TrainerState object; the loader below swallows errors")
    protect("warn", log=ctx.workdir / "protect.jsonl")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = users_loader(old)
    swallowed = unprotect()  # in a real run this summary comes at interpreter exit
    ctx.say(f"the loader printed {printed.getvalue().strip()!r} and returned {result}")
    ctx.expect(len(swallowed) == 1 and "Unsupported global" in swallowed[0].error,
               "the swallowed weights_only failure is listed with its error")
    ctx.expect("users_loader" in (swallowed[0].caught_in or ""),
               f"it names the catching line: {swallowed[0].caught_in}")

    good, bad = ctx.workdir / "protect-good.pt", ctx.workdir / "protect-bad.pt"
    with protected("refuse"):
        torch.save({"w": torch.arange(64, dtype=torch.float32)}, good)
        torch.save({"w": torch.arange(64, dtype=torch.float32)}, bad)
    ctx.say("with the switch on, plain torch.save wrote each file atomically with a sidecar")
    ctx.cli("verify", str(good))
    ctx.cli("inject", "bitflip", str(bad), "--offset", str(_first_storage_byte(bad)),
            "--bit", "3")
    def load_protected() -> object:
        with protected("refuse"):
            return torch.load(bad)

    ctx.expect_refused("plain torch.load", load_protected, ["w"],
                       "the damaged checkpoint is refused and names 'w'")


def _first_storage_byte(path: Path) -> int:
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if "/data/" in i.filename and i.file_size)
    with open(path, "rb") as fh:
        fh.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(fh.read(2), "little") for _ in range(2))
    return info.header_offset + 30 + name_len + extra_len
