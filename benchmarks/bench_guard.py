"""Per-step overhead of TrainingGuard vs an unguarded loop, side by side in one run.

    python benchmarks/bench_guard.py [--quick] [--rounds N]

Models: a small MLP and a small transformer encoder, trained on CPU with AdamW
(foreach and fused) on synthetic data, torch pinned to one thread. The run is
many short rounds; each round builds a fresh model, optimizer and guard per
configuration, and the blocks of a few steps alternate
baseline, configuration, baseline, configuration, ... (ABAB, the order of the
configurations rotated from round to round), so load from other jobs hits
them alike. A block's ratio is to the mean of the two baseline blocks around
it; the overhead is the median of those paired ratios over the rounds, the
spread their interquartile range and a 95% interval of the median (order
statistics). *A/A* rows time a second, identical unguarded loop against the
first: they show the noise floor of the run, and a target only counts as met
when the median is within it with room to spare. Wall time is the step time;
process CPU time is reported beside it (the guard's helper thread runs on the
other core, so its CPU time can exceed its wall time). Writes the markdown to
docs/benchmarks/guard.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchverity.training import GuardConfig, TrainingGuard

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "guard.md"
TARGETS = {1: 5.0, 10: 1.0}  # issue 5: check interval -> max overhead in percent


@dataclass(frozen=True)
class Config:
    name: str
    options: dict[str, Any] | None  # TrainingGuard options; None = the plain loop
    fused: bool = False
    clip: float | None = None  # clip_grad_norm_ max_norm: torch's unguarded, the guard's guarded
    baseline: str = "unguarded"
    interval: int | None = None  # the issue-5 target this row is judged against
    floor: bool = False  # the plain loop plus two bare reads of parameters and AdamW state


FUSED = "unguarded, fused AdamW"
CLIP = "unguarded, clip_grad_norm_(1.0)"  # the benchmark's norms stay below 1: never clips
CLIPPING = "unguarded, clip_grad_norm_(0.1)"  # clips every step
FULL = "interval 1, every window verified (rest_every=1)"
FLOOR = "at-rest floor: unguarded + 2 bare reads"
HELPER = "interval 1, every window, helper thread (overlap=True)"
DEFERRED = "interval 1, every window, record deferred (defer_record=True)"
CONFIGS = (
    Config("unguarded", None),
    Config("unguarded (A/A)", None),
    Config("interval 10", {"check_every": 10}, interval=10),
    Config("interval 1", {"check_every": 1}, interval=1),
    Config(FULL, {"check_every": 1, "rest_every": 1}),
    Config("interval 10, rules on the device", {"check_every": 10, "stats": "device"}),
    Config("interval 10, no at-rest", {"check_every": 10, "at_rest": False}),
    Config(HELPER, {"check_every": 1, "rest_every": 1, "overlap": True}),
    Config(DEFERRED, {"check_every": 1, "rest_every": 1, "defer_record": True}),
    Config(FLOOR, None, floor=True),
    Config(FUSED, None, fused=True, baseline=FUSED),
    Config("unguarded, fused AdamW (A/A)", None, fused=True, baseline=FUSED),
    Config("interval 10, fused AdamW", {"check_every": 10}, fused=True, baseline=FUSED,
           interval=10),
    Config("interval 1, fused AdamW", {"check_every": 1}, fused=True, baseline=FUSED,
           interval=1),
    Config(CLIP, None, clip=1.0, baseline=CLIP),
    Config(f"{CLIP} (A/A)", None, clip=1.0, baseline=CLIP),
    Config("interval 10, guard.clip_grad_norm_(1.0)", {"check_every": 10}, clip=1.0,
           baseline=CLIP, interval=10),
    Config("interval 1, guard.clip_grad_norm_(1.0)", {"check_every": 1}, clip=1.0,
           baseline=CLIP, interval=1),
    Config(CLIPPING, None, clip=0.1, baseline=CLIPPING),
    Config("interval 10, guard.clip_grad_norm_(0.1)", {"check_every": 10}, clip=0.1,
           baseline=CLIPPING),
)

Batch = Callable[[], tuple[torch.Tensor, torch.Tensor]]


def mlp() -> tuple[torch.nn.Module, Batch, str]:
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024), torch.nn.GELU(),
        torch.nn.Linear(1024, 10),
    )
    x, y = torch.randn(256, 512), torch.randint(0, 10, (256,))
    return model, lambda: (x, y), "MLP 512-1024-1024-10, batch 256"


class _Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(1000, 128)
        layer = torch.nn.TransformerEncoderLayer(128, 4, 512, dropout=0.1, batch_first=True)
        self.body = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(128, 1000)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids))).flatten(0, 1)


def transformer() -> tuple[torch.nn.Module, Batch, str]:
    ids = torch.randint(0, 1000, (16, 64))
    return _Encoder(), lambda: (ids, ids.flatten()), "Transformer 2x128 (d_ff 512), 16x64 tokens"


class Runner:
    """One configuration's model, optimizer and guard, trained a few steps per call."""

    def __init__(self, make: Callable[[], tuple[torch.nn.Module, Batch, str]],
                 config: Config, device: torch.device) -> None:
        torch.manual_seed(0)
        model, batch, _ = make()
        x, y = (t.to(device) for t in batch())
        self.model, self.batch, self.device = model.to(device), (lambda: (x, y)), device
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=config.fused)
        self.guard = (TrainingGuard(self.model, self.opt, **config.options)
                      if config.options is not None else None)
        self.floor, self.clip = config.floor, config.clip
        self.run(3)  # warm-up: allocator, optimizer state, packing plans

    def run(self, steps: int) -> tuple[float, float]:
        """(wall, process CPU) seconds per step; the guard's helper work is waited for."""
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self._one()
        if self.guard is not None:
            self.guard.wait()  # nothing of this block may run into the next one
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the block's kernels, not the next one's
        return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps

    def _one(self) -> None:
        x, y = self.batch()
        self.opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        if self.guard is None:
            if self.clip is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self._bare_read()
            self.opt.step()
            self._bare_read()
        else:
            self.guard.check(loss)
            if self.clip is not None:
                self.guard.clip_grad_norm_(self.clip)
            self.guard.step()

    def _bare_read(self) -> None:
        """The floor of the at-rest check: one int32 word sum of each covered tensor."""
        if not self.floor:
            return
        state = [v for s in self.opt.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)]
        for t in [*self.model.parameters(), *state]:
            t.detach().view(torch.int32).sum(dtype=torch.int32)

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()


@dataclass(frozen=True)
class Row:
    config: Config
    ms: float  # median wall ms/step
    wall: tuple[float, float, float, float]  # median, q1, q3 of paired ratios (%), CI half
    cpu: float  # median paired CPU-time ratio (%)


def _summary(ratios: list[float]) -> tuple[float, float, float, float]:
    """Median, quartiles and the half-width of a 95% interval of the median, in percent."""
    pct = sorted((r - 1.0) * 100.0 for r in ratios)
    n = len(pct)
    q = statistics.quantiles(pct, n=4) if n > 1 else [pct[0]] * 3
    k = max(0, int(n / 2 - 1.96 * math.sqrt(n) / 2))
    half = (pct[n - 1 - k] - pct[k]) / 2 if n > 2 else float("nan")
    return statistics.median(pct), q[0], q[2], half


def measure(make: Callable[[], tuple[torch.nn.Module, Batch, str]], rounds: int,
            steps: int, device: torch.device) -> list[Row]:
    """Each round runs baseline, config, baseline, config, ... baseline (per baseline), in
    a rotated order; a config's ratio is to the mean of the two baseline blocks around it,
    each as long as the config's block (:func:`block_steps`). Every round builds fresh
    models, optimizers and guards (:func:`fresh_runners`)."""
    wall: dict[str, list[float]] = {c.name: [] for c in CONFIGS if c.name != c.baseline}
    cpu: dict[str, list[float]] = {name: [] for name in wall}
    ms: dict[str, list[float]] = {name: [] for name in wall}
    groups = [[c for c in CONFIGS if c.baseline == b and c.name != b]
              for b in dict.fromkeys(c.baseline for c in CONFIGS)]
    for r in range(rounds):
        runners = fresh_runners(make, device, r)
        for group in groups:
            order = group[r % len(group):] + group[: r % len(group)]
            base = runners[group[0].baseline]
            before, length = base.run(steps), steps
            for c in order:
                n = block_steps(c, steps)
                if n != length:  # the block before must be as long: same share of cold start
                    before, length = base.run(n), n
                w, p = runners[c.name].run(n)
                after = base.run(n)
                wall[c.name].append(w / ((before[0] + after[0]) / 2))
                cpu[c.name].append(p / ((before[1] + after[1]) / 2))
                ms[c.name].append(w)
                before = after
        for runner in runners.values():
            runner.close()
    return [Row(c, statistics.median(ms[c.name]) * 1e3, _summary(wall[c.name]),
                _summary(cpu[c.name])[0]) for c in CONFIGS if c.name in wall]


def fresh_runners(make: Callable[[], tuple[torch.nn.Module, Batch, str]],
                  device: torch.device, r: int) -> dict[str, Runner]:
    """One runner per configuration, built in an order rotated by round ``r``.

    Identical unguarded MLP instances, interleaved, drift apart by up to 3% in step
    time for stretches of many rounds (six of them, each one's median deviation from
    their mean over thirds of a run: -2.6% to +3.3%, changing sign between thirds).
    With one instance per configuration for the whole run that drift lands in the
    ratios as a bias of the size of the 1% target; fresh instances each round, built
    in a different order, turn it into round-to-round noise that the median absorbs.
    """
    order = CONFIGS[r % len(CONFIGS):] + CONFIGS[: r % len(CONFIGS)]
    return {c.name: Runner(make, c, device) for c in order}


def block_steps(config: Config, steps: int) -> int:
    """A block covers whole check intervals and at-rest cadences: every block of an
    interval-10 row holds one flag read, and every block of a row with the default
    cadence (one window in 10) one at-rest record and verification, so no block is spared
    them (with shorter blocks the median would fall on the blocks without them)."""
    if config.options is None:
        return steps
    options = {**dataclasses.asdict(GuardConfig()), **config.options}
    rest = options["rest_every"] if options["at_rest"] else 1
    return max(steps, options["check_every"], rest)


def verdict(row: Row, noise: float) -> str:
    """Against the issue-5 target of the row's interval, judged with the A/A noise."""
    if row.config.interval is None:
        return ""
    target = TARGETS[row.config.interval]
    median, _, _, half = row.wall
    if median + max(half, abs(noise)) <= target:
        return f"met (<= {target:g}%)"
    if median <= target:
        return f"within noise of {target:g}%"
    return f"NOT met (> {target:g}%)"


def guard_only(make: Callable[[], tuple[torch.nn.Module, Batch, str]],
               options: dict[str, Any]) -> float:
    """ms per ``check`` + ``step`` with the optimizer's update left out (same gradients every
    time, warm caches, best of 30 x 20): the guard's own work, apart from the loop."""
    runner = Runner(make, Config("guard only", options), torch.device("cpu"))
    assert runner.guard is not None
    guard, opt = runner.guard, runner.opt
    x, y = runner.batch()
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(runner.model(x), y)
    loss.backward()
    opt.step = lambda *a, **k: None  # type: ignore[method-assign]
    best = math.inf
    for _ in range(30):
        start = time.perf_counter()
        for _ in range(20):
            guard.check(loss)
            guard.step()
        guard.wait()
        best = min(best, (time.perf_counter() - start) / 20)
    guard.close()
    return best * 1e3


def _target_line(label: str, rows: list[Row], noise: dict[str, float]) -> str:
    """The default's verdicts next to the floor every full at-rest check pays."""
    by = {r.config.name: r for r in rows}

    def judged(suffix: str, baseline: str) -> str:
        return ", ".join(f"interval {n}: {by[f'interval {n}{suffix}'].wall[0]:+.1f}% "
                         f"({verdict(by[f'interval {n}{suffix}'], noise[baseline])})"
                         for n in (10, 1))

    clip = ", guard.clip_grad_norm_(1.0)"
    return (f"* {label}: default (one window in 10 verified at rest) "
            f"{judged('', 'unguarded')}; in a loop that clips, against "
            f"`torch.nn.utils.clip_grad_norm_(1.0)`, {judged(clip, CLIP)}, "
            f"and at `max_norm=0.1` (clipping every step) interval 10: "
            f"{by['interval 10, guard.clip_grad_norm_(0.1)'].wall[0]:+.1f}%; "
            f"every window verified (interval 1, `rest_every=1`) {by[FULL].wall[0]:+.1f}%, "
            f"with the helper thread {by[HELPER].wall[0]:+.1f}%, with the record deferred "
            f"{by[DEFERRED].wall[0]:+.1f}%; at-rest floor (two bare reads per step, no guard) "
            f"{by[FLOOR].wall[0]:+.1f}%; detectors alone (no at-rest) "
            f"{by['interval 10, no at-rest'].wall[0]:+.1f}%; rules on the device "
            f"{by['interval 10, rules on the device'].wall[0]:+.1f}%; "
            f"A/A {noise['unguarded']:+.1f}%.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds (a smoke run)")
    parser.add_argument("--rounds", type=int,
                        help="rounds per model (default MLP 24, transformer 12; quick 4)")
    parser.add_argument("--device", default="cpu",
                        help="e.g. cuda: the same tables on a GPU (blocks end with a sync)")
    args = parser.parse_args()
    device = torch.device(args.device)
    plan = [(make, steps, args.rounds or (4 if args.quick else n))
            for make, steps, n in ((mlp, 4, 24), (transformer, 2, 12))]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        load = f", load average {os.getloadavg()[0]:.1f} at the start"
    except OSError:
        load = ""
    command = "python benchmarks/bench_guard.py" + (" --quick" if args.quick else "") + (
        f" --device {args.device}" if device.type != "cpu" else "")
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else platform.machine())
    lines = [
        "# TrainingGuard overhead",
        "",
        f"Command: `{command}`; torch {torch.__version__}, {torch.get_num_threads()} torch "
        f"thread(s), {where}, {os.cpu_count()} cores{load}. "
        f"{' and '.join(str(n) for _, _, n in plan)} rounds (MLP, transformer); in each "
        "round (with a fresh model, optimizer and guard per configuration), blocks of a "
        "few steps (MLP 4, transformer 2; guarded rows with the default at-rest cadence or "
        "at check interval 10: 10, one whole cadence) alternate "
        "unguarded, configuration, unguarded, ... Overhead = median over the rounds of a "
        "block's wall time over the mean of the two unguarded blocks around it; IQR = the "
        "quartiles of those ratios; 95% = half-width of a 95% interval of the median; CPU = "
        "the same median on process CPU time.",
        "",
        "| model | configuration | ms/step | overhead (wall) | IQR | 95% | CPU time | target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    summary = ["", "## Targets (issue 5: at most 1% at interval 10, at most 5% at interval 1)", ""]
    for make, steps, rounds in plan:
        label = make()[2]
        rows = measure(make, rounds, steps, device)
        noise = {r.config.baseline: r.wall[0] for r in rows if r.config.name.endswith("(A/A)")}
        for row in rows:
            med, q1, q3, half = row.wall
            lines.append(
                f"| {label} | {row.config.name} | {row.ms:.2f} | {med:+.2f}% | "
                f"{q1:+.1f}..{q3:+.1f}% | +-{half:.2f}% | {row.cpu:+.2f}% | "
                f"{verdict(row, noise.get(row.config.baseline, 0.0))} |")
            print(lines[-1], flush=True)
        summary.append(_target_line(label, rows, noise))
        if device.type == "cpu":
            whole, detectors, full, device_rules = (
                guard_only(make, {"check_every": 10, **o})
                for o in ({}, {"at_rest": False}, {"rest_every": 1},
                          {"at_rest": False, "stats": "device"}))
            summary.append(f"  The guard's own work, without the loop (warm caches, best of "
                           f"30), interval 10: {whole:.2f} ms per step, of which the detectors "
                           f"{detectors:.2f} ms (on the device: {device_rules:.2f} ms) and the "
                           f"at-rest check {whole - detectors:.2f} ms; every window verified: "
                           f"{full:.2f} ms.")
        print("\n".join(summary[-2:]), flush=True)
    lines += [*summary, "", NOTES, ""]
    out = OUT if device.type == "cpu" else OUT.with_name(f"guard-{device.type}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines), encoding="utf-8")
    print(f"written {out}", file=sys.stderr)
    return 0


NOTES = (
    "Configurations: *interval N* = `TrainingGuard(model, opt, check_every=N)`, everything "
    "else default: every detector on, with its rules on floats (CPU parameters: the "
    "per-parameter gradient norms and the loss read once per step); the at-rest checksum "
    "of every parameter and AdamW state tensor recorded after one update in 10 and "
    "verified before the next one (`rest_every=10`, the default whatever the interval: "
    "the interval changes when flags are read, not what is checked); a flagged update "
    "skipped on the host (CPU parameters: reading the decision is a memory load, not a "
    "device sync). *every window verified* = `rest_every=1` at interval 1: the record and "
    "the verification around every update (full coverage; the default at interval 1 "
    "before the at-rest cadence was made independent of the interval). "
    "*rules on the device* = `stats='device'`: the "
    "statistics, thresholds and flags as tensors, the accelerator path, timed on the CPU. "
    "*no at-rest* = `at_rest=False`. *helper thread* = `overlap=True`: a second thread "
    "sums half of the bytes of the gradient norms and of each at-rest pass beside the "
    "training thread (each pass still complete before the guard goes on); it needs the "
    "other core idle, so on a shared machine it shows the load more than the guard. "
    "*record deferred* = `defer_record=True` (opt-in): the at-rest record after each "
    "update is summed by a helper thread beside the next forward and backward pass; a bit "
    "that changes before the helper has read it is not covered (see docs/training.md). "
    "*at-rest floor* = no guard, but every parameter and AdamW state tensor read once "
    "before and once after each update by a bare int32 word sum: the memory traffic any "
    "at-rest check covering every window pays on the CPU. *fused AdamW* rows compare with "
    "an unguarded fused AdamW loop. *clip_grad_norm_* rows compare a loop that clips with "
    "`torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)` with the same loop guarded, "
    "clipping with `guard.clip_grad_norm_(1.0)` (the norms `check()` took; the same bits); "
    "the benchmark's gradient norms stay below 1.0 (0.3 to 0.6), so torch multiplies by 1.0 "
    "and the guard skips that; at `max_norm=0.1` both clip every step. "
    "A target is *met* when the median plus the larger of "
    "its 95% half-width and the A/A median stays within it; *within noise* when only the "
    "median does."
)


if __name__ == "__main__":
    raise SystemExit(main())
