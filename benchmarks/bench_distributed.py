"""Cost of torchverity's distributed checks next to one training step (gloo, CPU).

Two processes train an MLP of about 1M, 10M and 100M parameters with DDP and
Adam. For each size the table gives, per call: one training step, one
``check_replicas`` (parameters and optimizer state), the same with the device
sums that GPUs use, the Megatron-LM style baseline (SHA-1 of every parameter
on the host, hex digests exchanged with ``all_gather_object``), and one
``all_reduce`` of 4 KB as the floor of any cross-rank exchange. Overhead at an
interval of 100 steps is check time / (100 x step time).

    python benchmarks/bench_distributed.py [--quick]   # --quick: 1M and 10M only
    python benchmarks/bench_distributed.py --hsdp [--quick] [--device cuda]

Writes docs/benchmarks/distributed.md, then runs four processes on a 2x2
HSDP mesh (FSDP2, ``(replicate, shard)``) with AdamW: the placement-derived
check (each shard compared inside its replicate group) next to the FSDP2
step, written to docs/benchmarks/distributed-hsdp.md. ``--hsdp`` runs only
the HSDP part (``--device cuda``: over NCCL on 4 GPUs).

    python benchmarks/bench_distributed.py --guard [--quick]

Two processes train with pure FSDP2 and AdamW, plain steps alternating with
steps under a ``TrainingGuard`` that verifies each rank's local shards at rest
(two passes: the fused check does not compile DTensors); then the guard's
certified distributed checkpoint (``save_checkpoint()``, ``rollback()``) next to
``save_dcp`` / ``load_dcp`` of the same FSDP2 state by hand; written to
docs/benchmarks/distributed-guard.md.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

SIZES = {"1M": (512, 4), "10M": (1024, 10), "100M": (4096, 6)}  # width, layers
OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "distributed.md"
OUT_HSDP = OUT.with_name("distributed-hsdp.md")
OUT_GUARD = OUT.with_name("distributed-guard.md")


def _model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def _once(fn: Callable[[], object]) -> float:
    """Seconds of one call, the ranks starting it together."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _timed(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of ``repeat`` calls, after one warm-up."""
    fn()
    return statistics.median(_once(fn) for _ in range(repeat))


def _megatron_style(model: nn.Module) -> bool:
    """Baseline: SHA-1 of each parameter's bytes on the host, all hex digests gathered."""
    mine = [hashlib.sha1(p.detach().cpu().numpy().tobytes()).hexdigest()
            for p in model.parameters()]
    everyone: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return all(d == everyone[0] for d in everyone)


def _bench_size(label: str, rank: int, repeat: int) -> dict[str, object]:
    import torchverity.distributed as tvd

    width, layers = SIZES[label]
    model = _model(width, layers)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()

    small = torch.zeros(512, dtype=torch.int64)  # 4 KB
    row = {
        "model": label,
        "params": sum(p.numel() for p in model.parameters()),
        "step_s": _timed(step, repeat),
        "check_params_s": _timed(lambda: tvd.check_replicas(ddp), repeat),
        "check_s": _timed(lambda: tvd.check_replicas(ddp, opt), repeat),
        # The device sums exist for accelerators; on a CPU they are far slower than
        # BLAKE3, so the 100M row would only add minutes of run time.
        "check_device_s": (float("nan") if label == "100M" else
                           _timed(lambda: tvd.check_replicas(ddp, opt, mode="device"), repeat)),
        "megatron_s": _timed(lambda: _megatron_style(model), repeat),
        "allreduce_4k_s": _timed(lambda: dist.all_reduce(small), repeat),
        "bytes": tvd.check_replicas(ddp, opt).bytes_exchanged,
        "tensors": tvd.check_replicas(ddp, opt).tensors_checked,
    }
    return row


def _bench_hsdp(label: str, rank: int, repeat: int, device: str = "cpu") -> dict[str, object]:
    """The placement-derived check on a 2x2 HSDP mesh next to one FSDP2 training step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import torchverity.distributed as tvd

    width, layers = SIZES[label]
    model = _model(width, layers).to(device)
    mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(rank)).to(device)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()

    small = torch.zeros(512, dtype=torch.int64, device=device)
    result = tvd.check_replicas(model, opt)
    return {
        "model": label,
        "params": sum(p.numel() for p in _model(width, layers).parameters()),
        "step_s": _timed(step, repeat),
        "check_params_s": _timed(lambda: tvd.check_replicas(model), repeat),
        "check_s": _timed(lambda: tvd.check_replicas(model, opt), repeat),
        "allreduce_4k_s": _timed(lambda: dist.all_reduce(small), repeat),
        "bytes": result.bytes_exchanged,
        "tensors": result.tensors_checked,
        "ok": result.ok,
    }


def _fsdp2(label: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The MLP of ``label`` sharded per layer over every rank, with AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    model = _model(*SIZES[label])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _bench_guard(label: str, rank: int, rounds: int) -> dict[str, object]:
    """FSDP2 steps with and without the guard, alternating, so contention hits both alike."""
    import torchverity
    import torchverity.distributed as tvd

    width, layers = SIZES[label]
    # Two copies: a step outside the guard would be, to the guard, a change at rest.
    (model, opt), (gmodel, gopt) = _fsdp2(label), _fsdp2(label)
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(rank))
    guard = torchverity.TrainingGuard(gmodel, gopt, reducer=tvd.FlagReducer())

    def plain() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    def guarded() -> None:
        gopt.zero_grad()
        loss = gmodel(x).square().mean()
        loss.backward()
        guard.check(loss)
        guard.step()

    plain()  # warm-up
    guarded()
    pairs = [(_once(plain), _once(guarded)) for _ in range(rounds)]
    summary = guard.close()
    return {"model": label, "params": sum(p.numel() for p in _model(width, layers).parameters()),
            "step_s": statistics.median(a for a, _ in pairs),
            "guarded_s": statistics.median(b for _, b in pairs),
            "ratio": statistics.median(b / a for a, b in pairs), "clean": summary.clean}


def _bench_checkpoint(label: str, rank: int, rounds: int, folder: Path) -> dict[str, object]:
    """The guard's certified DCP save and rollback against save_dcp / load_dcp by hand,
    alternating; both after one AdamW step, so the optimizer state is saved."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import torchverity
    import torchverity.distributed as tvd

    x = torch.randn(8, SIZES[label][0], generator=torch.Generator().manual_seed(rank))
    (model, opt), (gmodel, gopt) = _fsdp2(label), _fsdp2(label)
    for m, o in ((model, opt), (gmodel, gopt)):
        m(x).square().mean().backward()
        o.step()
    guard = torchverity.TrainingGuard(gmodel, gopt, reducer=tvd.FlagReducer(),
                                      checkpoint_dir=folder / f"guard-{label}")

    def save() -> None:
        msd, osd = get_state_dict(model, opt)
        tvd.save_dcp({"model": msd, "optim": osd}, folder / f"plain-{label}")

    def load() -> None:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        tvd.load_dcp(state, folder / f"plain-{label}")
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    saves = [(_once(save), _once(guard.save_checkpoint)) for _ in range(rounds)]
    loads = [(_once(load), _once(guard.rollback)) for _ in range(rounds)]
    summary = guard.close()
    return {"model": label, "save_s": statistics.median(a for a, _ in saves),
            "guard_save_s": statistics.median(b for _, b in saves),
            "save_ratio": statistics.median(b / a for a, b in saves),
            "load_s": statistics.median(a for a, _ in loads),
            "rollback_s": statistics.median(b for _, b in loads),
            "load_ratio": statistics.median(b / a for a, b in loads),
            "certified": summary.rollbacks == rounds and summary.clean}


def _worker(rank: int, world: int, port: int, sizes: list[str], result: str,
            hsdp: bool = False, device: str = "cpu", guard: bool = False) -> None:
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    if guard:
        rows = [_bench_guard(label, rank, 5 if label == "100M" else 11) for label in sizes]
        folder = Path(result).parent
        rows += [_bench_checkpoint(label, rank, 3 if label == "100M" else 7, folder)
                 for label in sizes]
    elif hsdp:
        rows = [_bench_hsdp(label, rank, 3 if label == "100M" else 5, device) for label in sizes]
    else:
        rows = [_bench_size(label, rank, 3 if label == "100M" else 5) for label in sizes]
    if rank == 0:
        Path(result).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ms(row: dict[str, object], key: str) -> str:
    value = float(row[key])  # type: ignore[arg-type]
    return "not run" if value != value else f"{value * 1e3:.1f} ms"


def _table(rows: list[dict[str, object]]) -> str:
    head = ("| model | params | step | check params | Megatron-style SHA-1 params | speed-up "
            "| check params + Adam | same, device sums | all_reduce 4 KB "
            "| overhead at 1 check / 100 steps | bytes gathered |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        step, check = float(r["step_s"]), float(r["check_s"])  # type: ignore[arg-type]
        baseline = float(r["megatron_s"]) / float(r["check_params_s"])  # type: ignore[arg-type]
        lines.append(
            f"| {r['model']} | {r['params']:,} | {_ms(r, 'step_s')} | {_ms(r, 'check_params_s')} "
            f"| {_ms(r, 'megatron_s')} | {baseline:.1f}x | {_ms(r, 'check_s')} "
            f"| {_ms(r, 'check_device_s')} | {_ms(r, 'allreduce_4k_s')} "
            f"| {100 * check / (100 * step):.2f} % | {r['bytes']:,} ({r['tensors']} tensors) |"
        )
    return head + "\n".join(lines) + "\n"


def _hsdp_table(rows: list[dict[str, object]]) -> str:
    head = ("| model | params | FSDP2 step (AdamW) | check params | check params + AdamW "
            "| all_reduce 4 KB | check per step, every call | amortised at 1 check / 100 steps "
            "| bytes gathered |\n|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        step, check = float(r["step_s"]), float(r["check_s"])  # type: ignore[arg-type]
        lines.append(
            f"| {r['model']} | {r['params']:,} | {_ms(r, 'step_s')} | {_ms(r, 'check_params_s')} "
            f"| {_ms(r, 'check_s')} | {_ms(r, 'allreduce_4k_s')} | {100 * check / step:.1f} % "
            f"| {100 * check / (100 * step):.2f} % | {r['bytes']:,} ({r['tensors']} tensors) |")
    return head + "\n".join(lines) + "\n"


def _main_hsdp(quick: bool, device: str) -> None:
    sizes = ["1M", "10M"] if quick else ["1M", "10M", "100M"]
    world = 4
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(world, _free_port(), sizes, result, True, device), nprocs=world,
                 join=True)
        rows = json.loads(Path(result).read_text())
    load = os.getloadavg()[0]
    backend = "NCCL, 4 GPUs" if device == "cuda" else "gloo, CPU"
    flags = (" --quick" if quick else "") + (" --device cuda" if device == "cuda" else "")
    text = (
        f"# Distributed checks on an HSDP mesh: cost per call ({backend})\n\n"
        f"Command: `python benchmarks/bench_distributed.py --hsdp{flags}`. "
        f"Machine: {os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}, "
        f"{world} gloo processes with 1 thread each on a 2x2 mesh (replicate, shard), FSDP2 "
        f"per layer, medians of 3-5 calls; load average {load:.1f} at the end "
        f"({_contention(load)}).\n\n" + _hsdp_table(rows) + "\n"
        "Each rank digests its local shards (BLAKE3-128 on CPU) and the ranks gather 16 bytes "
        "per tensor plus a 96-byte header with their mesh coordinates; each shard is voted "
        "inside its replicate group. `bytes gathered` depends on the number of tensors only. "
        "Amortised = `check params + AdamW` / (100 x step). With 4 processes on a 2-core "
        "machine every collective waits for descheduled peers, so both columns are slower "
        "than on one core per rank.\n"
    )
    out = OUT_HSDP.with_name("distributed-hsdp-cuda.md") if device == "cuda" else OUT_HSDP
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    sys.stdout.write(text)


def _contention(load: float) -> str:
    return "contended: other jobs were running" if load > 1.5 else "quiet"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1M and 10M parameters only")
    parser.add_argument("--hsdp", action="store_true",
                        help="only the 4-process 2x2 HSDP mesh (FSDP2) part")
    parser.add_argument("--guard", action="store_true",
                        help="only the guard's per-shard at-rest check on 2-process FSDP2")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="with --hsdp: cuda runs NCCL on 4 GPUs")
    args = parser.parse_args()
    if args.hsdp:
        _main_hsdp(args.quick, args.device)
        return
    if args.guard:
        _main_guard(args.quick)
        return
    _main_ddp(args.quick)
    _main_hsdp(args.quick, "cpu")
    _main_guard(args.quick)


def _main_guard(quick: bool) -> None:
    sizes = ["1M", "10M"] if quick else ["1M", "10M", "100M"]
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(world, _free_port(), sizes, result, False, "cpu", True),
                 nprocs=world, join=True)
        rows = json.loads(Path(result).read_text())
    load = os.getloadavg()[0]
    lines = [f"| {r['model']} | {r['params']:,} | {_ms(r, 'step_s')} | {_ms(r, 'guarded_s')} "
             f"| {float(r['ratio']):.2f}x | {'none' if r['clean'] else 'ALARM'} |"
             for r in rows if "step_s" in r]
    saves = [f"| {r['model']} | {_ms(r, 'save_s')} | {_ms(r, 'guard_save_s')} "
             f"| {float(r['save_ratio']):.2f}x | {_ms(r, 'load_s')} | {_ms(r, 'rollback_s')} "
             f"| {float(r['load_ratio']):.2f}x | {'yes' if r['certified'] else 'NO'} |"
             for r in rows if "save_s" in r]
    text = (
        "# TrainingGuard on FSDP2: each rank's shards verified at rest (gloo, CPU)\n\n"
        f"Command: `python benchmarks/bench_distributed.py --guard{' --quick' if quick else ''}`. "
        f"Machine: {os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}, "
        f"{world} gloo processes with 1 thread each, pure FSDP2 per layer, AdamW; plain and "
        "guarded steps alternate (medians of the pairs); load average "
        f"{load:.1f} at the end ({_contention(load)}).\n\n"
        "| model | params | FSDP2 step | guarded step | guarded / plain (median of pairs) "
        "| anomalies |\n|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n\n"
        "The guarded step adds the gradient norms of the local gradient shards, one "
        "`all_reduce(MAX)` of the flags (`FlagReducer`), and the at-rest verification of every "
        "local parameter and AdamW shard in two passes (a record after the update, a "
        "verification before the next one): DTensors are not compiled into the fused check.\n\n"
        "## The guard's certified checkpoints of the same FSDP2 model\n\n"
        "`guard.save_checkpoint()` against `save_dcp(get_state_dict(model, opt))` by hand, and "
        "`guard.rollback()` against `load_dcp` + `set_state_dict`, alternating (medians of the "
        "pairs), after one AdamW step.\n\n"
        "| model | save_dcp | guard save | guard / save_dcp | load_dcp | guard rollback "
        "| guard / load_dcp | every rollback certified |\n|---|---|---|---|---|---|---|---|\n"
        + "\n".join(saves) + "\n\n"
        "The guard's save adds the at-rest verification of every local shard (the "
        "certification), two small JSON exchanges (the ranks' verdicts; each rank's guard-state "
        "digest and whether its optimizer has stepped) and each rank's rule and RNG state; its "
        "rollback adds one exchange (which checkpoint) and the restore of that state.\n"
    )
    OUT_GUARD.parent.mkdir(parents=True, exist_ok=True)
    OUT_GUARD.write_text(text)
    sys.stdout.write(text)


def _main_ddp(quick: bool) -> None:
    sizes = ["1M", "10M"] if quick else ["1M", "10M", "100M"]
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(world, _free_port(), sizes, result), nprocs=world, join=True)
        rows = json.loads(Path(result).read_text())
    load = os.getloadavg()[0]
    text = (
        "# Distributed checks: cost per call (gloo, CPU)\n\n"
        f"Command: `python benchmarks/bench_distributed.py{' --quick' if quick else ''}`. "
        f"Machine: {os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}, "
        f"{world} gloo processes with 1 thread each, medians of 3-5 calls; load average "
        f"{load:.1f} at the end ({_contention(load)})."
        "\n\n" + _table(rows) + "\n"
        "`check params` digests the parameters (BLAKE3-128 of the zero-copy host bytes on CPU), "
        "`check params + Adam` adds the optimizer state (three times the bytes); `device sums` "
        "forces the position-weighted sums meant for GPUs (on a CPU they are much slower than "
        "BLAKE3, so `mode=\"auto\"` never uses them there; not run for 100M). The "
        "baseline copies each parameter to the host and hashes it with SHA-1 (what Megatron-LM "
        "does), then gathers hex strings through pickle; it covers parameters only. "
        "`bytes gathered` is the size of the gathered digests (16 bytes per tensor per rank plus "
        "a 96-byte header with the mesh coordinates), independent of the model's size. "
        "Overhead = `check params + Adam` / (100 x step).\n"
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
