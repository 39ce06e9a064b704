"""The protect switch: what watching a load costs, side by side in one run.

Targets, on one state_dict of float32 tensors (256 MiB by default, --size-mib),
page cache warm, interleaved rounds, ratios as medians of paired rounds:

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


def timed(fn: Callable[[], object], switch: bool) -> float:
    if switch:
        protect("warn")
    gc.collect()
    try:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    finally:
        if switch:
            unprotect()


def run_rounds(cases: dict[str, tuple[Callable[[], object], bool]], rounds: int
               ) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # rotate the order
            fn, switch = cases[name]
            times[name].append(timed(fn, switch))
    return times


def paired(times: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--tiny-calls", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="64 MiB, 5 rounds")
    args = parser.parse_args()
    if args.quick:
        args.size_mib, args.rounds = 64, 5
    WORK.mkdir(parents=True, exist_ok=True)
    recorded, plain = WORK / "protect-recorded.pt", WORK / "protect-plain.pt"
    state = make_state(args.size_mib * MiB)
    torchverity.save(state, recorded)
    PLAIN_SAVE(state, plain)
    del state
    for path in (recorded, plain):  # warm the page cache
        path.read_bytes()
    cases = {
        "torchverity.load (sidecar)": (lambda: torchverity.load(recorded), False),
        "torch.load, switch on (sidecar)": (lambda: torch.load(recorded), True),
        "torch.load, switch off (no record)": (lambda: PLAIN_LOAD(plain), False),
        "torch.load, switch on (no record)": (lambda: torch.load(plain), True),
    }
    times = run_rounds(cases, args.rounds)
    base = {"torchverity.load (sidecar)": "torchverity.load (sidecar)",
            "torch.load, switch on (sidecar)": "torchverity.load (sidecar)",
            "torch.load, switch off (no record)": "torch.load, switch off (no record)",
            "torch.load, switch on (no record)": "torch.load, switch off (no record)"}
    rows = [(name, f"{min(t):.3f}", f"{statistics.median(t):.3f}",
             f"{paired(times, name, base[name]):.3f}x", base[name])
            for name, t in times.items()]
    verified = paired(times, "torch.load, switch on (sidecar)", "torchverity.load (sidecar)")
    unrecorded = paired(times, "torch.load, switch on (no record)",
                        "torch.load, switch off (no record)")
    tiny = WORK / "protect-tiny.pt"
    PLAIN_SAVE({"w": torch.ones(16)}, tiny)
    per_call = tiny_calls(tiny, args.tiny_calls)
    body = (
        f"State: 64 float32 tensors, {args.size_mib} MiB in total, page cache warm, "
        f"{args.rounds} interleaved rounds (order rotated each round).\n\n"
        + table(("method", "best s", "median s", "ratio (median of paired rounds)",
                 "baseline"), rows)
        + f"\nSwitch on, file with a sidecar / torchverity.load: {verified:.3f}x (target <= 1x, "
        "both read the file once while hashing it). Switch on, file without a record / plain "
        f"torch.load: {unrecorded:.3f}x (target <= 1.02x).\n\n"
        "## Bookkeeping per call (64-byte tensor file, no record)\n\n"
        + table(("method", "best µs per call", "median µs per call"), per_call)
    )
    print(body)
    command = "python benchmarks/bench_protect.py" + (
        f" --size-mib {args.size_mib}" if args.size_mib != 256 else "")
    write_results("protect", "Protect: the cost of watching loads", command, body)


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
