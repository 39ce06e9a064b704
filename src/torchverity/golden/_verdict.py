"""What a failed golden check means, in one sentence, and the next step: the weights or the
computation, told apart by the weights' fingerprint (``golden check`` and ``serve``)."""

from __future__ import annotations

from torchverity.errors import shell_path
from torchverity.golden._golden import GoldenResult


def verdict(result: GoldenResult, *, weights: str | None, device: str,
            every_part: str | None = None) -> tuple[str, str]:
    """``(what failed, next step)`` for a failed check. ``weights``: the checkpoint the model
    was loaded from (None: the model's own weights); ``device``: the device type it ran
    on; ``every_part``: a command (or call) that lists every failed part, for a caller
    that does not show them."""
    golden = result.path
    changed = list(result.weights_changed or ())
    tensors = (f"{len(changed)} tensor(s) differ: {', '.join(changed[:5])}"
               + (f" and {len(changed) - 5} more" if len(changed) > 5 else ""))
    ckpt = shell_path(weights) if weights is not None else None
    outputs = [p for p in result.parts if p != "weights"]
    if "inputs" in outputs:
        return (f"{golden}: the golden file is damaged: its stored inputs do not match their "
                "recorded fingerprint, so it says nothing about the model",
                "restore the golden file from a good copy, or record it again from a trusted "
                "model (torchverity golden record)")
    if not outputs:
        what = (f"{golden}: the outputs match the record, but the weights are not the "
                f"recorded ones ({tensors})")
        step = (f"the weights loaded from {ckpt} are not the checkpoint the golden file was "
                f"recorded with: torchverity inspect {ckpt} shows which one they are (its "
                "meta.json); load the recorded checkpoint, or record the golden file again "
                "from this one if the change is meant" if ckpt is not None else
                "the model's own weights (no checkpoint loaded) are not the recorded ones: "
                "load the checkpoint the golden file was recorded with, or record the golden "
                "file again if the change is meant")
        return what, step
    moved = f"the model no longer reproduces its golden outputs ({', '.join(outputs)} failed)"
    if changed:
        what = f"{golden}: {moved}, and its weights are not the recorded ones ({tensors})"
        step = (f"check the checkpoint against its record: torchverity verify {ckpt}; if it "
                "verifies, it is not the checkpoint the golden file was recorded with, or "
                "this machine changed the weights after the load: torchverity selftest "
                f"--device {device}" if ckpt is not None else
                "the model's own weights (no checkpoint loaded) changed: load the checkpoint "
                "the golden file was recorded with")
    elif result.weights_changed is not None:
        what = f"{golden}: {moved} with the recorded weights (their fingerprint matches)"
        step = ("the computation changed, not the weights: test the hardware: torchverity "
                f"selftest --device {device}"
                + (f" (the environment differs from the recorded one: "
                   f"{'; '.join(result.environment_differences)})"
                   if result.environment_differences else ""))
    else:
        what = f"{golden}: {moved} (the weights were not compared with the record)"
        step = ((f"if the weights changed, verify the checkpoint: torchverity verify {ckpt}; "
                 if ckpt is not None else "")
                + f"test the hardware: torchverity selftest --device {device}")
    return what, step + (f"; every failed part: {every_part}" if every_part else "")
