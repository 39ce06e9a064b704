"""Checkpoints: verified save/load and fingerprints vs the plain PyTorch recipes.

Targets, each measured side by side in one run, interleaved, on a MiniLM-sized
BertModel state_dict (``--bert``, 86 MiB) and on float32 state dicts of
``--mib`` MiB (1 GiB by default, 256 MiB with ``--quick``); both in one run
with ``--bert --mib 1024``:

- ``torchverity.save`` within 1.15x of ``torch.save`` followed by an fsync,
  and faster than ``torch.save`` followed by a separate hash pass;
- ``torchverity.fingerprint`` at least 2x faster than the common
  ``tensor.numpy().tobytes()`` recipe and within 1.2x of hashing the raw bytes
  (with the same hash: BLAKE3, the fingerprint's algorithm);
- ``torchverity.load`` (sidecar digest + content fingerprint) within 1.3x of
  plain ``torch.load`` with the default sidecar (BLAKE3), repeated in one
  process and once in a new process; sha256 and xxh128 sidecars for comparison;
- the preflight every load runs (``check_limits``) a small fraction of
  ``torch.load``, also on a checkpoint of 10,000 tensors.

The report also states the floor each target meets: the bytes every verified
operation must hash, divided by the hash speeds measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import blake3
import torch

import torchverity
from _common import WORK, table, write_results
from torchverity.digest import digest_file, new_hasher
from torchverity.pickles import check_limits

MiB = 1 << 20
COLUMNS = ("method", "best wall s", "wall ratio (median of rounds)", "user CPU s (all threads)",
           "user CPU ratio", "system CPU s")


def make_state(total: int, tensors: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    per = total // tensors // 4
    return {f"layers.{i}.weight": torch.randn(per, generator=g) for i in range(tensors)}


def bert_state() -> dict[str, torch.Tensor]:
    """A real checkpoint's shape: a MiniLM-sized BertModel (6 layers, hidden 384), ~90 MB."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=384, num_hidden_layers=6,
                                     num_attention_heads=12, intermediate_size=1536)
    model = transformers.BertModel(config)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


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


def save_then_hash(state: dict[str, torch.Tensor], path: Path, algo: str = "sha256") -> str:
    torch.save(state, path)
    return digest_file(path, algo).hexdigest


def save_fsync(state: dict[str, torch.Tensor], path: Path) -> None:
    with open(path, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())


SAVE_SHA = "torchverity.save (.pt, sha256 sidecar + fingerprint + meta.json, fsync)"
SAVE_B3 = "torchverity.save (.pt, blake3 sidecar + fingerprint + meta.json, fsync)"
SAVE_XX = "torchverity.save (.pt, xxh128 sidecar + fingerprint + meta.json, fsync)"
REHASH = "torch.save then sha256 of the file (usual recipe)"
REHASH_XX = "torch.save then xxh128 of the file"
FP = "torchverity.fingerprint (exact, blake3 per tensor)"
RAW_B3 = "blake3 of the raw bytes in place (1 pass, no names)"
RAW_SHA = "sha256 of the raw bytes in place (1 pass, no names)"
NUMPY = "numpy().tobytes() recipe (sha256)"
LOAD = "torch.load(weights_only=True)"
LOAD_SHA = "torchverity.load (.pt, sha256 sidecar)"
LOAD_B3 = "torchverity.load (.pt, blake3 sidecar)"
LOAD_XX = "torchverity.load (.pt, xxh128 sidecar)"
LOAD_RECHECK = "torchverity.load(recheck_tensors=True) (.pt, xxh128 sidecar + blake3 fingerprint)"
LOAD_ST = "torchverity.load (.safetensors, blake3 sidecar)"
SAVE_ST = "torchverity.save (.safetensors, blake3 sidecar)"
MMAP = "torch.load(weights_only=True, mmap=True)"
MMAP_SHA = "torchverity.load(mmap=True) (.pt, sha256 sidecar)"
MMAP_XX = "torchverity.load(mmap=True) (.pt, xxh128 sidecar)"
ALGOS = {"sha256": "tv.pt", "blake3": "tv3.pt", "xxh128": "tvx.pt"}
HASH_LABELS = {"sha256": "sha256", "blake3": "blake3 (all cores)",
               "blake3_1": "blake3 (one core)", "xxh128": "xxh128"}
SAVE_BASE = "torch.save + fsync"
# One load in a new interpreter: what a training job's start-up sees (fresh memory
# to fault in), where repeated loads in one process reuse the allocator's pages.
# With a third argument (a small file of the same kind) that file is loaded first, untimed:
# the loader's modules and first-use set-up are then paid, and what is left is the large
# load's own cost in a fresh process.
FRESH = (
    "import sys, time, torch, torchverity\n"
    "kind, path = sys.argv[1], sys.argv[2]\n"
    "load = (lambda f: torch.load(f, weights_only=True)) if kind == 'torch' "
    "else (lambda f: torchverity.load(f))\n"
    "_ = [load(f) for f in sys.argv[3:]]\n"
    "start = time.perf_counter(); load(path); print(time.perf_counter() - start)\n"
)
WARM = " (after a first load of a small file)"


def raw_xxh128(state: dict[str, torch.Tensor]) -> str:
    """One XXH3-128 pass (one core) over every tensor's bytes in place."""
    h = new_hasher("xxh128")
    for key in sorted(state):
        h.update(memoryview(state[key].view(torch.uint8).numpy()))
    return h.hexdigest()


def hash_speeds(state: dict[str, torch.Tensor], repeat: int) -> dict[str, float]:
    """Seconds for one pass of each hash over the state's bytes, as measured now."""
    return {
        "sha256": min(_timed(lambda: raw_bytes(state)) for _ in range(repeat)),
        "blake3": min(_timed(lambda: raw_blake3(state)) for _ in range(repeat)),
        "blake3_1": min(_timed(lambda: raw_blake3(state, threads=False)) for _ in range(repeat)),
        "xxh128": min(_timed(lambda: raw_xxh128(state)) for _ in range(repeat)),
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
    save_budget = 1.15 * save[SAVE_BASE]
    passes = ", ".join(f"{HASH_LABELS[a]} {t:.3f} s ({gbs[a]:.2f} GB/s)"
                       for a, t in speed.items())
    out_of_reach = [HASH_LABELS[a] for a, t in speed.items() if t > load_budget - load[LOAD]]
    return (
        "\n## Floors: what the hashes alone cost here\n\n"
        f"One pass over the {size // MiB} MiB: {passes}. SHA-256 and XXH3 run on one core "
        f"(a stream cannot be split), BLAKE3 on all. CPU: {cpu_model()}.\n\n"
        f"- The load budget is 1.3 x torch.load = {load_budget:.3f} s, so a verified load "
        f"may spend {load_budget - load[LOAD]:.3f} s beyond torch.load's own copy; one pass "
        f"of {', '.join(out_of_reach) or 'no hash'} alone costs more than that here. A "
        "verified load reads the file once: with BLAKE3 or XXH3 both cores copy and the "
        "reading one hashes, with SHA-256 the other core hashes while torch copies, so what "
        "remains is the part of the hash the copy does not hide.\n"
        f"- The save budget is 1.15 x (torch.save + fsync) = {save_budget:.3f} s; save runs "
        "the file digest and the per-tensor BLAKE3 fingerprint on two threads beside "
        f"torch.save's single-threaded write (torch.save alone: {save['torch.save']:.3f} s), "
        f"so the other core must hash {size // MiB} MiB twice while the first writes it "
        f"once: {2 * speed['blake3_1']:.3f} s here with the default BLAKE3 file digest, "
        f"{speed['sha256'] + speed['blake3_1']:.3f} s with SHA-256.\n")


def cpu_model() -> str:
    """The CPU's model name and whether it has the SHA extensions hashlib's SHA-256 uses."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), "unknown")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines()
                  if line.startswith("flags")), [])
    return f"{name}, SHA extensions (sha_ni) {'present' if 'sha_ni' in flags else 'absent'}"


def _cpu_seconds() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # all threads of this process
    return usage.ru_utime, usage.ru_stime


def interleaved(cases: dict[str, Callable[[], object]], repeat: int,
                cpu: dict[str, tuple[float, float]],
                paired: dict[str, float]) -> dict[str, float]:
    """Best wall time per case; least user and system CPU time into ``cpu``; into
    ``paired`` the median over rounds of each case's time over the first case's time
    in the same round. The order is shuffled every round, so no case always follows
    the same one (a case pays for the page cache the one before it left behind)."""
    names = list(cases)
    times: dict[str, list[float]] = {name: [] for name in names}
    # One untimed round first: on this VM the first write into memory the guest has
    # not used yet costs seconds of system time, whichever case happens to do it.
    for name in names:
        cases[name]()
    for r in range(repeat):
        order = names[:]
        random.Random(r).shuffle(order)
        for name in order:
            gc.collect()
            os.sync()
            start, cpu_start = time.perf_counter(), _cpu_seconds()
            cases[name]()
            times[name].append(time.perf_counter() - start)
            cpu_end = _cpu_seconds()
            used = (cpu_end[0] - cpu_start[0], cpu_end[1] - cpu_start[1])
            old = cpu.get(name, (float("inf"), float("inf")))
            cpu[name] = (min(old[0], used[0]), min(old[1], used[1]))
    base = times[names[0]]
    for name in names:
        paired[name] = statistics.median(t / b for t, b in zip(times[name], base, strict=True))
    return {name: min(ts) for name, ts in times.items()}


def ratio_rows(times: dict[str, float], cpu: dict[str, tuple[float, float]],
               baseline: str, paired: dict[str, float]) -> list[tuple[str, ...]]:
    base_user = max(cpu[baseline][0], 1e-3)
    return [(name, f"{t:.3f}", f"{paired[name]:.2f}x", f"{cpu[name][0]:.3f}",
             f"{cpu[name][0] / base_user:.2f}x", f"{cpu[name][1]:.3f}")
            for name, t in times.items()]


def fresh_loads(paths: dict[str, Path], repeat: int,
                paired: dict[str, float]) -> dict[str, float]:
    """Best time of one load per new interpreter, kinds interleaved (see interleaved); each
    ratio against torch.load run the same way (cold, or after a small first load)."""
    def once(kind: str) -> Callable[[], object]:
        loader, label = kind.split(":", 1)
        first = [str(paths[kind].parent / f"small-{loader}.pt")] if label.endswith(WARM) else []
        return lambda: subprocess.run(
            [sys.executable, "-c", FRESH, loader, str(paths[kind]), *first],
            check=True, capture_output=True, text=True).stdout
    outputs: dict[str, list[float]] = {kind: [] for kind in paths}
    cases = {kind: (lambda k=kind: outputs[k].append(float(once(k)().split()[-1])))  # type: ignore[misc]
             for kind in paths}
    interleaved(cases, repeat, {}, {})
    for kind, ts in outputs.items():
        base = outputs["torch:" + LOAD + (WARM if kind.endswith(WARM) else "")]
        paired[kind] = statistics.median(t / b for t, b in zip(ts, base, strict=True))
    return {kind: min(ts) for kind, ts in outputs.items()}


def save_section(save: dict[str, float], cpu: dict[str, tuple[float, float]], gib: str,
                 paired: dict[str, float]) -> str:
    ratios = ", ".join(f"{a} {paired[name]:.2f}x" for a, name in
                       (("xxh128", SAVE_XX), ("blake3", SAVE_B3), ("sha256", SAVE_SHA)))
    return (f"## Save ({gib})\n\n"
            + table(COLUMNS, ratio_rows(save, cpu, SAVE_BASE, paired))
            + f"\ntorchverity.save / (torch.save + fsync) by sidecar algorithm (median of "
            f"paired rounds): {ratios} (target <= 1.15x with blake3, the default). Against "
            f"save-then-rehash with the same hash: sha256 "
            f"{paired[SAVE_SHA] / paired[REHASH]:.2f}x, xxh128 "
            f"{paired[SAVE_XX] / paired[REHASH_XX]:.2f}x (target < 1). torchverity.save "
            "fsyncs the file and folder (plain torch.save leaves the write to the kernel's "
            "writeback), so 'torch.save + fsync' is the baseline; 'torch.save' shows the "
            "fsync's own cost.\n")


def load_section(load: dict[str, float], fresh: dict[str, float],
                 cpu: dict[str, tuple[float, float]], gib: str,
                 paired: dict[str, float]) -> str:
    body = (f"## Load ({gib})\n\n### Repeated loads in one process\n\n"
            + table(COLUMNS, ratio_rows(load, cpu, LOAD, paired)))
    body += ("\n### One load in a new process (what a job's start-up sees)\n\n"
             + table(("load", "best wall s", "ratio to torch.load run the same way "
                      "(median of rounds)"), [
                 (k.split(":", 1)[1], f"{t:.3f}", f"{paired[k]:.2f}x")
                 for k, t in fresh.items()]))
    same = ", ".join(f"{a} {paired[n]:.2f}x" for a, n in
                     (("xxh128", LOAD_XX), ("blake3", LOAD_B3), ("sha256", LOAD_SHA)))
    new = ", ".join(f"{k.split(':', 1)[1]} {paired[k]:.2f}x"
                    for k in fresh if not k.startswith("torch:"))
    return body + (
        f"\ntorchverity.load / torch.load (target <= 1.3x with blake3, the default), "
        f"repeated in one process: {same}, and {paired[LOAD_ST]:.2f}x from .safetensors; "
        f"one load in a new process: {new}. The first load in a process also imports "
        "torchverity's load path and sets up its reader; the rows after a first small "
        "load leave that out on both sides and show the large load's own cost in a fresh "
        "process. With mmap=True torch.load reads nothing until "
        "a tensor is used, so the verified mmap load (one hash pass, before anything is "
        "mapped) is compared with the default torch.load above.\n")


def preflight_section(path: Path, repeat: int, work: Path) -> str:
    """check_limits (run before every load) against torch.load, on ``path`` and on a
    checkpoint of 10,000 small tensors, whose pickle is as long as its data."""
    many = work / "many.pt"
    torch.save({f"layer.{i}.weight": torch.randn(4) for i in range(10_000)}, many)
    rows = []
    for label, file in (("this state", path), ("10,000 tensors of 4 floats", many)):
        paired: dict[str, float] = {}
        times = interleaved({
            "torch.load": lambda f=file: torch.load(f, weights_only=True),  # type: ignore[misc]
            "check_limits": lambda f=file: check_limits(f),  # type: ignore[misc]
        }, repeat, {}, paired)
        rows.append((label, f"{times['torch.load']:.3f}", f"{times['check_limits']:.4f}",
                     f"{paired['check_limits']:.3f}x"))
    many.unlink()
    return ("\n## Preflight: the bounds checked before every load\n\n"
            + table(("checkpoint", "torch.load best s", "check_limits best s",
                     "check_limits / torch.load (median of rounds)"), rows)
            + "\n`torchverity.load` runs `check_limits` before torch reads the file (zip "
            "bombs, huge headers, pickles nested or expanding past the scan's bounds). On a "
            "zip as torch writes it, that reads the central directory and walks data.pkl for "
            "the bounds alone; torch's own unpickler walks the same opcodes, slower.\n")


def run_state(state: dict[str, torch.Tensor], shape: str, area: str, command: str,
              repeat: int) -> None:
    """Every measurement on one state dict, written to docs/benchmarks/<area>.md."""
    work = WORK / "checkpoint"
    work.mkdir(parents=True, exist_ok=True)
    size = sum(t.numel() * t.element_size() for t in state.values())
    gib = f"{size // MiB} MiB"
    load_before = os.getloadavg()[0]
    cpu: dict[str, tuple[float, float]] = {}
    paired: dict[str, float] = {}
    save = interleaved(save_cases(state, work), repeat, cpu, paired)
    fp = interleaved({
        FP: lambda: torchverity.fingerprint(state),
        RAW_B3: lambda: raw_blake3(state),
        "torchverity.fingerprint(mode=\"sha256\") (records made before blake3)":
            lambda: torchverity.fingerprint(state, mode="sha256"),
        RAW_SHA: lambda: raw_bytes(state),
        NUMPY: lambda: numpy_recipe(state),
    }, repeat, cpu, paired)
    speed = hash_speeds(state, repeat)
    len_state = len(state)
    state.clear()  # loads below allocate their own copy
    gc.collect()
    load = interleaved(load_cases(work), repeat, cpu, paired)
    small = {f"w{i}": torch.randn(64, 64) for i in range(8)}
    torch.save(small, work / "small-torch.pt")
    torchverity.save(small, work / "small-tv.pt")
    fresh = fresh_loads({"torch:" + LOAD: work / "plain.pt",
                         "tv:" + LOAD_SHA: work / ALGOS["sha256"],
                         "tv:" + LOAD_XX: work / ALGOS["xxh128"],
                         "tv:" + LOAD_B3: work / ALGOS["blake3"],
                         "torch:" + LOAD + WARM: work / "plain.pt",
                         "tv:" + LOAD_B3 + WARM: work / ALGOS["blake3"]}, repeat, paired)
    preflight = preflight_section(work / ALGOS["sha256"], repeat, work)
    load_after = os.getloadavg()[0]
    body = (f"State: {shape} ({len_state} tensors), {gib} in total. Page cache warm. "
            f"Load average {load_before:.1f} before, {load_after:.1f} after "
            f"(2 cores shared with other jobs: absolute times are noisy, ratios less so).\n\n")
    body += save_section(save, cpu, gib, paired)
    body += (f"\n## Fingerprint ({gib})\n\n"
             + table(COLUMNS, ratio_rows(fp, cpu, FP, paired)))
    body += (f"\nnumpy recipe / fingerprint = {paired[NUMPY]:.2f}x (target >= 2x); "
             f"fingerprint / blake3 of the raw bytes = {1 / paired[RAW_B3]:.2f}x "
             f"(target <= 1.2x); fingerprint / sha256 of the raw bytes = "
             f"{1 / paired[RAW_SHA]:.2f}x (medians of paired rounds). The recipe also "
             "crashes on bfloat16 tensors.\n\n")
    body += load_section(load, fresh, cpu, gib, paired)
    body += preflight
    body += floors(size, speed, save, load)
    body += READING
    print(write_results(area, f"Checkpoints: save, load, fingerprint ({gib})", command, body)
          .read_text())
    print(json.dumps({"save": save, "fingerprint": fp, "load": load, "fresh": fresh}, indent=1))
    for p in work.iterdir():
        p.unlink()


def save_cases(state: dict[str, torch.Tensor], work: Path) -> dict[str, Callable[[], object]]:
    return {
        SAVE_BASE: lambda: save_fsync(state, work / "fsync.pt"),
        "torch.save": lambda: torch.save(state, work / "plain.pt"),
        SAVE_XX: lambda: torchverity.save(state, work / ALGOS["xxh128"], algo="xxh128"),
        SAVE_B3: lambda: torchverity.save(state, work / ALGOS["blake3"]),
        SAVE_SHA: lambda: torchverity.save(state, work / ALGOS["sha256"], algo="sha256"),
        SAVE_ST: lambda: torchverity.save(state, work / "tv3.safetensors"),
        REHASH: lambda: save_then_hash(state, work / "rehash.pt"),
        REHASH_XX: lambda: save_then_hash(state, work / "rehashx.pt", "xxh128"),
    }


def load_cases(work: Path) -> dict[str, Callable[[], object]]:
    plain = work / "plain.pt"
    return {
        LOAD: lambda: torch.load(plain, weights_only=True),
        LOAD_SHA: lambda: torchverity.load(work / ALGOS["sha256"]),
        LOAD_XX: lambda: torchverity.load(work / ALGOS["xxh128"]),
        LOAD_B3: lambda: torchverity.load(work / ALGOS["blake3"]),
        LOAD_RECHECK: lambda: torchverity.load(work / ALGOS["xxh128"], recheck_tensors=True),
        LOAD_ST: lambda: torchverity.load(work / "tv3.safetensors"),
        "torch.load then sha256 of the file (usual recipe)":
            lambda: (digest_file(plain, "sha256"), torch.load(plain, weights_only=True)),
        MMAP: lambda: torch.load(plain, weights_only=True, mmap=True),
        MMAP_XX: lambda: torchverity.load(work / ALGOS["xxh128"], mmap=True),
        MMAP_SHA: lambda: torchverity.load(work / ALGOS["sha256"], mmap=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="256 MiB instead of 1 GiB")
    parser.add_argument("--mib", type=int, default=None,
                        help="size of the float32 state dict (64 equal tensors); results in "
                        "checkpoint.md (default 1024, or none with --bert alone)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--bert", action="store_true",
                        help="a MiniLM-sized BertModel state_dict (~90 MB, 103 tensors); "
                        "results in checkpoint-bert.md")
    args = parser.parse_args()
    mib = args.mib if args.mib is not None else (
        None if args.bert else 256 if args.quick else 1024)
    command = ("python benchmarks/bench_checkpoint.py" + (" --bert" if args.bert else "")
               + (f" --mib {args.mib}" if args.mib is not None else "")
               + (" --quick" if args.quick else "")
               + (f" --repeat {args.repeat}" if args.repeat != 7 else ""))
    if args.bert:
        run_state(bert_state(), "a MiniLM-sized BertModel state_dict", "checkpoint-bert",
                  command, args.repeat)
    if mib is not None:
        run_state(make_state(mib * MiB), "equal float32 tensors", "checkpoint", command,
                  args.repeat)


READING = (
    "\n## Reading these numbers\n\n"
    "`torchverity.save` writes once and runs two hash passes over the data: the file "
    "digest (the sidecar's algorithm), fed from the write stream on its own thread "
    "behind the writes, and the per-tensor BLAKE3 fingerprint, from memory on a third "
    "thread; it never re-reads the file. Plain `torch.save` only writes. The user CPU "
    "column shows that work: when both cores are free the hashes overlap the write and "
    "the wall ratio falls below the CPU ratio; on a machine shared with other jobs "
    "every thread waits for a core and the wall ratio tends to the CPU ratio. "
    "torchverity.save's fsync makes the disk write happen inside its timing, where plain "
    "torch.save leaves it to the kernel's writeback afterwards.\n\n"
    "`torchverity.load` reads the file once: torch.load reads it through a file object "
    "that feeds every byte to the hash in file order (the weights_only unpickler runs no "
    "code, and nothing is returned before the digest matches). With BLAKE3 or XXH3, "
    "faster than the copy out of the page cache, each large record is read by two "
    "threads at once, a worker filling the larger tail of each 8 MiB chunk while the "
    "reading thread fills its head and hashes the chunk before: both cores copy, and the "
    "hash hides behind the worker's read. SHA-256, slower than the copy, is hashed on a "
    "second core while torch reads. The digest it "
    "checks is the one meta.json recorded beside the content fingerprint at save time, "
    "so it vouches for the fingerprint too; `recheck_tensors=True` hashes the loaded "
    "tensors again (BLAKE3), the row that shows that second pass. Full-pickle and "
    "mmap loads hash the file before torch reads it.\n\n"
    "Which sidecar: XXH3-128 (`algo=\"xxh128\"`) is a 128-bit non-cryptographic hash: "
    "it catches accidental damage (disk, copy, truncated download) as surely as SHA-256 "
    "does, at several times BLAKE3's speed, and a sidecar stored beside its file protects "
    "against nothing more, since whoever can rewrite the file can rewrite the sidecar. "
    "BLAKE3, the default, is cryptographic, so it also serves when the digest comes from "
    "a trusted channel; use SHA-256 where it must match a published SHA-256 or be checked "
    "by `sha256sum -c`, at the cost of a hash slower than torch's copy; the content "
    "fingerprint is BLAKE3 whatever the sidecar.\n")


if __name__ == "__main__":
    main()
