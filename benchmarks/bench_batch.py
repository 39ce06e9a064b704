"""Batch jobs: torchverity's journaled, exactly-once runner vs a plain loop doing the same work.

Both sides run the same per-item work on one thread: read the input, run a
small MLP over it (the item's float32 values in rows of 256), write the
result. The plain loop does nothing else. torchverity also lists and hashes
every input first, re-verifies each input's SHA-256 as it reads it, hashes
every output and writes it through a temp file and an atomic rename, makes
outputs durable (``group``: one syncfs per commit point, the default;
``file``: an fsync per output; ``lazy``: none), keeps the SQLite journal
(fsync at each commit point) and writes the BagIt manifest at the end; its
time below is the whole ``run_batch`` call. Targets (issue 9): overhead at
most 15% for 10 KiB items and 5% for 1 MiB items. Neither side sets
OMP_NUM_THREADS: the model thread count is ``torch.set_num_threads(1)``,
as a user's script would set it.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import io
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).parent))
from _common import ROOT, WORK, table, write_results

KiB, MiB = 1 << 10, 1 << 20


def make_inputs(folder: Path, count: int, size: int) -> Path:
    import torch

    if folder.is_dir() and len(list(folder.iterdir())) == count:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(count)
    for i in range(count):
        values = torch.randn(size // 4, generator=gen)
        (folder / f"item{i:05d}.bin").write_bytes(values.numpy().tobytes())
    return folder


def make_work() -> Callable[[bytes], bytes]:
    """The per-item work both sides share: a 256-1024-1024-256 MLP over the item's rows."""
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024),
        torch.nn.GELU(), torch.nn.Linear(1024, 256),
    ).eval()

    def work(data: bytes) -> bytes:
        x = torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(-1, 256)
        with torch.no_grad():
            return model(x).numpy().tobytes()

    return work


def plain_loop(inputs: Path, out: Path, work: Callable[[bytes], bytes],
               fsync: bool = False) -> None:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for path in sorted(inputs.iterdir()):
        with open(out / f"{path.name}.out", "wb") as fh:
            fh.write(work(path.read_bytes()))
            if fsync:  # the durability a crash-safe job needs, and nothing else
                fh.flush()
                os.fsync(fh.fileno())


def torchverity_run(inputs: Path, out: Path, work: Callable[[bytes], bytes],
                    durability: str, batch: ModuleType | None = None) -> None:
    run_batch = (batch or importlib.import_module("torchverity.batch")).run_batch
    shutil.rmtree(out, ignore_errors=True)
    report = run_batch(inputs, lambda item: work(item.data), out, workers=1, name="bench",
                       durability=durability)
    assert report.ok and report.processed == report.total


MODES = ("group", "file", "lazy")
BASELINE_MODES = ("file", "group")  # file: the baseline's default


def load_baseline(rev: str) -> ModuleType:
    """``torchverity.batch`` as of git revision ``rev``, importable beside today's.

    Only the batch package is taken from ``rev`` (renamed ``tvbaseline_batch``); it
    shares the rest of torchverity with the current tree, so both run in one
    process and meet the same moments of the machine's load.
    """
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src/torchverity/batch"],
                             check=True, capture_output=True).stdout
    home = WORK / f"batch-baseline-{rev}"
    shutil.rmtree(home, ignore_errors=True)
    package = home / "tvbaseline_batch"
    package.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith(".py"):
                source = tar.extractfile(member)
                assert source is not None
                text = source.read().decode().replace("torchverity.batch", "tvbaseline_batch")
                (package / Path(member.name).name).write_text(text)
    sys.path.insert(0, str(home))
    return importlib.import_module("tvbaseline_batch")


def timed(run: Callable[[], None]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (this process, all threads, user + system) of one run."""
    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    wall, used = time.perf_counter(), cpu()
    run()
    return time.perf_counter() - wall, cpu() - used


def measure(label: str, count: int, size: int, work: Callable[[bytes], bytes],
            repeat: int, baseline: tuple[str, ModuleType] | None) -> list[tuple[str, ...]]:
    """Rows for every durability; all runs interleaved, best of ``repeat`` each."""
    inputs = make_inputs(WORK / f"batch-in-{label}", count, size)
    plain_out, tv_out = WORK / f"batch-plain-{label}", WORK / f"batch-tv-{label}"
    plain_loop(inputs, plain_out, work)  # warm the page cache and the model
    runs: dict[str, Callable[[], None]] = {
        "plain": lambda: plain_loop(inputs, plain_out, work),
        "plain+fsync": lambda: plain_loop(inputs, plain_out, work, fsync=True),
        **{mode: functools.partial(torchverity_run, inputs, tv_out, work, mode)
           for mode in MODES},
    }
    if baseline:
        rev, batch = baseline
        runs |= {f"{mode} ({rev})": functools.partial(torchverity_run, inputs, tv_out, work,
                                                      mode, batch)
                 for mode in BASELINE_MODES}
    # Interleaved, so every variant meets the same moments of a shared machine's load.
    best = dict.fromkeys(runs, float("inf"))
    cpu = dict.fromkeys(runs, float("inf"))
    for _ in range(repeat):
        for name, run in runs.items():
            wall, used = timed(run)
            best[name], cpu[name] = min(best[name], wall), min(cpu[name], used)
    plain, synced = best["plain"], best["plain+fsync"]
    return [
        (f"{count} x {label}", mode, f"{plain:.2f}", f"{synced:.2f}", f"{best[mode]:.2f}",
         f"{best[mode] / plain - 1:+.1%}", f"{best[mode] / synced - 1:+.1%}",
         f"{(best[mode] - plain) / count * 1e3:.2f}", f"{cpu['plain']:.2f}", f"{cpu[mode]:.2f}",
         f"{cpu[mode] / cpu['plain'] - 1:+.1%}")
        for mode in runs if mode not in ("plain", "plain+fsync")
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer items and repetitions")
    parser.add_argument("--baseline", metavar="REV",
                        help="also run torchverity.batch as of this git revision, interleaved")
    parser.add_argument("--small", type=int, help="number of 10 KiB items (default 600)")
    parser.add_argument("--large", type=int, help="number of 1 MiB items (default 48)")
    args = parser.parse_args()
    baseline = (args.baseline, load_baseline(args.baseline)) if args.baseline else None
    WORK.mkdir(parents=True, exist_ok=True)
    work = make_work()
    repeat = 2 if args.quick else 5
    small, large = (150, 8) if args.quick else (600, 48)
    small, large = args.small or small, args.large or large
    identity = lambda data: data  # noqa: E731 - the no-work case: pure bookkeeping cost
    rows = [
        row
        for label, count, size, fn in (
            ("10KiB", small, 10 * KiB, work), ("1MiB", large, MiB, work),
            ("10KiB-copy", small, 10 * KiB, identity),
        )
        for row in measure(label, count, size, fn, repeat, baseline)
    ]
    body = f"## Throughput, local engine, one worker, best of {repeat} runs\n\n"
    body += table(("items", "durability", "plain loop s", "plain + fsync s", "torchverity s",
                   "overhead vs plain", "overhead vs plain + fsync", "extra ms per item",
                   "plain CPU s", "torchverity CPU s", "CPU overhead vs plain"), rows)
    body += (
        "\nThe MLP rows run a 256-1024-1024-256 MLP over each item (targets: at most +15% "
        "for 10 KiB, +5% for 1 MiB). The copy rows do no work (the output is the input), "
        "so they show the bare cost per item of the guarantees: the listing hash, the "
        "read-time re-verification, the output hash, the journal's commits, the bag "
        "manifest and, with `file` durability, an fsync of every output. 'plain + fsync' is "
        "the plain loop with only that fsync added: the gap between the plain loop and it "
        "is the disk's price of durability (large on this shared, busy disk), the gap "
        "between it and torchverity `file` the price of the checks and the journal. "
        "`lazy` durability flushes only the journal and relies on the re-hash of committed "
        "outputs that every rerun does, so it compares with the plain loop, which does not "
        "flush either. One thread runs the model; helper threads verify, hash and write "
        "on the other core meanwhile. On a shared machine, bursts of other processes' disk "
        "and CPU use move single runs by up to 2x; each figure is the best of the "
        "interleaved runs, and differences below about 10% are within that noise. The "
        "CPU columns (best of the same runs: user + system seconds of all threads) are "
        "what the checks cost whatever the load: on a busy machine wall times mostly "
        "measure waiting (the plain loop creates and closes its files on the model's "
        "thread, torchverity on helper threads), CPU seconds do not. Where the rest of "
        "the 10 KiB overhead goes (profiled on this machine): beyond the plain loop's "
        "work, each item is read twice (the listing hash and the read-time "
        "re-verification, about 20 us each here), hashed twice and renamed (about 20 us), "
        "and each job pays the listing, the journal's creation, a syncfs and a journal "
        "commit per commit point and the bag files: roughly 0.1 s per job in the runs "
        "profiled, a sixth of a 600-item run: a job of thousands of items (the case the "
        "issue describes) spreads it thinner.\n"
    )
    if baseline:
        body += (f"\nRows marked ({args.baseline}) run `torchverity.batch` as of that git "
                 "revision (only the batch package; the rest is today's), interleaved with "
                 "today's in the same process.\n")
    cmd = "python benchmarks/bench_batch.py" + (" --quick" if args.quick else "")
    cmd += f" --small {args.small}" if args.small else ""
    cmd += f" --large {args.large}" if args.large else ""
    cmd += f" --baseline {args.baseline}" if args.baseline else ""
    print(write_results("batch", "Batch jobs", cmd, body).read_text())


if __name__ == "__main__":
    main()
