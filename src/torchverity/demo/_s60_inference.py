"""Demo step: a golden check catches one flipped weight bit that every file check accepts."""

from __future__ import annotations

from typing import Any

from torchverity.demo import DemoContext

TITLE = "Inference: golden outputs catch one flipped weight bit; the CPU passes its self-test"
MODEL = "torchverity.demo._s60_inference:build_model"


def build_model() -> Any:
    """The demo's small CNN (named by ``--model`` as module:callable)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(16, 10),
    )


def run(ctx: DemoContext) -> None:
    import torch

    import torchverity

    folder = ctx.workdir / "inference"
    folder.mkdir()
    good, flipped, gold = folder / "model.pt", folder / "model-flipped.pt", folder / "golden.json"
    model = build_model()
    torchverity.save(model.state_dict(), good)
    ctx.say("record golden outputs of a small CNN on 4 fixed inputs:")
    common = ("--model", MODEL, "--golden", str(gold))
    ctx.cli("golden", "record", *common, "--weights", str(good), "--shape", "4,3,16,16")
    ctx.cli("golden", "check", *common, "--weights", str(good))

    state = model.state_dict()
    with torch.no_grad():  # bit 12 of one float32 weight: a 0.05% change
        state["0.weight"].view(-1).view(torch.int32)[7] ^= 1 << 12
    torchverity.save(state, flipped)
    ctx.say("one weight bit flipped in memory before saving; the new file's own digest is "
            "valid, so file checks pass:")
    ctx.cli("verify", str(flipped))
    ctx.expect(_baseline_recipe_passes(model, state), "the mean/max/std (1e-4) recipe misses it")
    _, out, _ = ctx.cli("golden", "check", *common, "--weights", str(flipped), expect=1)
    ctx.expect("mean of 'output' moved" in out, "golden check names the statistic that moved")
    ctx.expect("(0.weight)" in out, "golden check names the changed weight tensor")

    ctx.say("self-test of this CPU: known answers, repeat runs, reference, memory patterns:")
    ctx.cli("selftest", "--seconds", "2", "--memory-mb", "8")


def _baseline_recipe_passes(model: Any, flipped_state: Any) -> bool:
    """The blog recipe: compare mean/max/std of outputs on fixed inputs within 1e-4."""
    import torch

    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    other = build_model()
    other.load_state_dict(flipped_state)
    with torch.no_grad():
        a, b = model.eval()(x), other.eval()(x)
    return all(abs(float(f(a)) - float(f(b))) <= 1e-4 for f in (torch.mean, torch.max, torch.std))
