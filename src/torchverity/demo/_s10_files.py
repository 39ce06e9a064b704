"""Demo step: sidecars and manifests catch a flipped bit that torch.load accepts."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

from torchverity.demo import DemoContext, small_model

TITLE = "Files: sidecars and manifests catch what torch.load lets through"


def tensor_data_offset(checkpoint: Path) -> int:
    """Byte offset of the first tensor storage inside a torch zip checkpoint."""
    with zipfile.ZipFile(checkpoint) as zf:
        info = next(i for i in zf.infolist() if "/data/" in i.filename and i.file_size >= 4)
    with open(checkpoint, "rb") as fh:
        fh.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(fh.read(2), "little") for _ in range(2))
    return info.header_offset + 30 + name_len + extra_len


def run(ctx: DemoContext) -> None:
    import torch

    model = small_model()
    run_dir = ctx.workdir / "run1"
    run_dir.mkdir()
    ckpt = run_dir / "model.pt"
    torch.save(model.state_dict(), ckpt)
    ctx.say("saved a small real model with plain torch.save; record its digest and folder:")
    ctx.cli("hash", "--write", str(ckpt))
    ctx.cli("manifest", str(run_dir))
    ctx.cli("verify", str(ckpt), str(run_dir))

    copy_dir = ctx.workdir / "run1-copy"
    shutil.copytree(run_dir, copy_dir)
    copy = copy_dir / "model.pt"
    # Bit 30 of a float32 word is the top exponent bit: 0.1 turns into ~3.4e37.
    offset = tensor_data_offset(copy) + 3
    ctx.say("a copy of the folder gets one flipped bit inside the first weight tensor:")
    ctx.cli("inject", "bitflip", str(copy), "--offset", str(offset), "--bit", "6")
    ctx.cli("verify", str(copy), expect=1)
    ctx.cli("verify", str(copy_dir), expect=1)

    loaded = torch.load(copy, weights_only=True)
    original = model.state_dict()
    changed = [k for k in original if not torch.equal(original[k], loaded[k])]
    ctx.say(
        f"plain torch.load(weights_only=True) loaded the damaged copy without any error; "
        f"tensor {changed} now differs from what was saved"
    )
    ctx.expect(changed == ["0.weight"], "torch.load silently accepted a corrupted 0.weight")
