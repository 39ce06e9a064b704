"""Checkpoints: verified save/load and fingerprints vs the plain PyTorch recipes.

Targets (issue 3), all on one state_dict of float32 tensors (1 GiB, or 256 MiB
with --quick), measured side by side in one run, interleaved, best of N:

- ``torchverity.save`` within 1.10x of plain ``torch.save`` and faster than
  ``torch.save`` followed by a separate hash pass (the usual recipe);
- ``torchverity.fingerprint`` at least 2x faster than the common
  ``tensor.numpy().tobytes()`` recipe and within 1.2x of hashing the raw bytes
  (with the same hash: BLAKE3, the fingerprint's algorithm);
- ``torchverity.load`` (sidecar digest + content fingerprint) within 1.3x of
  plain ``torch.load``, with and without ``mmap=True``, sha256 and blake3 sidecars.

The report also states the floor each target meets: the bytes every verified
operation must hash, divided by the hash speeds measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import blake3
import torch

import torchverity
from _common import WORK, table, write_results
from torchverity.digest import digest_file

MiB = 1 << 20
COLUMNS = ("method", "wall s", "wall ratio", "user CPU s (all threads)", "user CPU ratio",
           "system CPU s")


def make_state(total: int, tensors: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    per = total // tensors // 4
    return {f"layers.{i}.weight": torch.randn(per, generator=g) for i in range(tensors)}


def numpy_recipe(state: dict[str, torch.Tensor]) -> str:
    """The widely copied state_dict checksum: sorted keys, ``numpy().tobytes()`` per tensor."""
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].cpu().numpy().tobytes())
    return h.hexdigest()


def raw_bytes(state: dict[str, torch.Tensor]) -> str:
    """One SHA-256 pass over every tensor's bytes in place: no names, no copies."""
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(memoryview(state[key].numpy()))
    return h.hexdigest()


def raw_blake3(state: dict[str, torch.Tensor], threads: bool = True) -> str:
    """One BLAKE3 pass (all cores) over every tensor's bytes in place: no names, no copies."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO if threads else 1)
    for key in sorted(state):
        h.update(memoryview(state[key].view(torch.uint8).numpy()))
    return h.hexdigest()


def save_then_hash(state: dict[str, torch.Tensor], path: Path) -> str:
    torch.save(state, path)
    return digest_file(path).hexdigest


def save_fsync(state: dict[str, torch.Tensor], path: Path) -> None:
    with open(path, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())


SAVE_SHA = "torchverity.save (.pt, sha256 sidecar + fingerprint + meta.json, fsync)"
SAVE_B3 = "torchverity.save (.pt, blake3 sidecar + fingerprint + meta.json, fsync)"
REHASH = "torch.save then sha256 of the file (usual recipe)"
FP = "torchverity.fingerprint (exact, blake3 per tensor)"
RAW_B3 = "blake3 of the raw bytes in place (1 pass, no names)"
RAW_SHA = "sha256 of the raw bytes in place (1 pass, no names)"
NUMPY = "numpy().tobytes() recipe (sha256)"
LOAD = "torch.load(weights_only=True)"
LOAD_SHA = "torchverity.load (.pt: sha256 sidecar, weights_only, fingerprint)"
LOAD_B3 = "torchverity.load (.pt: blake3 sidecar, weights_only, fingerprint)"
MMAP = "torch.load(weights_only=True, mmap=True)"
MMAP_SHA = "torchverity.load(mmap=True) (.pt, sha256 sidecar)"
MMAP_B3 = "torchverity.load(mmap=True) (.pt, blake3 sidecar)"


def hash_speeds(state: dict[str, torch.Tensor], repeat: int) -> dict[str, float]:
    """Seconds for one pass of each hash over the state's bytes, as measured now."""
    return {
        "sha256": min(_timed(lambda: raw_bytes(state)) for _ in range(repeat)),
        "blake3": min(_timed(lambda: raw_blake3(state)) for _ in range(repeat)),
    }


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def floors(size: int, speed: dict[str, float], save: dict[str, float],
           load: dict[str, float]) -> str:
    """What the targets demand against what hashing alone costs on this machine."""
    gbs = {a: size / t / 1e9 for a, t in speed.items()}
    load_budget = 1.3 * load[LOAD]
    save_budget = 1.10 * save["torch.save"]
    return (
        "\n## Floors: what the hashes alone cost here\n\n"
        f"One pass over the {size // MiB} MiB: sha256 {speed['sha256']:.3f} s "
        f"({gbs['sha256']:.2f} GB/s, one core: SHA-256 cannot be split), blake3 "
        f"{speed['blake3']:.3f} s ({gbs['blake3']:.2f} GB/s, all cores).\n\n"
        f"- Verified load must hash every byte of the file before unpickling and every "
        f"loaded tensor after: at least one sha256 pass ({speed['sha256']:.3f} s) or two "
        f"blake3 passes ({2 * speed['blake3']:.3f} s) on top of torch.load, against a "
        f"budget of 1.3 x torch.load = {load_budget:.3f} s in total. "
        + ("Out of reach with SHA-256 on this machine. " if speed["sha256"] > load_budget
           else "") +
        ("Out of reach with BLAKE3 too: torch.load copies from the page cache faster "
         "than any cryptographic hash reads. " if 2 * speed["blake3"] + load[LOAD] > load_budget
         else "")
        + "\n"
        f"- Verified save hashes the written bytes and the tensors (two passes) beside "
        f"torch.save: with free cores they overlap it; the 1.10x budget is "
        f"{save_budget:.3f} s, a sha256 file digest alone takes {speed['sha256']:.3f} s "
        "on its core.\n")


def _cpu_seconds() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # all threads of this process
    return usage.ru_utime, usage.ru_stime


def interleaved(cases: dict[str, Callable[[], object]], repeat: int,
                cpu: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Best wall time per case (and least user and system CPU time into ``cpu``), cases
    interleaved so background load hits all alike."""
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(repeat):
        for name, fn in cases.items():
            gc.collect()
            # Start every case with no dirty pages left by the previous one: otherwise
            # the case after a plain torch.save pays for writing that file back.
            os.sync()
            start, cpu_start = time.perf_counter(), _cpu_seconds()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
            cpu_end = _cpu_seconds()
            used = (cpu_end[0] - cpu_start[0], cpu_end[1] - cpu_start[1])
            old = cpu.get(name, (float("inf"), float("inf")))
            cpu[name] = (min(old[0], used[0]), min(old[1], used[1]))
    return best


def ratio_rows(times: dict[str, float], cpu: dict[str, tuple[float, float]],
               baseline: str) -> list[tuple[str, ...]]:
    base_user = max(cpu[baseline][0], 1e-3)
    return [(name, f"{t:.3f}", f"{t / times[baseline]:.2f}x", f"{cpu[name][0]:.3f}",
             f"{cpu[name][0] / base_user:.2f}x", f"{cpu[name][1]:.3f}")
            for name, t in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="256 MiB instead of 1 GiB")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    size = (256 if args.quick else 1024) * MiB
    work = WORK / "checkpoint"
    work.mkdir(parents=True, exist_ok=True)
    state = make_state(size)
    gib = f"{size // MiB} MiB"
    load_before = os.getloadavg()[0]
    cpu: dict[str, tuple[float, float]] = {}

    save = interleaved({
        "torch.save": lambda: torch.save(state, work / "plain.pt"),
        SAVE_SHA: lambda: torchverity.save(state, work / "tv.pt"),
        SAVE_B3: lambda: torchverity.save(state, work / "tv3.pt", algo="blake3"),
        "torchverity.save (.safetensors, sha256 sidecar)":
            lambda: torchverity.save(state, work / "tv.safetensors"),
        "torch.save + fsync": lambda: save_fsync(state, work / "fsync.pt"),
        REHASH: lambda: save_then_hash(state, work / "rehash.pt"),
    }, args.repeat, cpu)
    fp = interleaved({
        FP: lambda: torchverity.fingerprint(state),
        RAW_B3: lambda: raw_blake3(state),
        "torchverity.fingerprint(mode=\"sha256\") (records made before blake3)":
            lambda: torchverity.fingerprint(state, mode="sha256"),
        RAW_SHA: lambda: raw_bytes(state),
        NUMPY: lambda: numpy_recipe(state),
    }, args.repeat, cpu)
    load = interleaved({
        LOAD: lambda: torch.load(work / "plain.pt", weights_only=True),
        LOAD_SHA: lambda: torchverity.load(work / "tv.pt"),
        LOAD_B3: lambda: torchverity.load(work / "tv3.pt"),
        "torchverity.load (.safetensors, sha256 sidecar: one read, both hashes)":
            lambda: torchverity.load(work / "tv.safetensors"),
        "torch.load then sha256 of the file (usual recipe)":
            lambda: (digest_file(work / "plain.pt"), torch.load(work / "plain.pt",
                                                                weights_only=True)),
        MMAP: lambda: torch.load(work / "plain.pt", weights_only=True, mmap=True),
        MMAP_SHA: lambda: torchverity.load(work / "tv.pt", mmap=True),
        MMAP_B3: lambda: torchverity.load(work / "tv3.pt", mmap=True),
    }, args.repeat, cpu)
    speed = hash_speeds(state, args.repeat)
    load_after = os.getloadavg()[0]

    tv_save = save[SAVE_SHA]
    tv_fp = fp[FP]
    tv_load = load[LOAD_SHA]
    body = (f"State: {len(state)} float32 tensors, {gib} in total. Page cache warm. "
            f"Load average {load_before:.1f} before, {load_after:.1f} after "
            f"(2 cores shared with other jobs: absolute times are noisy, ratios less so).\n\n")
    body += f"## Save ({gib})\n\n" + table(COLUMNS, ratio_rows(save, cpu, "torch.save"))
    body += (f"\ntorchverity.save / torch.save = {tv_save / save['torch.save']:.2f}x with a "
             f"sha256 sidecar, {save[SAVE_B3] / save['torch.save']:.2f}x with blake3 "
             f"(target <= 1.10x); vs save-then-rehash = {tv_save / save[REHASH]:.2f}x "
             "(target < 1). torchverity.save also fsyncs the file and folder, which plain "
             "torch.save does not; 'torch.save + fsync' shows that cost alone.\n")
    body += f"\n## Fingerprint ({gib})\n\n" + table(COLUMNS, ratio_rows(fp, cpu, FP))
    body += (f"\nnumpy recipe / fingerprint = {fp[NUMPY] / tv_fp:.2f}x (target >= 2x); "
             f"fingerprint / blake3 of the raw bytes = {tv_fp / fp[RAW_B3]:.2f}x "
             f"(target <= 1.2x); fingerprint / sha256 of the raw bytes = "
             f"{tv_fp / fp[RAW_SHA]:.2f}x. The recipe also crashes on bfloat16 tensors.\n")
    body += f"\n## Load ({gib})\n\n" + table(COLUMNS, ratio_rows(load, cpu, LOAD))
    body += "\nSide by side (wall s, ratio to the plain torch.load of the same row):\n\n"
    body += table(("load", "torch.load", "torchverity.load, sha256 sidecar",
                   "torchverity.load, blake3 sidecar"), [
        ("default (copy into memory)", f"{load[LOAD]:.3f}",
         f"{load[LOAD_SHA]:.3f} ({load[LOAD_SHA] / load[LOAD]:.2f}x)",
         f"{load[LOAD_B3]:.3f} ({load[LOAD_B3] / load[LOAD]:.2f}x)"),
        ("mmap=True", f"{load[MMAP]:.3f}",
         f"{load[MMAP_SHA]:.3f} ({load[MMAP_SHA] / load[MMAP]:.1f}x)",
         f"{load[MMAP_B3]:.3f} ({load[MMAP_B3] / load[MMAP]:.1f}x)"),
    ])
    body += (f"\ntorchverity.load / torch.load = {tv_load / load[LOAD]:.2f}x with a sha256 "
             f"sidecar, {load[LOAD_B3] / load[LOAD]:.2f}x with blake3 (target <= 1.3x). "
             f"With mmap=True: {load[MMAP_SHA] / load[MMAP]:.1f}x (sha256), "
             f"{load[MMAP_B3] / load[MMAP]:.1f}x (blake3) of a torch.load(mmap=True) that "
             "reads nothing yet.\n")
    body += floors(size, speed, save, load)
    body += (
        "\n## Reading these numbers\n\n"
        "`torchverity.save` writes once and runs two hash passes over the data: the file "
        "digest (the sidecar's algorithm), fed from the write stream on its own thread "
        "behind the writes, and the per-tensor BLAKE3 fingerprint, from memory on a third "
        "thread; it never re-reads the file. Plain `torch.save` only writes. The user CPU "
        "column shows that work: when both cores are free the hashes overlap the write and "
        "the wall ratio falls below the CPU ratio; on a machine shared with other jobs "
        "(load average above 2) every thread waits for a core and the wall ratio tends to "
        "the CPU ratio. System CPU and the wall time of every save are dominated by the "
        "page cache: writing 1 GiB costs 0.3 to 2 s of kernel time depending on how many "
        "dirty pages other jobs hold (ext4 here), and torchverity.save's fsync makes the "
        "disk write happen inside its timing, where plain torch.save leaves it to the "
        "kernel's writeback afterwards. `load` hashes the file before unpickling and the "
        "loaded tensors after, "
        "against a `torch.load` that is a copy from the page cache (or, with mmap=True, "
        "reads nothing until used). The fastest verified configuration is a blake3 "
        "sidecar: `torchverity.save(obj, path, algo=\"blake3\")`; `load` picks the "
        "algorithm from the sidecar.\n")
    cmd = ("python benchmarks/bench_checkpoint.py" + (" --quick" if args.quick else "")
           + (f" --repeat {args.repeat}" if args.repeat != 3 else ""))
    print(write_results("checkpoint", "Checkpoints: save, load, fingerprint", cmd, body)
          .read_text())
    print(json.dumps({"save": save, "fingerprint": fp, "load": load}, indent=1))
    for p in work.iterdir():
        p.unlink()


if __name__ == "__main__":
    main()
