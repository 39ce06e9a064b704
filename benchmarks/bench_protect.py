"""The protect switch: what watching a load costs, side by side in one run.

Targets, on one state_dict of float32 tensors (1 GiB by default, --size-mib),
page cache warm, interleaved rounds, ratios as medians of paired rounds. Each
loaded state is dropped as soon as it is timed, so at most one copy (plus the
saved file's page cache) is in memory:

- with the switch on, ``torch.load`` of a checkpoint that has a sidecar costs at
  most what ``torchverity.load`` of it costs (both hash the file as torch reads it);
- with the switch on, ``torch.load`` of a checkpoint without any record costs at
  most 1.02x plain ``torch.load`` (the switch only looks for records).

A second table gives the switch's bookkeeping per call on a tiny file, where a
fixed cost would show.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch

import torchverity
from _common import WORK, table, write_results
from torchverity.protection import protect, unprotect

MiB = 1 << 20
PLAIN_LOAD, PLAIN_SAVE = torch.load, torch.save


def make_state(total: int, tensors: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    per = total // tensors // 4
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(tensors)}


def timed(fn: Callable[[], object], switch: bool) -> tuple[float, float]:
    """Wall seconds and CPU seconds (all threads of this process) of one call."""
    if switch:
        protect("warn")
    gc.collect()
    try:
        start, cpu = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - start, time.process_time() - cpu
    finally:
        if switch:
            unprotect()


def run_rounds(cases: dict[str, tuple[Callable[[], object], bool]], rounds: int
               ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and CPU times per case, in a new random order every round."""
    wall: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    order = random.Random(0)
    for _ in range(rounds):
        order.shuffle(names)  # no case always follows the same one
        for name in names:
            fn, switch = cases[name]
            w, c = timed(fn, switch)
            wall[name].append(w)
            cpu[name].append(c)
    return wall, cpu


def paired(times: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))


VERIFIED, ON_VERIFIED = "torchverity.load (sidecar)", "torch.load, switch on (sidecar)"
PLAIN, ON_PLAIN = "torch.load, switch off (no record)", "torch.load, switch on (no record)"
BASELINE = {VERIFIED: VERIFIED, ON_VERIFIED: VERIFIED, PLAIN: PLAIN, ON_PLAIN: PLAIN}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tiny-calls", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="64 MiB, 5 rounds")
    args = parser.parse_args()
    if args.quick:
        args.size_mib, args.rounds = 64, 5
    recorded, plain = _files(args.size_mib)
    # Each comparison interleaves only its own pair: mixed with verified loads (two
    # hashing threads), the no-record pair drifted apart by up to 20% from run to run.
    times, cpu = run_rounds({
        VERIFIED: (lambda: torchverity.load(recorded), False),
        ON_VERIFIED: (lambda: torch.load(recorded), True),
    }, args.rounds)
    more_times, more_cpu = run_rounds({
        PLAIN: (lambda: PLAIN_LOAD(plain), False),
        ON_PLAIN: (lambda: torch.load(plain), True),
    }, args.rounds)
    times.update(more_times)
    cpu.update(more_cpu)
    load = _load_average()
    tiny = WORK / "protect-tiny.pt"
    PLAIN_SAVE({"w": torch.ones(16)}, tiny)
    body = (
        f"State: 64 float32 tensors, {args.size_mib} MiB in total, page cache warm, "
        f"{args.rounds} interleaved rounds per pair (the pair's order shuffled each round).\n\n"
        + _report(times, cpu, load)
        + "## Bookkeeping per call (64-byte tensor file, no record)\n\n"
        + table(("method", "best µs per call", "median µs per call"),
                tiny_calls(tiny, args.tiny_calls))
    )
    print(body)
    command = "python benchmarks/bench_protect.py" + (
        f" --size-mib {args.size_mib}" if args.size_mib != 1024 else "") + (
        f" --rounds {args.rounds}" if args.rounds != 15 else "")
    write_results("protect", "Protect: the cost of watching loads", command, body)


def _files(size_mib: int) -> tuple[Path, Path]:
    """The same state saved with records (torchverity.save) and without (torch.save)."""
    WORK.mkdir(parents=True, exist_ok=True)
    recorded, plain = WORK / "protect-recorded.pt", WORK / "protect-plain.pt"
    state = make_state(size_mib * MiB)
    torchverity.save(state, recorded)
    PLAIN_SAVE(state, plain)
    del state
    for path in (recorded, plain):  # warm the page cache
        path.read_bytes()
    return recorded, plain


def _report(times: dict[str, list[float]], cpu: dict[str, list[float]], load: str) -> str:
    def best(name: str) -> float:
        return min(times[name]) / min(times[BASELINE[name]])

    rows = [(name, f"{min(t):.3f}", f"{statistics.median(t):.3f}", f"{best(name):.3f}x",
             f"{paired(times, name, BASELINE[name]):.3f}x", f"{statistics.median(cpu[name]):.3f}",
             f"{paired(cpu, name, BASELINE[name]):.3f}x", BASELINE[name])
            for name, t in times.items()]
    return (
        table(("method", "best wall s", "median wall s", "ratio of best wall times",
               "wall ratio (median of paired rounds)", "median CPU s (all threads)",
               "CPU ratio (median of paired rounds)", "baseline"), rows)
        + f"\nSwitch on, file with a sidecar / torchverity.load: CPU "
        f"{paired(cpu, ON_VERIFIED, VERIFIED):.3f}x, wall {best(ON_VERIFIED):.3f}x best, "
        f"{paired(times, ON_VERIFIED, VERIFIED):.3f}x paired median (target <= 1x: both read "
        "the file once while hashing it). Switch on, file without a record / plain torch.load: "
        f"CPU {paired(cpu, ON_PLAIN, PLAIN):.3f}x, wall {best(ON_PLAIN):.3f}x best, "
        f"{paired(times, ON_PLAIN, PLAIN):.3f}x paired median (target <= 1.02x). Load average "
        f"{load} after the run, on 2 cores shared with other jobs: wall times swing with the "
        "other jobs; CPU time (all threads of this process) is what each method costs.\n\n"
    )


def _load_average() -> str:
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "unknown"


def tiny_calls(path: Path, calls: int) -> list[tuple[str, str]]:
    """Blocks of ``calls`` loads, switch off and on alternating: best and median per call."""
    def block(load: Callable[[Path], object]) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            load(path)
        return (time.perf_counter() - start) / calls * 1e6

    off, on = [], []
    for _ in range(9):
        off.append(block(PLAIN_LOAD))
        protect("warn")
        try:
            on.append(block(torch.load))
        finally:
            unprotect()
    return [("torch.load, switch off", f"{min(off):.0f}", f"{statistics.median(off):.0f}"),
            ("torch.load, switch on", f"{min(on):.0f}", f"{statistics.median(on):.0f}"),
            ("difference", f"{min(on) - min(off):+.0f}",
             f"{statistics.median(on) - statistics.median(off):+.0f}")]


if __name__ == "__main__":
    main()
