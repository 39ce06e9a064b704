"""Per-step overhead of TrainingGuard, every update window verified at rest, side by side in
one run against the same optimizer unguarded in the same mode.

    python benchmarks/bench_guard.py [--quick] [--rounds N] [--device cuda]

Models: a small MLP and a small transformer encoder, trained with AdamW on synthetic
data, torch pinned to one thread. Two modes, each against its own baseline:

* *eager*: the user's loop calls ``optimizer.step()``; the guard at its defaults runs the
  at-rest check inside the update's own pass (on the CPU the native update, bit for bit
  the eager step), and with ``fused=False`` verifies in two passes (what other
  optimizers get);
* *compiled*: the user's loop calls ``torch.compile(optimizer.step)``; the guard with
  ``arithmetic="compiled"`` runs the check inside the native update with the compiled
  step's arithmetic (on the CPU), and with ``native=False`` inside the compiled update
  (what a GPU, and float16 or bfloat16 parameters, get).

A last row compares the default guard with the compiled unguarded step. The run
is many short rounds; in each, blocks of steps alternate baseline, configuration,
baseline, ... (the order of the configurations rotated from round to round), so load
from other jobs hits them alike. A block's ratio is to the mean of the two baseline
blocks around it; the overhead is the median of those paired ratios over the rounds,
the spread their interquartile range and a 95% interval of the median. The *A/A* row
times a second, identical unguarded loop against the first: the noise of the run.
Models, optimizers, guards and compiled steps are built once per model (compiling per
round would cost more than the run). Writes docs/benchmarks/guard.md.
"""

from __future__ import annotations

import argparse
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

from torchverity.training import TrainingGuard
from torchverity.training._fused import FusedUpdate, tensor_lrs
from torchverity.training._native import NativeUpdate

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "guard.md"
TARGETS = {1: 3.0, 10: 1.0}  # check interval -> max overhead in percent, every window verified


@dataclass(frozen=True)
class Config:
    name: str
    options: dict[str, Any] | None  # TrainingGuard options; None = the unguarded loop
    compiled: bool = False  # unguarded: torch.compile(optimizer.step); guarded: fused
    baseline: str = "eager, unguarded"
    interval: int | None = None  # the target this row is judged against
    runner: str | None = None  # time the runner of this configuration (same instance)
    norms: bool = False  # unguarded: read the gradient norms the guard's rules read first


EAGER = "eager, unguarded"
COMPILED = "compiled step, unguarded"
DEFAULT = "guard fused (default)"
COMPILED_GUARD = "compiled, guard fused (native=False)"
COMPILED_NATIVE = "compiled, guard fused (arithmetic='compiled')"
TWO_PASSES = "eager, guard in two passes (fused=False)"
AGAINST_COMPILED = f"{DEFAULT}, interval 10, against the compiled step"
NORMS_ONLY = "compiled step after the rules' gradient norms, unguarded"


def configs(device: torch.device) -> tuple[Config, ...]:
    """The rows. The default guard's update is the eager one's bits on the CPU (the
    native update) and the compiled one's on a GPU: it is judged against that mode."""
    native = device.type == "cpu"
    mode, base = ("eager", EAGER) if native else ("compiled", COMPILED)
    return (
        Config(EAGER, None),
        Config("eager, unguarded (A/A)", None),
        Config(f"{mode}, {DEFAULT}, interval 10", {"check_every": 10}, compiled=not native,
               baseline=base, interval=10),
        Config(f"{mode}, {DEFAULT}, interval 1", {"check_every": 1}, compiled=not native,
               baseline=base, interval=1),
        Config(f"{TWO_PASSES}, interval 10", {"check_every": 10, "fused": False}, interval=10),
        Config(f"{TWO_PASSES}, interval 1", {"check_every": 1, "fused": False}, interval=1),
        Config(COMPILED, None, compiled=True, baseline=COMPILED),
        *(Config(f"{COMPILED_NATIVE}, interval {n}",
                 {"check_every": n, "arithmetic": "compiled"}, compiled=True,
                 baseline=COMPILED, interval=n) for n in ((10, 1) if native else ())),
        Config(f"{COMPILED_GUARD}, interval 10", {"check_every": 10, "native": False},
               compiled=True, baseline=COMPILED, interval=10),
        Config(f"{COMPILED_GUARD}, interval 1", {"check_every": 1, "native": False},
               compiled=True, baseline=COMPILED, interval=1),
        *((Config(AGAINST_COMPILED, {"check_every": 10}, baseline=COMPILED,
                  runner=f"eager, {DEFAULT}, interval 10"),) if native else ()),
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
        # A tensor learning rate, as torch's recipe for compiled optimizers has it; the
        # guard's fused update turns a float one into the same.
        lr: float | torch.Tensor = torch.tensor(1e-4) if config.compiled else 1e-4
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.guard = (TrainingGuard(self.model, self.opt, **config.options)
                      if config.options is not None else None)
        self.step: Callable[[], Any] = (torch.compile(self.opt.step)
                                        if config.compiled and self.guard is None
                                        else self.opt.step)
        self.norms = config.norms
        self.run(3)  # warm-up: compilation, allocator, optimizer state, packing plans

    def run(self, steps: int) -> tuple[float, float]:
        """(wall, process CPU) seconds per step."""
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self._one()
        if self.guard is not None:
            self.guard.wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the block's kernels, not the next one's
        return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps

    def _one(self) -> None:
        x, y = self.batch()
        self.opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        if self.guard is None:
            self.step()
        else:
            self.guard.check(loss)
            self.guard.step()

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
    each as long as the config's block (:func:`block_steps`)."""
    rows = configs(device)
    wall: dict[str, list[float]] = {c.name: [] for c in rows if c.name != c.baseline}
    cpu: dict[str, list[float]] = {name: [] for name in wall}
    ms: dict[str, list[float]] = {name: [] for name in wall}
    groups = [[c for c in rows if c.baseline == b and c.name != b]
              for b in dict.fromkeys(c.baseline for c in rows)]
    runners = {c.name: Runner(make, c, device) for c in rows if c.runner is None}
    for r in range(rounds):
        for group in groups:
            order = group[r % len(group):] + group[: r % len(group)]
            base = runners[group[0].baseline]
            before, length = base.run(steps), steps
            for c in order:
                n = block_steps(c, steps)
                if n != length:  # the block before must be as long: same share of cold start
                    before, length = base.run(n), n
                w, p = runners[c.runner or c.name].run(n)
                after = base.run(n)
                wall[c.name].append(w / ((before[0] + after[0]) / 2))
                cpu[c.name].append(p / ((before[1] + after[1]) / 2))
                ms[c.name].append(w)
                before = after
    for runner in runners.values():
        runner.close()
    return [Row(c, statistics.median(ms[c.name]) * 1e3, _summary(wall[c.name]),
                _summary(cpu[c.name])[0]) for c in rows if c.name in wall]


def _covered(runner: Runner) -> list[torch.Tensor]:
    return [*runner.model.parameters(),
            *(v for state in runner.opt.state.values() for v in state.values()
              if isinstance(v, torch.Tensor) and v.device == runner.device)]


def update_alone(make: Callable[[], tuple[torch.nn.Module, Batch, str]], calls: int,
                 device: torch.device) -> dict[str, float]:
    """Median ms of one AdamW update, each way interleaved with the others on its own copy
    of the model's state: the eager and the compiled step, and the guard's native and
    compiled updates with the word sums of every parameter and state tensor."""
    eager = Runner(make, Config(EAGER, None), device)
    compiled = Runner(make, Config(COMPILED, None, compiled=True, baseline=COMPILED), device)
    ways: dict[str, Callable[[], Any]] = {"eager": eager.step, "compiled": compiled.step}
    if device.type == "cpu":
        summing = Runner(make, Config(EAGER, None), device)
        native = NativeUpdate(summing.opt)
        ways["native"] = lambda: native(_covered(summing))
        # from three compiled steps: the state and trajectory of the compiled step
        as_compiled = Runner(make, Config(COMPILED, None, compiled=True, baseline=COMPILED),
                             device)
        native_compiled = NativeUpdate(as_compiled.opt, compiled=True)
        ways["native, compiled arithmetic"] = lambda: native_compiled(_covered(as_compiled))
    fused_runner = Runner(make, Config(COMPILED, None, compiled=True, baseline=COMPILED), device)
    tensor_lrs(fused_runner.opt)
    fused = FusedUpdate(fused_runner.opt)
    ways["compiled with sums"] = lambda: fused(_covered(fused_runner))
    times: dict[str, list[float]] = {name: [] for name in ways}
    # On a GPU the kernels' time, waited for; on the CPU the process's CPU time.
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    for i in range(calls + 3):  # the first three compile and warm up
        for name, call in ways.items():
            start = clock()
            call()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 3:
                times[name].append((clock() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def guard_share(make: Callable[[], tuple[torch.nn.Module, Batch, str]], blocks: int,
                device: torch.device) -> dict[str, tuple[float, float]]:
    """The part of a step the guard changes, timed inside the step: ``guard.check(loss)``
    and ``guard.step()`` against the unguarded ``optimizer.step()`` of the same mode,
    runners interleaved step by step, forward and backward untimed. Returns per row
    ``(median ms of that part per step (CPU time; on a GPU, wall time to the end of its
    kernels) over blocks of 10 steps, each block holding
    one flag read at interval 10; median CPU ms of the whole unguarded step)``."""
    rows = {c.name: c for c in (*configs(device), *norms_only(device)) if c.runner is None
            and c.name != "eager, unguarded (A/A)" and TWO_PASSES not in c.name}
    runners = {name: Runner(make, c, device) for name, c in rows.items()}
    part: dict[str, list[float]] = {name: [] for name in runners}
    whole: dict[str, list[float]] = {name: [] for name in runners}
    cuda = device.type == "cuda"

    def clock() -> float:  # on a GPU: wall time to the end of the kernels queued so far
        if cuda:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return time.process_time()

    for _ in range(blocks):
        spent = dict.fromkeys(runners, 0.0)
        for _step in range(10):
            for name, r in runners.items():
                start = clock()
                x, y = r.batch()
                r.opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(r.model(x), y)
                loss.backward()
                mid = clock()
                if r.norms:
                    grads = [p.grad for p in r.model.parameters() if p.grad is not None]
                    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
                    torch.stack([*norms, loss.detach()]).tolist()
                if r.guard is None:
                    r.step()
                else:
                    r.guard.check(loss)
                    r.guard.step()
                    r.guard.wait()
                end = clock()
                spent[name] += end - mid
                whole[name].append(end - start)
        for name in runners:
            part[name].append(spent[name] / 10 * 1e3)
    for r in runners.values():
        r.close()
    return {name: (statistics.median(part[name]), statistics.median(whole[name]) * 1e3)
            for name in runners}


def norms_only(device: torch.device) -> tuple[Config, ...]:
    """On the CPU, the unguarded compiled step after the one read of the gradients the guard's rules
    make before every update (per-parameter norms, read as floats with the loss): the part
    of the guard's cost that is its detectors', not its at-rest check's (on a GPU the rules
    read nothing on the host)."""
    if device.type != "cpu":
        return ()
    return (Config(NORMS_ONLY, None, compiled=True, baseline=COMPILED, norms=True),)


def block_steps(config: Config, steps: int) -> int:
    """A block covers whole check intervals: every block of an interval-10 row holds one
    flag read, so no block is spared it."""
    if config.options is None:
        return steps
    return max(steps, config.options.get("check_every", 10))


def verdict(row: Row, noise: float) -> str:
    """Against the target of the row's interval, judged with the A/A noise."""
    if row.config.interval is None:
        return ""
    target = TARGETS[row.config.interval]
    median, _, _, half = row.wall
    if median + max(half, abs(noise)) <= target:
        return f"met (<= {target:g}%)"
    if median <= target:
        return f"within noise of {target:g}%"
    return f"NOT met (> {target:g}%, by {median - target:.1f} points)"


def _judge(overhead: float, interval: int | None) -> str:
    if interval is None:
        return ""
    target = TARGETS[interval]
    return f"met (<= {target:g}%)" if overhead <= target else f"NOT met (> {target:g}%)"


def _target_line(label: str, rows: list[Row], noise: float, device: torch.device) -> str:
    by = {r.config.name: r for r in rows}

    def judged(prefix: str) -> str:
        return ", ".join(f"interval {n}: {by[f'{prefix}, interval {n}'].wall[0]:+.1f}% "
                         f"({verdict(by[f'{prefix}, interval {n}'], noise)})" for n in (10, 1))

    mode = "eager" if device.type == "cpu" else "compiled"
    line = (f"* {label}: the default guard against the {mode} step "
            f"{judged(f'{mode}, {DEFAULT}')}; ")
    if device.type == "cpu":
        line += (f"the native guard with compiled arithmetic against the compiled step "
                 f"{judged(COMPILED_NATIVE)}; ")
        line += f"the compiled guard against the compiled step {judged(COMPILED_GUARD)}; "
    line += f"the two-pass guard against the eager step {judged(TWO_PASSES)}; "
    if AGAINST_COMPILED in by:
        row = by[AGAINST_COMPILED]
        line += (f"the default guard at interval 10 against the compiled step "
                 f"{row.wall[0]:+.1f}% ({row.ms:.2f} ms a step); ")
    return line + f"A/A {noise:+.1f}%."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds (a smoke run)")
    parser.add_argument("--rounds", type=int,
                        help="rounds per model (default MLP 20, transformer 10; quick 3)")
    parser.add_argument("--device", default="cpu",
                        help="e.g. cuda: the same tables on a GPU (blocks end with a sync)")
    args = parser.parse_args()
    device = torch.device(args.device)
    plan = [(make, steps, args.rounds or (3 if args.quick else n))
            for make, steps, n in ((mlp, 4, 20), (transformer, 2, 10))]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # Every unguarded compiled runner compiles the same AdamW.step for its own optimizer:
    # past torch.compile's recompile limit (8 per code object) it would run them eagerly.
    torch._dynamo.config.recompile_limit = 64
    try:
        load = f", load average {os.getloadavg()[0]:.1f} at the start"
    except OSError:
        load = ""
    command = "python benchmarks/bench_guard.py" + (" --quick" if args.quick else "") + (
        f" --rounds {args.rounds}" if args.rounds else "") + (
        f" --device {args.device}" if device.type != "cpu" else "")
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else platform.machine())
    lines = [
        "# TrainingGuard overhead, every update window verified at rest",
        "",
        f"Command: `OMP_NUM_THREADS=1 {command}`; torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch thread(s), {where}, {os.cpu_count()} cores{load} "
        "(a shared machine: other jobs ran during the run). "
        f"{' and '.join(str(n) for _, _, n in plan)} rounds (MLP, transformer); in each round "
        "blocks of steps (MLP 4, transformer 2; rows at check interval 10: 10, one flag "
        "read each) alternate baseline, configuration, baseline, ... Overhead = median over "
        "the rounds of a block's wall time over the mean of the two baseline blocks around "
        "it; IQR = the quartiles of those ratios; 95% = half-width of a 95% interval of the "
        "median; CPU = the same median on process CPU time.",
        "",
        "| model | configuration | against | ms/step | overhead (wall) | IQR | 95% | CPU time "
        "| target |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    summary = ["", "## Targets (at most 1% at interval 10, at most 3% at interval 1)", ""]
    alone = ["", "## The update alone", "",
             "One AdamW update of the whole model, median ms of 40 calls interleaved (CPU time; "
             "on a GPU, wall time to the end of its kernels): the eager `optimizer.step()`, "
             "the guard's native update with the word sums of every parameter and state "
             "tensor as it reads and writes them (CPU only), `torch.compile(optimizer.step)`, "
             "the native update with the compiled step's arithmetic and the same sums (CPU "
             "only), and the guard's compiled update with the same sums.", "",
             "| model | eager step | native update with the sums | compiled step | "
             "native update, compiled arithmetic, with the sums | "
             "compiled update with the sums |", "|---|---|---|---|---|---|"]
    inside = ["", "## The guard's part of a step, timed inside the step", "",
              "CPU ms per step of `guard.check(loss)` + `guard.step()` against the unguarded "
              "`optimizer.step()` of the same mode, the runners interleaved step by step "
              "with forward and backward untimed (medians over 20 blocks of 10 steps; each "
              "block holds one flag read at interval 10). Overhead = the difference over the "
              "whole unguarded step. This leaves out the noise of the forward and backward "
              "passes, which on a shared machine is larger than the guard. The row *compiled "
              "step after the rules' gradient norms* is no guard: the unguarded compiled step "
              "after the one read of the gradients the guard's detectors make before each "
              "update (per-parameter norms and the loss, as floats), the part of the guard's "
              "cost that is its detectors' and not its at-rest check's.", "",
              "| model | configuration | against | unguarded update | guarded part | "
              "unguarded step | overhead | target |", "|---|---|---|---|---|---|---|---|"]
    started = time.perf_counter()
    for make, steps, rounds in plan:
        label = make()[2]
        rows = measure(make, rounds, steps, device)
        noise = next(r.wall[0] for r in rows if r.config.name.endswith("(A/A)"))
        for row in rows:
            med, q1, q3, half = row.wall
            lines.append(
                f"| {label} | {row.config.name} | {row.config.baseline} | {row.ms:.2f} | "
                f"{med:+.2f}% | {q1:+.1f}..{q3:+.1f}% | +-{half:.2f}% | {row.cpu:+.2f}% | "
                f"{verdict(row, noise)} |")
            print(lines[-1], flush=True)
        summary.append(_target_line(label, rows, noise, device))
        print(summary[-1], flush=True)
        share = guard_share(make, 20, device)
        for c in (*configs(device), *norms_only(device)):
            if c.name in share and (c.options is not None or c.norms):
                ms_part, _ = share[c.name]
                base_part, base_step = share[c.baseline]
                extra = (ms_part - base_part) / base_step * 100
                inside.append(f"| {label} | {c.name} | {c.baseline} | {base_part:.2f} | "
                              f"{ms_part:.2f} | {base_step:.2f} | {extra:+.2f}% | "
                              f"{_judge(extra, c.interval)} |")
                print(inside[-1], flush=True)
        ms = update_alone(make, 40, device)
        native, native_compiled = (f"{ms[k]:.2f}" if k in ms else "n/a"
                                   for k in ("native", "native, compiled arithmetic"))
        alone.append(f"| {label} | {ms['eager']:.2f} | {native} | {ms['compiled']:.2f} | "
                     f"{native_compiled} | {ms['compiled with sums']:.2f} |")
        print(alone[-1], flush=True)
    took = f"The run took {time.perf_counter() - started:.0f} s."
    lines += [*summary, *inside, *alone, "", took, "", NOTES, ""]
    out = OUT if device.type == "cpu" else OUT.with_name(f"guard-{device.type}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines), encoding="utf-8")
    print(f"written {out}", file=sys.stderr)
    return 0


NOTES = (
    "Configurations: *guard fused (default)* = `TrainingGuard(model, opt, check_every=N)`, "
    "everything else default: every detector on (rules on floats for CPU parameters), "
    "every update window verified at rest, the word sums of each parameter and AdamW "
    "state tensor taken in the update's own pass as it reads and writes them. On the CPU "
    "that update is the native one, bit for bit the eager `optimizer.step()`, so it is "
    "compared with the same AdamW stepped eagerly; on a GPU it is the compiled one, "
    "compared with `torch.compile(optimizer.step)`. *guard fused (arithmetic='compiled')* "
    "= the native update computing what `torch.compile(optimizer.step)` computes, bit for "
    "bit, and *guard fused (native=False)* = the compiled update on the CPU, both compared "
    "with `torch.compile(optimizer.step)` (all with a tensor learning rate). *guard in "
    "two passes* = `fused=False`: a record after each update and a verification before "
    "the next (what optimizers other than SGD, Adam and "
    "AdamW get), compared with the eager step. A target is *met* when the median plus the "
    "larger of its 95% half-width and the A/A median stays within it; *within noise* when "
    "only the median does.\n\n"
    "Where the cost is, on the CPU: the table under *The update alone*. At these sizes "
    "the update is bound by memory traffic: it reads each parameter, its gradient and both "
    "moments and writes three of them back. The eager step makes that trip once per "
    "operation (about eight); the native update makes it once, in blocks that stay in the "
    "first-level cache while the old words are summed, the update runs and the new words "
    "are summed, so the sums cost a few integer adds per word. In the C++ that inductor "
    "generates for the compiled update, the sums of what the update is about to overwrite "
    "in place are taken in loops of their own before the update's loop, about half the "
    "update's memory traffic again; the native update with the compiled step's "
    "arithmetic takes them in its one pass instead. The guard's detectors read the "
    "gradients once before each update: the per-parameter norms that the skip policies of "
    "non-finite gradients and gradient spikes decide on before the update is applied. The "
    "row *compiled step after the rules' gradient norms* times that read alone; against the "
    "compiled step it is most of the guard's cost, and on a model whose update is a large "
    "share of its step (the MLP) it is more than the targets by itself."
)


if __name__ == "__main__":
    raise SystemExit(main())
