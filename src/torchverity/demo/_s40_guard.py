"""Demo step: a guarded training run catches, names, replays and rolls back injected faults."""

from __future__ import annotations

import json

import torch

from torchverity.demo import DemoContext
from torchverity.training._events import GuardSummary

TITLE = ("Training: every window verified (frozen layers too), flips named, replayed, rolled back; "
         "certified checkpoints")

STEPS = 200
POLICIES = {
    "weights_changed": "rollback",
    "nonfinite_loss": "replay",
    "nonfinite_grad": "replay",
    "loss_spike": "replay",
    "grad_norm_spike": "replay",
}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic 4-class problem: 1024 points around 4 centres in 16 dimensions."""
    gen = torch.Generator().manual_seed(0)
    centres = torch.randn(4, 16, generator=gen) * 2
    labels = torch.randint(0, 4, (1024,), generator=gen)
    return centres[labels] + torch.randn(1024, 16, generator=gen), labels


def _train(ctx: DemoContext, name: str, drill: bool
           ) -> tuple[float, GuardSummary, torch.nn.Module]:
    from torchverity import faults
    from torchverity.training import TrainingGuard

    x, y = _data()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    def step_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])

    guard = TrainingGuard(model, opt, step_fn=step_fn, log=ctx.workdir / f"{name}.jsonl",
                          checkpoint_dir=ctx.workdir / f"{name}-ckpt", checkpoint_every=50,
                          check_every=5, policies=POLICIES)
    injector = faults.FaultInjector(model)
    if drill:
        exp = faults.exponent_bit(torch.float32)
        injector.activation("0", step=70, index=3, bit=exp)  # one-off compute glitch
        injector.parameter("2.weight", step=130, index=17, bit=exp)  # memory corrupted at rest
    for step in range(STEPS):
        injector.begin_step(step)
        i = (step * 64) % 1024
        guard.train_step((x[i: i + 64], y[i: i + 64]))
    summary = guard.close()
    with torch.no_grad():
        accuracy = float((model(x).argmax(1) == y).float().mean())
    return accuracy, summary, model


def _unguarded() -> torch.nn.Module:
    """The clean run as a plain loop with no guard."""
    x, y = _data()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(STEPS):
        i = (step * 64) % 1024
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i: i + 64]), y[i: i + 64]).backward()
        opt.step()
    return model


def _at_defaults() -> tuple[int, tuple[str, ...]] | None:
    """The loop as a new user writes it, ``TrainingGuard(model, optimizer)`` and nothing
    else; the lowest mantissa bit of 2.weight[17] flipped at rest before step 50 (a change
    no statistic moves with). The step and tensors it stopped at, or None."""
    from torchverity import faults
    from torchverity.errors import TrainingAnomalyError
    from torchverity.training import TrainingGuard

    x, y = _data()
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 4)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), head)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    guard = TrainingGuard(model, opt)
    try:
        for step in range(STEPS):
            if step == 50:
                faults.flip_bit(head.weight, 17, faults.mantissa_lsb(torch.float32))
            i = (step * 64) % 1024
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[i: i + 64]), y[i: i + 64])
            loss.backward()
            guard.check(loss)
            guard.step()
    except TrainingAnomalyError as exc:
        return (exc.step if exc.step is not None else -1), tuple(exc.suspects)
    finally:
        guard.close()
    return None


def _fine_tune_frozen(ctx: DemoContext) -> list[tuple[int, str, tuple[str, ...]]]:
    """A fine-tune with the first layer frozen; a flip at rest in that frozen layer."""
    from torchverity import faults
    from torchverity.training import TrainingGuard

    x, y = _data()
    torch.manual_seed(0)
    frozen = torch.nn.Linear(16, 64).requires_grad_(False)
    model = torch.nn.Sequential(frozen, torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    guard = TrainingGuard(model, opt, log=ctx.workdir / "frozen.jsonl",
                          policies={"weights_changed": "record"})
    for step in range(30):
        if step == 20:
            faults.flip_bit(frozen.weight, 5, faults.mantissa_lsb(torch.float32))
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[:64]), y[:64])
        loss.backward()
        guard.check(loss)
        guard.step()
    guard.close()
    return [(e.step, e.kind, e.suspects) for e in guard.events]


def run(ctx: DemoContext) -> None:
    clean_acc, clean, model = _train(ctx, "clean", drill=False)
    ctx.say(f"clean guarded run: {STEPS} steps, accuracy {clean_acc:.3f}, "
            f"anomalies {clean.anomalies}")
    ctx.expect(clean.clean, "a clean run of 200 steps raises no anomaly")
    start = json.loads((ctx.workdir / "clean.jsonl").read_text().splitlines()[0])
    coverage = start["coverage"]
    ctx.say(f"coverage: {coverage['windows']} window, {coverage['tensors']}, "
            f"{coverage['verification']} ({coverage['update']} update)")
    if coverage["update"] == "native":
        same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                      _unguarded().state_dict().values(),
                                                      strict=True))
        ctx.expect(same, "the guarded run's weights are bit for bit those of the same loop "
                         "without the guard")
    else:
        ctx.say(f"  the compiled update here ({coverage['update_reason']}): "
                "its bits are those of torch.compile(optimizer.step)")
    last = ctx.workdir / "clean-ckpt" / f"guard-step{STEPS:08d}.pt"
    _rc, out, err = ctx.cli("verify", str(last))
    ctx.expect("certified by the training guard" in out + err,
               "its checkpoint is certified: the weights saved were verified at rest first")

    ctx.say("same run with two faults: an exponent-bit flip in an activation at step 70 and "
            "one in weight 2.weight[17] at rest before step 130")
    acc, summary, _ = _train(ctx, "drill", drill=True)
    rc, out, _err = ctx.cli("report", str(ctx.workdir / "drill.jsonl"), expect=None)
    ctx.expect(rc == 1, "the report fails the run (exit 1): it found the injected faults")
    ctx.expect("70    nonfinite_loss" in out and "transient" in out,
               "step 70 caught and replayed: transient (the re-run was clean)")
    ctx.expect("130   weights_changed  rolled_back" in out and "2.weight" in out,
               "step 130 caught by the at-rest checksum, 2.weight named, rolled back")
    ctx.expect(summary.rollbacks == 1, "one rollback to the last verified checkpoint")
    ctx.say(f"drill run finished all {STEPS} steps: accuracy {acc:.3f} (clean {clean_acc:.3f})")
    ctx.expect(acc > clean_acc - 0.05, "the run recovered to within 5 points of the clean run")

    ctx.say("the same loop at default settings (TrainingGuard(model, optimizer), nothing "
            "else): the lowest mantissa bit of 2.weight[17] flipped at rest before step 50")
    ctx.expect(_at_defaults() == (50, ("2.weight",)),
               "stopped at step 50 by the default policy for weights_changed, 2.weight named")

    ctx.say("a fine-tune with layer 0 frozen (requires_grad=False, as under LoRA): the lowest "
            "mantissa bit of frozen 0.weight[5] flipped at rest before step 20")
    events = _fine_tune_frozen(ctx)
    ctx.expect(events == [(20, "weights_changed", ("0.weight",))],
               "caught at step 20 and named 0.weight, though no update reads frozen weights")
