"""Pickle scanners side by side: torchverity scan vs picklescan vs modelscan.

    python benchmarks/bench_scan.py [--quick]

Measures, in one run, each scanner's time and peak memory on a large torch
checkpoint (1 GiB; 128 MiB with --quick) and a small one, and its verdicts
on the generated test corpus (tests/pickle_corpus.py: malicious files of
every attack class, ordinary checkpoints; tests/pickles/loader_cases.py: files
that loaders read differently than their magic bytes suggest). Each scanner runs in its own fresh
process so peak RSS is its own. picklescan and modelscan are installed only
for the benchmark:

    pip install --target benchmarks/_work/scanners picklescan modelscan

Writes the markdown table to docs/benchmarks/scan.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "benchmarks" / "_work"
SCANNERS = WORK / "scanners"
OUT = ROOT / "docs" / "benchmarks" / "scan.md"

# Runs inside a child process: scan every file, report flags, time and peak RSS.
_CHILD = r"""
import json, sys, time
def hwm_mib():
    # VmHWM is this process's own peak RSS (ru_maxrss would include the parent's pre-exec copy).
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
tool, files = sys.argv[1], json.loads(sys.argv[2])
if tool == "torchverity":
    from torchverity.pickles._scan import scan_file, torch_allowlist
    torch_allowlist()  # imports torch once, like the other tools' imports: not timed
    def flagged(p):
        return not scan_file(p).ok  # unsafe, needs-review or malformed: exit 1
elif tool == "picklescan":
    from picklescan.scanner import scan_file_path
    def flagged(p):
        r = scan_file_path(p)
        return bool(r.infected_files or r.scan_err)
else:
    import logging
    logging.disable(logging.CRITICAL)
    from modelscan.modelscan import ModelScan
    def flagged(p):
        r = ModelScan().scan(p)
        return bool(r["summary"]["total_issues"] or r.get("errors"))
rss0 = hwm_mib()
repeat = int(sys.argv[3])
results, best = {}, 0.0
for p in files:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        try:
            results[p] = flagged(p)
        except Exception as exc:
            results[p] = "error: %s" % type(exc).__name__
        times.append(time.perf_counter() - start)
    best += min(times)
seconds = best
print(json.dumps({"seconds": seconds, "peak_rss_mib": hwm_mib(), "import_rss_mib": rss0,
                  "results": results}))
"""

TOOLS = ("torchverity", "picklescan", "modelscan")
MANY_TIMEOUT = 180.0  # seconds; a scanner slower than this is reported as timed out


def _env(tool: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if tool != "torchverity":
        env["PYTHONPATH"] = str(SCANNERS)
    return env


def run_tool(
    tool: str, files: list[Path], repeat: int = 1, timeout: float = 1800
) -> dict[str, object]:
    """Run one scanner in a fresh process; ``{"timeout": seconds}`` if it takes too long."""
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, tool, json.dumps([str(f) for f in files]),
             str(repeat)],
            capture_output=True, text=True, env=_env(tool), timeout=timeout, check=False,
        )
    except subprocess.TimeoutExpired:
        return {"timeout": timeout}
    if done.returncode != 0:
        raise RuntimeError(f"{tool} failed: {done.stderr[-2000:]}")
    report: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    report["wall_seconds"] = time.perf_counter() - start
    return report


def make_checkpoint(path: Path, total_bytes: int) -> Path:
    import torch

    if path.exists() and path.stat().st_size >= total_bytes:
        return path
    per = 4 << 20
    state = {f"layer{i}.weight": torch.empty(per // 4) for i in range(total_bytes // per)}
    torch.save(state, path)
    return path


def make_many(path: Path, count: int) -> Path:
    """A pickle-heavy checkpoint: many tiny tensors, so the pickle itself is large."""
    import torch

    if not path.exists():
        torch.save({f"block{i}.weight": torch.zeros(2) for i in range(count)}, path)
    return path


def corpus() -> tuple[list[Path], list[Path]]:
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "pickles")]
    import pickle_corpus

    root = WORK / "corpus"
    sentinel = root / "SENTINEL"
    bad = [c.path for c in pickle_corpus.malicious(root / "bad", sentinel)]
    bad += _loader_cases(root / "readings")
    good = [c.path for c in pickle_corpus.benign(root / "good")]
    good.append(pickle_corpus.user_class_checkpoint(root / "good" / "user_class.pt"))
    return bad, good


def _loader_cases(root: Path) -> list[Path]:
    """Files loaders read differently than their magic bytes suggest (tests/pickles)."""
    import loader_cases as lc

    root.mkdir(parents=True, exist_ok=True)
    s = root / "SENTINEL"
    tar = lc.tar_checkpoint(root / "tar_checkpoint.pt", lc.payload(s))
    straddle = root / "frame_straddle.pkl"
    straddle.write_bytes(lc.straddling_frame(s))
    return [
        tar, lc.upper_data_pkl(root / "upper_data_pkl.pt", s),
        lc.polyglot_safetensors(root / "polyglot.bin", s), straddle,
        lc.straddle_zip(root / "frame_straddle_zip.pt", s),
        lc.nested_loader_escape(root / "loader_escape.pkl", s),
        lc.prepended_npz(root / "prepended.npz", s),
        lc.npz_member_by_magic(root / "npz_magic.npz", s),
        lc.npy_object_spelling(root / "descr_object.npy", s, "'object'"),
        lc.joblib_duplicate_key(root / "joblib_dup_key.joblib", s),
        lc.joblib_array_bytes_payload(root / "joblib_by_pickle.joblib", s),
    ]


def _flag_counts(report: dict[str, object], files: list[Path]) -> tuple[int, int]:
    results = report["results"]
    assert isinstance(results, dict)
    flagged = sum(1 for f in files if results[str(f)] is True)
    errors = sum(1 for f in files if isinstance(results[str(f)], str))
    return flagged, errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 MiB checkpoint instead of 1 GiB")
    args = parser.parse_args()
    if not (SCANNERS / "picklescan").is_dir() or not (SCANNERS / "modelscan").is_dir():
        print(f"install the baselines first: pip install --target {SCANNERS} picklescan modelscan")
        return 2
    WORK.mkdir(parents=True, exist_ok=True)
    size = (128 if args.quick else 1024) << 20
    big = make_checkpoint(WORK / f"big_{size >> 20}mib.pt", size)
    small = make_checkpoint(WORK / "small_4mib.pt", 4 << 20)
    n_many = 10_000 if args.quick else 50_000
    many = make_many(WORK / f"many_{n_many}.pt", n_many)
    bad, good = corpus()
    rows, corpus_rows, details = [], [], []
    for tool in TOOLS:
        r_big, r_small = run_tool(tool, [big], repeat=7), run_tool(tool, [small])
        r_many = run_tool(tool, [many], repeat=3, timeout=MANY_TIMEOUT)
        r_corpus = run_tool(tool, bad + good, repeat=3)
        caught, bad_err = _flag_counts(r_corpus, bad)
        false_alarms, good_err = _flag_counts(r_corpus, good)
        rows.append((tool, r_big["seconds"], r_big["peak_rss_mib"], r_small["peak_rss_mib"],
                     r_corpus["seconds"], r_big["import_rss_mib"], r_many.get("seconds"),
                     r_many.get("peak_rss_mib")))
        corpus_rows.append((tool, caught, bad_err, false_alarms, good_err))
        details.append((tool, _names(r_corpus, bad, False), _names(r_corpus, good, True)))
        print(f"{tool}: big {r_big['seconds']:.4f}s rss {r_big['peak_rss_mib']:.0f} MiB; "
              f"corpus {caught}/{len(bad)} caught, {false_alarms}/{len(good)} benign flagged")
    write_report(rows, corpus_rows, details, size, len(bad), len(good), args.quick, n_many)
    return 0


def _names(report: dict[str, object], files: list[Path], flagged: bool) -> list[str]:
    """Files whose outcome is ``flagged`` (errors count as flagged)."""
    results = report["results"]
    assert isinstance(results, dict)
    return [f.name for f in files if (results[str(f)] is not False) == flagged]


def write_report(rows: list[tuple], corpus_rows: list[tuple], details: list[tuple], size: int,
                 n_bad: int, n_good: int, quick: bool, n_many: int) -> None:
    base = rows[1][1] or 1e-9
    lines = [
        "# Pickle scan benchmark",
        "",
        f"`python benchmarks/bench_scan.py{' --quick' if quick else ''}` on {platform.node()} "
        f"({os.cpu_count()} cores, shared with other work: figures may be contended), "
        f"Python {platform.python_version()}. Each scanner runs in a fresh process; times "
        "exclude interpreter start and imports and are the best of 7 runs (large file) or 3 "
        "runs (pickle-heavy file, and each corpus file), to damp contention from other work on "
        "the machine.",
        "",
        f"## Large checkpoint ({size >> 20} MiB torch zip, {size >> 22} tensors)",
        "",
        "| scanner | scan time (s) | vs picklescan | peak RSS big file (MiB) | "
        "peak RSS 4 MiB file (MiB) | RSS after imports (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for tool, seconds, rss_big, rss_small, _, rss_imports, _, _ in rows:
        lines.append(f"| {tool} | {seconds:.4f} | {seconds / base:.2f}x | {rss_big:.0f} | "
                     f"{rss_small:.0f} | {rss_imports:.0f} |")
    many_base = rows[1][6] or 1e-9  # picklescan
    lines += [
        "",
        f"## Pickle-heavy checkpoint ({n_many:,} tiny tensors: the pickle itself is large)",
        "",
        "| scanner | scan time (s) | vs picklescan | peak RSS (MiB) |",
        "|---|---|---|---|",
    ]
    for tool, *_, many_seconds, many_rss in rows:
        if many_seconds is None:
            lines.append(f"| {tool} | > {MANY_TIMEOUT:.0f} (stopped) | - | - |")
            continue
        lines.append(f"| {tool} | {many_seconds:.3f} | {many_seconds / many_base:.2f}x | "
                     f"{many_rss:.0f} |")
    lines += [
        "",
        f"## Generated corpus ({n_bad} malicious, {n_good} benign files)",
        "",
        "| scanner | malicious flagged | errors on malicious | benign flagged | "
        "errors on benign | corpus time (s) |",
        "|---|---|---|---|---|---|",
    ]
    for (tool, caught, bad_err, false_alarms, good_err), row in zip(corpus_rows, rows,
                                                                      strict=True):
        lines.append(f"| {tool} | {caught}/{n_bad} | {bad_err} | {false_alarms}/{n_good} | "
                     f"{good_err} | {row[4]:.3f} |")
    lines += [
        "",
        "torchverity counts `unsafe`, `needs-review` and `malformed` (exit 1) as flagged; the "
        "benign set includes one checkpoint with a user's own class, which torchverity flags "
        "`needs-review` by design (unknown classes fail closed, distinct from dangerous ones; "
        "`torchverity migrate` extracts its data). picklescan counts "
        "infected files or scan errors, modelscan issues or errors. torchverity's resident "
        "memory is almost all the `torch` import (it reads torch's own weights_only allowlist); "
        "the scan itself adds about a megabyte, whatever the checkpoint's size.",
        "",
    ]
    for tool, missed, false_alarms in details:
        lines.append(f"- {tool}: missed {', '.join(missed) or 'none'}; "
                     f"benign flagged {', '.join(false_alarms) or 'none'}")
    lines.append("")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    sys.exit(main())
