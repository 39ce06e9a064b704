"""Inference integrity: what golden checks catch and what they cost.

1. Detection, side by side on one small conv net: N random single-bit weight
   flips; for each, did the outputs change, did the mean/max/std recipe
   (tolerance 1e-4, the baseline from the issue) notice, did ``golden.check``
   (exact, same environment) notice, did it in tolerance mode.
2. Cost (best of N, the least disturbed by other load): ``golden.check`` vs
   one plain forward pass (eval, no_grad) of the same model on the same
   inputs, and ``consistency_check(runs=2)`` vs two.
3. ``torchverity selftest --seconds S`` wall time (a fresh process, so start-up
   is included) against S, and the start-up alone (``torchverity --version``).

    python benchmarks/bench_inference.py [--quick]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch
from torch import nn

import torchverity
from _common import best_of, table, write_results
from torchverity import golden


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, 10),
    ).eval()


def flip(param: torch.Tensor, index: int, bit: int) -> None:
    with torch.no_grad():
        param.view(-1).view(torch.int32)[index] ^= 1 << bit


def baseline_passes(before: torch.Tensor, after: torch.Tensor) -> bool:
    return all(abs(float(f(before)) - float(f(after))) <= 1e-4
               for f in (torch.mean, torch.max, torch.std))


def detection(flips: int, folder: Path) -> tuple[str, dict[str, int]]:
    model, x = small_cnn(), torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    path = folder / "golden.json"
    golden.record(model, x, path)
    with torch.no_grad():
        clean = model(x)
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    rng = random.Random(0)
    counts = dict.fromkeys(("changed", "baseline", "exact", "tolerance"), 0)
    for _ in range(flips):
        # Uniform over all weights, as a random memory error would be.
        p = rng.choices(params, weights=sizes)[0]
        index, bit = rng.randrange(p.numel()), rng.randrange(32)
        flip(p, index, bit)
        with torch.no_grad():
            now = model(x)
        counts["changed"] += not torch.equal(now, clean)
        counts["baseline"] += not baseline_passes(clean, now)
        counts["exact"] += not golden.check(model, path).ok
        counts["tolerance"] += not golden.check(model, path, exact=False).ok
        flip(p, index, bit)
    rows = [
        ("outputs changed at all", counts["changed"]),
        ("mean/max/std within 1e-4 (baseline recipe)", counts["baseline"]),
        ("torchverity golden check, exact (same environment)", counts["exact"]),
        ("torchverity golden check, tolerance (other device/version)", counts["tolerance"]),
    ]
    body = table(("detector", f"flips caught of {flips}"), rows)
    return body, counts


def cost(repeat: int, folder: Path) -> tuple[str, float, float]:
    model = small_cnn()
    x = torch.randn(32, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    path = folder / "cost.json"
    golden.record(model, x, path)

    def forward() -> None:
        with torch.no_grad():
            model(x)

    forward()  # warm-up: first-call allocations
    ops = {
        "forward": forward,
        "check": lambda: golden.check(model, path),
        "two": lambda: (forward(), forward()),
        "consistency": lambda: torchverity.consistency_check(model, x),
    }
    # Round-robin, best of each: background load hits every operation alike.
    best = dict.fromkeys(ops, float("inf"))
    for _ in range(repeat):
        for name, fn in ops.items():
            best[name] = min(best[name], best_of(fn, 1))
    t_forward, t_check, t_two, t_consistency = (best[n] for n in ops)
    rows = [
        ("one forward pass (eval, no_grad)", f"{t_forward * 1e3:.1f}", "1.00x"),
        ("golden.check (forward + output digest + compare)", f"{t_check * 1e3:.1f}",
         f"{t_check / t_forward:.2f}x"),
        ("two forward passes", f"{t_two * 1e3:.1f}", f"{t_two / t_forward:.2f}x"),
        ("consistency_check(runs=2)", f"{t_consistency * 1e3:.1f}",
         f"{t_consistency / t_forward:.2f}x"),
    ]
    body = table(("operation (CNN, batch 32x3x64x64)", "best ms", "vs forward"), rows)
    return body, t_check / t_forward, t_consistency / t_two


def selftest_wall(seconds: float) -> tuple[str, float, float, float]:
    import json

    def wall(args: list[str]) -> tuple[float, str]:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, *args], check=True, capture_output=True, text=True)
        return time.perf_counter() - start, done.stdout

    # The same process without the test: interpreter, torch, CLI and report.
    startup = min(wall(["-m", "torchverity", "doctor", "--no-selftest", "--json"])[0]
                  for _ in range(3))
    total, stdout = wall(["-m", "torchverity", "selftest", "--seconds", str(seconds), "--json"])
    inside = float(json.loads(stdout)["seconds"])
    rows = [
        ("start-up: `torchverity doctor --no-selftest` (imports, CLI)", f"{startup:.2f}"),
        (f"`torchverity selftest --seconds {seconds:g}`, whole process", f"{total:.2f}"),
        ("time spent testing, as reported by the command", f"{inside:.2f}"),
    ]
    return table(("fresh process", "wall s"), rows), total, startup, inside


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer flips, shorter self-test")
    args = parser.parse_args()
    flips, repeat, seconds = (100, 10, 3.0) if args.quick else (400, 30, 10.0)
    with tempfile.TemporaryDirectory(prefix="tv-bench-inference-") as tmp:
        det, counts = detection(flips, Path(tmp))
        cst, check_ratio, cons_ratio = cost(repeat, Path(tmp))
    sel, total, startup, inside = selftest_wall(seconds)
    body = (
        "## Detection of single-bit weight flips\n\n"
        f"Small conv net (2 conv + linear), 8 fixed 3x32x32 inputs, {flips} random single-bit "
        "flips (uniform over all weights and all 32 bits), each undone before the next.\n\n"
        + det +
        f"\nThe exact golden check caught {counts['exact']} of the {counts['changed']} flips "
        f"that changed any output bit; the baseline recipe caught {counts['baseline']}. "
        "Tolerance mode is for checks across devices or versions, where bitwise equality is "
        "not expected, and sees only flips that move outputs beyond float32 cross-device "
        "tolerances (rtol 1e-3, atol 1e-4).\n\n"
        "## Cost\n\n" + cst +
        f"\ngolden.check costs {check_ratio:.2f}x one forward pass; consistency_check costs "
        f"{cons_ratio:.2f}x the two forward passes it runs.\n\n"
        "## Self-test time bound\n\n" + sel +
        f"\nTarget: `selftest --seconds {seconds:g}` finishes within {seconds:g} s plus "
        f"start-up: it tested for {inside:.2f} s and the process took {total:.2f} s, "
        f"{total - startup:.2f} s more than the {startup:.2f} s start-up. A round stops the "
        "loop when the next one would overrun the bound.\n"
    )
    command = "python benchmarks/bench_inference.py" + (" --quick" if args.quick else "")
    path = write_results("inference", "Inference integrity: golden checks and self-test",
                         command, body)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
