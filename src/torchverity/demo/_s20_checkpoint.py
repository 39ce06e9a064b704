"""Demo step: torchverity.save/load refuse a flipped bit, name the tensor; diff shows the bit."""

from __future__ import annotations

import shutil
from pathlib import Path

from torchverity.demo import DemoContext, small_model

TITLE = "Checkpoints: verified save/load names the damaged tensor, diff shows the flipped bit"


def run(ctx: DemoContext) -> None:

    import torchverity

    model = small_model()
    folder = ctx.workdir / "ckpt"
    folder.mkdir()
    good = folder / "model.safetensors"
    report = torchverity.save(model.state_dict(), good, meta={"epoch": 3}, seed=0)
    ctx.say(f"torchverity.save wrote {good.name}, its sidecar and meta.json in one pass "
            f"({report.algo} {report.digest[:16]}..., fingerprint {report.fingerprint[:16]}...)")
    ctx.cli("inspect", str(good))

    bad = folder / "model-copy.safetensors"
    for suffix in ("", f".{report.algo}", ".meta.json"):
        shutil.copy(f"{good}{suffix}", f"{bad}{suffix}")
    weights = model.state_dict()["2.weight"]
    # Bit 30 of a float32 is the top exponent bit: a small weight becomes ~1e38.
    index = 5
    offset = _tensor_offset(bad, "2.weight") + index * weights.element_size() + 3
    ctx.say("one bit flips inside the copy's last weight matrix:")
    ctx.cli("inject", "bitflip", str(bad), "--offset", str(offset), "--bit", "6")
    _, verify_out, _ = ctx.cli("verify", str(bad), expect=1)
    ctx.expect("damaged tensors (from its meta.json): 2.weight" in verify_out,
               "verify names the damaged tensor, not just the file")

    ctx.expect_refused("torchverity.load", lambda: torchverity.load(bad), ["2.weight"],
                       "load refuses the copy and names 2.weight")
    _, diff_out, _ = ctx.cli("diff", str(good), str(bad), expect=1)
    ctx.expect("bit-flip: bit 30 (exponent)" in diff_out,
               "diff classifies it as a single-bit flip of exponent bit 30")
    import torch

    pt = folder / "model.pt"
    torch.save(model.state_dict(), pt)
    _, same_out, _ = ctx.cli("diff", str(pt), str(good))
    ctx.expect(same_out.startswith("equal"), "diff compares a torch.save file with its "
               ".safetensors copy by their bytes (listed and hashed without torch)")
    ctx.cli("fingerprint", str(good))


def _tensor_offset(path: Path, name: str) -> int:
    """Absolute file offset of a tensor's first byte in a .safetensors file."""
    from torchverity.checkpoint._safetensors import read_header

    header = read_header(path)
    return next(e.begin for e in header.entries if e.name == name)
