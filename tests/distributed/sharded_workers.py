"""The processes behind test_sharded.py: each rank runs one scenario and writes rank<N>.json.

Run as ``python sharded_workers.py SCENARIO OUT [RANK WORLD PORT [EXTRA]]`` (spawned) or
under ``torchrun`` (``SCENARIO OUT``). torch is imported inside the workers only, so the
test module that imports the shared constants stays light.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sharded_guard_workers as guard_workers
import sharded_rollback_workers as rollback_workers

STEPS = 50

def _mlp() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)  # identical initial replicas
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.LayerNorm(8))


def _batch(seed: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def _loss(model: Any, batch: tuple[Any, Any]) -> Any:
    import torch.nn.functional as F

    x, y = batch
    return F.mse_loss(model(x), y)


def _flip(t: Any, index: int = 1, bit: int = 9) -> None:
    import torch

    local = t.to_local() if hasattr(t, "to_local") else t
    with torch.no_grad():
        local.view(-1).view(torch.int32)[index] ^= 1 << bit


def _record(res: Any) -> dict[str, Any]:
    return {"ok": res.ok, "odd_ranks": list(res.odd_ranks), "tensors": res.tensors,
            "shards": [d.shard for d in res.disagreements],
            "replicas": [list(d.replicas) for d in res.disagreements],
            "unreplicated": res.unreplicated, "kind": res.kind, "summary": res.summary()}


def _build(layout: str, rank: int) -> tuple[Any, Any, int]:
    """The model for ``layout``, its AdamW and the data-parallel index of this rank's batch."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model: Any = _mlp()
    data = rank
    if layout == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif layout == "fsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))
    elif layout == "hsdp":
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model[0], mesh=hsdp)
        fully_shard(model, mesh=hsdp)
    elif layout == "tp":
        tp = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        parallelize_module(model, tp, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        data = 0  # tensor-parallel ranks share the batch
    else:
        m2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, m2["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=m2["dp"])
        data = rank // 2
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), data


def _param(model: Any, name: str) -> Any:
    from torchverity.distributed._checks import _unwrap

    return dict(_unwrap(model).named_parameters())[name]


# (tensor, rank) of each injected fault per layout: parameter, AdamW exp_avg, gradient.
FAULTS = {
    "ddp": (("0.weight", 2), ("2.weight", 1), ("2.bias", 1)),
    "fsdp": (("0.weight", 2), ("2.weight", 1), ("2.bias", 1)),
    "hsdp": (("0.weight", 3), ("2.weight", 2), ("2.bias", 1)),
    "tp": (("2.bias", 1), ("3.weight", 3), ("2.bias", 2)),
    "fsdp_tp": (("2.bias", 3), ("3.weight", 0), ("2.bias", 1)),
}


def _clean_run(model: Any, opt: Any, data: int) -> dict[str, Any]:
    import torchverity.distributed as tvd

    grads = tvd.GradientCheck(model)
    if any(type(m).__name__.startswith("FSDP") for m in model.modules()):
        grads.fsdp_hook()  # each unit's reduced shard too, on the reduction path
    alarms: list[str] = []
    counts = {"replica_checks": 0, "grad_checks": 0}
    res = None
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        _loss(model, _batch(100 * data + step)).backward()
        g = grads.check(step=step)
        counts["grad_checks"] += 1
        opt.step()
        res = tvd.check_replicas(model, opt, step=step)
        counts["replica_checks"] += 1
        alarms += [r.summary() for r in (g, res) if not r.ok]
    assert res is not None
    return {"steps": STEPS, "alarms": alarms, "bytes": res.bytes_exchanged,
            "unreplicated": res.unreplicated, **counts}


def _faults(layout: str, model: Any, opt: Any, data: int, rank: int) -> dict[str, Any]:
    import torch

    import torchverity.distributed as tvd

    (pname, prank), (aname, arank), (gname, grank) = FAULTS[layout]
    out: dict[str, Any] = {}
    p = _param(model, pname)
    saved = p.detach().clone()
    if rank == prank:
        _flip(p)
    out["param"] = _record(tvd.check_replicas(model, opt, step=STEPS))
    with torch.no_grad():
        p.copy_(saved)
    state = opt.state[_param(model, aname)]["exp_avg"]
    saved = state.clone()
    if rank == arank:
        _flip(state, index=0, bit=3)
    out["adamw"] = _record(tvd.check_replicas(model, opt))
    with torch.no_grad():
        state.copy_(saved)
    opt.zero_grad()
    _loss(model, _batch(900 + data)).backward()
    if rank == grank:
        _flip(_param(model, gname).grad, index=0, bit=5)
    out["grad"] = _record(tvd.GradientCheck(model).check())
    opt.zero_grad()
    if layout == "hsdp":
        out["grad_link"] = _damaged_reduction(model, data, rank)
    assert tvd.check_replicas(model, opt).ok
    return out


def _damaged_reduction(model: Any, data: int, rank: int) -> dict[str, Any]:
    """Rank 3 receives a wrong reduced gradient shard from the replicate all-reduce."""
    import torch

    import torchverity.distributed as tvd

    # The root unit's flat shard holds 2.weight, 2.bias, 3.weight and 3.bias (unit 0's: 0.*).
    root = sum(p.to_local().numel() for n, p in model.named_parameters() if n[0] in "23")

    def damage(reduced: Any) -> None:
        if rank == 3 and reduced.numel() == root:  # element 0 is 2.weight's first
            reduced.view(-1)[:1].view(torch.int32)[0] ^= 1 << 6

    check = tvd.GradientCheck(model)
    check.fsdp_hook(inner=damage)  # digests each unit's shard on the reduction path
    _loss(model, _batch(950 + data)).backward()
    record = _record(check.check())
    tvd.GradientCheck(model).fsdp_hook()  # the damage goes, the digests stay
    for p in model.parameters():
        p.grad = None
    return record


def _sharded_replay(model: Any, opt: Any, rank: int, nudged: int) -> dict[str, Any]:
    import torch

    import torchverity.distributed as tvd
    from torchverity.errors import UsageError

    opt.zero_grad()
    _loss(model, _batch(700 + rank)).backward()
    before = [p.grad.to_local().clone() for p in model.parameters()]
    out = {"replay_clean": _replay_record(
        tvd.sharded_replay_audit(model, _loss, _batch(800 + rank), seed=3))}
    nudge = model[1].register_forward_hook(
        lambda mod, inp, output: output * 1.001 if rank == nudged else None)
    out["replay_fault"] = _replay_record(
        tvd.sharded_replay_audit(model, _loss, _batch(800 + rank), seed=3))
    nudge.remove()
    after = [p.grad.to_local() for p in model.parameters()]
    out["grads_restored"] = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    opt.zero_grad()
    model.set_requires_gradient_sync(False)  # inside gradient accumulation nothing is reduced
    try:
        tvd.sharded_replay_audit(model, _loss, _batch(800 + rank))
        out["no_sync"] = None
    except UsageError as exc:
        out["no_sync"] = exc.message
    model.set_requires_gradient_sync(True)
    opt.zero_grad()
    return out


def _replay_record(res: Any) -> dict[str, Any]:
    return {"ok": res.ok, "suspects": list(res.suspects), "tensors": res.tensors,
            "failed": len(res.failed), "summary": res.summary()}


def _hsdp_dcp(model: Any, opt: Any, rank: int, out: Path) -> dict[str, Any]:
    """Save the HSDP state (and its full tensors, for the resharded load), then load it back."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import torchverity.distributed as tvd

    msd, osd = get_state_dict(model, opt)
    manifest = tvd.save_dcp({"model": msd, "optim": osd, "extra": {"uneven": _uneven(4, 0)}},
                            out / "hsdp_ckpt")
    full = {k: v.full_tensor() for k, v in msd.items()}
    if rank == 0:
        torch.save(full, out / "hsdp_full.pt")
    msd, osd = get_state_dict(model, opt)
    report = tvd.load_dcp({"model": msd, "optim": osd, "extra": {"uneven": _uneven(4, 0, 0.0)}},
                          out / "hsdp_ckpt")
    return {"files": sorted(e.path for e in manifest.entries),
            "fingerprints_verified": report.fingerprints_verified,
            "full_tensors_verified": report.full_tensors_verified}


def _uneven(world: int, dim: int, fill: float | None = None) -> Any:
    """A 7x3 tensor sharded unevenly over a 1-D mesh of ``world`` ranks along ``dim``."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(21, dtype=torch.float32).reshape(7, 3) if fill is None else \
        torch.full((7, 3), fill)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("flat",))
    return distribute_tensor(full, mesh, [Shard(dim)])


def scenario_mesh(rank: int, out: Path) -> dict[str, Any]:
    record: dict[str, Any] = {"rank": rank, "node": int(os.environ["GROUP_RANK"]),
                              "group_rank": rank // 2, "local_rank": int(os.environ["LOCAL_RANK"])}
    for layout in FAULTS:
        model, opt, data = _build(layout, rank)
        rec = {"clean": _clean_run(model, opt, data), **_faults(layout, model, opt, data, rank)}
        if layout in ("fsdp", "hsdp"):
            rec.update(_sharded_replay(model, opt, rank, nudged=1 if layout == "fsdp" else 2))
        if layout == "hsdp":
            rec["dcp"] = _hsdp_dcp(model, opt, rank, out)
            rec["guard"] = guard_workers.hsdp_two_replicas(model, opt, rank, _loss, _batch)
        if layout == "fsdp":
            rec["guard"] = guard_workers.fsdp_at_rest(model, opt, rank, out, _loss, _batch)
        if layout == "tp":
            rec.update(guard_workers.tp_audit(model, rank, _loss, _batch(4242)))
        record[layout] = rec
    return record


def scenario_reshard(rank: int, out: Path, ckpt: Path) -> dict[str, Any]:
    """Load the 4-rank HSDP checkpoint into FSDP2 on 2 ranks."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import torchverity.distributed as tvd
    from torchverity.distributed._checkpoint import check_full_tensors
    from torchverity.distributed._comm import open_comm
    from torchverity.distributed._dcp_generations import data_folder
    from torchverity.errors import IntegrityError

    model = _mlp()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)
    # Saved as 2/2/2/1 rows over 4 ranks; loaded as 2/1 columns over 2.
    state = {"model": msd, "optim": osd, "extra": {"uneven": _uneven(2, 1, 0.0)}}
    report = tvd.load_dcp(state, ckpt / "hsdp_ckpt")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = torch.load(ckpt / "hsdp_full.pt", weights_only=True)
    out_rec: dict[str, Any] = {
        "fingerprints_verified": report.fingerprints_verified,
        "full_tensors_verified": report.full_tensors_verified,
        "equal_to_saved_full_tensors": all(torch.equal(p.full_tensor(), full[n])
                                           for n, p in model.named_parameters()),
        "uneven_equal": torch.equal(state["extra"]["uneven"].full_tensor(),
                                    torch.arange(21, dtype=torch.float32).reshape(7, 3)),
    }
    if rank == 1:  # memory corrupts one element of one loaded shard after the files verified
        _flip(state["model"]["2.weight"], index=0, bit=4)
    try:
        live = data_folder(ckpt / "hsdp_ckpt")  # the generation the checkpoint's pointer names
        check_full_tensors(open_comm(None, 60, "test"), live, state)
        out_rec["tampered"] = {"error": None}
    except IntegrityError as exc:
        out_rec["tampered"] = {"error": type(exc).__name__, "message": exc.message,
                               "tensors": exc.tensors}
    return out_rec


# ------------------------------------------------------------------ heal


def _hsdp32(rank: int) -> tuple[Any, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    mesh = init_device_mesh("cpu", (3, 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _local_digests(model: Any, opt: Any) -> list[str]:
    import hashlib

    import torch

    from torchverity.distributed._checks import _replica_state
    from torchverity.distributed._placements import place

    names, values = _replica_state(model, opt, buffers=True)
    out = []
    for n, v in zip(names, values, strict=True):
        local = place(v).local
        data = (local.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                if isinstance(local, torch.Tensor) else repr(local).encode())
        out.append(f"{n}:{hashlib.sha256(data).hexdigest()}")
    return out


def _heal_run(rank: int, faulty: bool) -> tuple[list[str], list[dict[str, Any]], list[str]]:
    import torchverity.distributed as tvd

    model, opt = _hsdp32(rank)
    policy = tvd.HealPolicy(model, opt, every=1)
    alarms = []
    for step in range(1, 7):
        opt.zero_grad()
        _loss(model, _batch(100 * rank + step)).backward()
        opt.step()
        if faulty and step == 3:
            if rank == 4:
                _flip(_param(model, "0.weight"), index=2, bit=11)
            if rank == 1:
                _flip(opt.state[_param(model, "2.weight")]["exp_avg"], index=1, bit=2)
        report = policy.after_step(step)
        if report is not None:
            alarms.append(report.summary())
    repairs = [{"action": r.action, "step": r.before.step, "before": r.before.summary(),
                "fixed": [x.describe().rsplit(" (", 1)[0] for x in r.repairs],
                "after_ok": r.after.ok} for r in policy.reports]
    return _local_digests(model, opt), repairs, alarms


def _unclear(rank: int) -> dict[str, Any]:
    import torch

    import torchverity.distributed as tvd
    from torchverity.errors import ReplicaMismatchError

    model, opt = _hsdp32(rank)
    p = _param(model, "0.weight")
    if rank in (2, 4):  # two of the three replicas of shard 0 differ, each its own way
        _flip(p, index=0, bit=3 if rank == 2 else 5)
    held = p.to_local().clone()
    out: dict[str, Any] = {}
    try:
        tvd.HealPolicy(model, opt, every=1).after_step(1)
        out["stop"] = None
    except ReplicaMismatchError as exc:
        out.update(stop=type(exc).__name__, message=exc.message)
    report = tvd.HealPolicy(model, opt, every=1, on_unclear="rollback").after_step(1)
    out["rollback"] = report.action if report else None
    out["untouched"] = torch.equal(held, p.to_local())
    return out


def scenario_heal(rank: int, out: Path) -> dict[str, Any]:
    clean, _, clean_alarms = _heal_run(rank, faulty=False)
    healed, repairs, _ = _heal_run(rank, faulty=True)
    return {"clean_final": clean, "healed_final": healed, "clean_alarms": clean_alarms,
            "repairs": repairs, "unclear": _unclear(rank),
            **guard_workers.guard_heal(rank, out, _hsdp32, _loss, _batch, _local_digests),
            "guard_unclear": guard_workers.guard_unclear(rank, _hsdp32, _loss, _batch),
            "guard_rollback": guard_workers.guard_rollback(rank, out, _loss, _batch)}


# ------------------------------------------------------------------ entry point


def scenario_rollback(rank: int, out: Path) -> dict[str, Any]:
    return rollback_workers.scenario(rank, out, _mlp, _loss, _batch, _local_digests)


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "mesh": scenario_mesh, "heal": scenario_heal, "reshard": scenario_reshard,
    "rollback": scenario_rollback,
}


def _main(argv: list[str]) -> None:
    import torch.distributed as dist

    scenario, out = argv[0], Path(argv[1])
    timeout = datetime.timedelta(seconds=120)
    extra = [Path(a) for a in argv[5:]]
    if len(argv) > 2:  # spawned directly: rank, world, port
        rank, world, port = int(argv[2]), int(argv[3]), int(argv[4])
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timeout)
    else:  # under torchrun
        dist.init_process_group("gloo", timeout=timeout)
        rank = dist.get_rank()
    record = SCENARIOS[scenario](rank, out, *extra)
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1:])
