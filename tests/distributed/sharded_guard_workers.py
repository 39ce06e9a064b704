"""TrainingGuard on sharded meshes, and the tensor-parallel forward audit: the worker side.

Called from sharded_workers.py inside its launches (no launch of their own): the
4-rank mesh runs the FSDP2 per-shard at-rest check, the HSDP 2x2 refusal and the TP
audit; the 6-rank 3x2 HSDP launch runs the guard's automatic healing and its refusal.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _flip_local(t: Any, index: int, bit: int) -> None:
    import torch

    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    with torch.no_grad():
        local.view(-1).view(torch.int32)[index] ^= 1 << bit


def _events(guard: Any) -> list[dict[str, Any]]:
    return [{"step": e.step, "kind": e.kind, "suspects": list(e.suspects), "rank": e.rank}
            for e in guard.events]


def _log(path: Path, event: str) -> list[dict[str, Any]]:
    """The ``event`` records of one rank's log, without the fields that differ by rank."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [{k: v for k, v in r.items() if k not in ("time", "rank")}
            for r in map(json.loads, lines) if r["event"] == event]


def _train(guard: Any, model: Any, opt: Any, loss: Callable[..., Any], batch: Callable[[int], Any],
           steps: int, between: Callable[[int], None] = lambda step: None) -> None:
    for step in range(steps):
        opt.zero_grad()
        value = loss(model, batch(step))
        value.backward()
        guard.check(value)
        guard.step()
        between(step)


def _in_update(opt: Any, faults: dict[int, Callable[[], None]]) -> Any:
    """A faulty update kernel: after the optimizer's N-th step, run ``faults[N]``."""
    done = [0]

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        done[0] += 1
        if done[0] in faults:
            faults[done[0]]()

    return opt.register_step_post_hook(hook)


# ------------------------------------------------------------------ 4 ranks


def fsdp_at_rest(model: Any, opt: Any, rank: int, out: Path, loss: Callable[..., Any],
                 batch: Callable[[int], Any]) -> dict[str, Any]:
    """Pure FSDP2: 8 clean guarded steps, then one rank's shard flips at rest, then another
    rank's AdamW state; each is reported at the next update by the rank that holds it."""
    import torch

    import torchverity
    import torchverity.distributed as tvd
    from torchverity.errors import UsageError

    def between(step: int) -> None:
        if step == 8 and rank == 2:
            _flip_local(model[0].weight, index=1, bit=9)
        if step == 10 and rank == 1:
            _flip_local(opt.state[model[2].weight]["exp_avg"], index=0, bit=3)

    try:  # its checkpoints are saved and rolled back by every rank together: needs a reducer
        torchverity.TrainingGuard(model, opt, checkpoint_dir=out / f"ckpt{rank}")
        refused = None
    except UsageError as exc:
        refused = str(exc)
    log = out / "fsdp_guard.jsonl"
    guard = torchverity.TrainingGuard(model, opt, reducer=tvd.FlagReducer(), check_every=1,
                                      policies={"weights_changed": "record"}, log=log)
    _train(guard, model, opt, loss, lambda s: batch(600 + 10 * rank + s), 13, between)
    opt.zero_grad()  # clipping by the norm of the whole model, not of this rank's shards
    value = loss(model, batch(690 + rank))
    value.backward()
    guard.check(value)
    total = guard.clip_grad_norm_(1e9)
    whole = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor()
    guard.step()
    guard.close()
    mine = log.with_name(f"{log.stem}.rank{rank}{log.suffix}") if rank else log
    return {"events": _events(guard), "coverage": _log(mine, "start")[0]["coverage"],
            "checkpoint_dir": refused, "clip_total": float(total),
            "clip_is_whole": torch.equal(total, whole)}


def hsdp_two_replicas(model: Any, opt: Any, rank: int, loss: Callable[..., Any],
                      batch: Callable[[int], Any]) -> dict[str, Any]:
    """HSDP 2x2: rank 3's update corrupts its shard; two replicas cannot say which is right."""
    import torchverity
    from torchverity.errors import ReplicaMismatchError

    def fault() -> None:
        if rank == 3:
            _flip_local(model[0].weight, index=0, bit=7)

    hook = _in_update(opt, {2: fault})
    out: dict[str, Any] = {"error": None}
    try:
        with torchverity.TrainingGuard(model, opt, replica_every=1) as guard:
            _train(guard, model, opt, loss, lambda s: batch(500 + rank + s), 4)
    except ReplicaMismatchError as exc:
        out = {"error": type(exc).__name__, "message": exc.message, "step": exc.step}
    hook.remove()
    return out


def tp_audit(model: Any, rank: int, loss: Callable[..., Any], batch: Any) -> dict[str, Any]:
    """Tensor parallel over 4 ranks: rank 1's norm computes wrongly; clean first."""
    import torchverity.distributed as tvd

    def record(res: Any) -> dict[str, Any]:
        return {"ok": res.ok, "odd_ranks": list(res.odd_ranks), "tensors": res.tensors,
                "checked": res.tensors_checked, "unreplicated": res.unreplicated,
                "summary": res.summary()}

    out = {"tp_clean": record(tvd.tp_forward_audit(model, loss, batch, seed=1))}
    nudge = model[3].register_forward_hook(
        lambda mod, inp, output: output * 1.001 if rank == 1 else None)
    out["tp_fault"] = record(tvd.tp_forward_audit(model, loss, batch, seed=1))
    nudge.remove()
    return out


# ------------------------------------------------------------------ 6 ranks, 3x2 HSDP


def guard_heal(rank: int, out: Path, build: Callable[[int], tuple[Any, Any]],
               loss: Callable[..., Any], batch: Callable[[int], Any],
               digests: Callable[[Any, Any], list[str]]) -> dict[str, Any]:
    """The run of scenario_heal under a guard that checks the replicas after every update:
    rank 4's update corrupts its weight shard and rank 1's its AdamW state, at update 3."""
    import torchverity
    import torchverity.distributed as tvd

    model, opt = build(rank)

    def fault() -> None:
        if rank == 4:
            _flip_local(model[0].weight, index=2, bit=11)
        if rank == 1:
            _flip_local(opt.state[model[2].weight]["exp_avg"], index=1, bit=2)

    hook = _in_update(opt, {3: fault})
    log = out / "heal_guard.jsonl"
    guard = torchverity.TrainingGuard(model, opt, reducer=tvd.FlagReducer(), replica_every=1,
                                      log=log)
    _train(guard, model, opt, loss, lambda s: batch(100 * rank + s + 1), 6)
    guard.close()
    hook.remove()
    mine = log.with_name(f"{log.stem}.rank{rank}{log.suffix}") if rank else log
    return {"guard_final": digests(model, opt), "guard_events": _events(guard),
            "guard_replicas": _log(mine, "replicas")}


def guard_unclear(rank: int, build: Callable[[int], tuple[Any, Any]],
                  loss: Callable[..., Any], batch: Callable[[int], Any]) -> dict[str, Any]:
    """Two of the three replicas of shard 0 come out of update 1 different, each its own way."""
    import torch

    import torchverity
    from torchverity.errors import ReplicaMismatchError

    model, opt = build(rank)
    held: list[Any] = []

    def fault() -> None:
        if rank in (2, 4):
            _flip_local(model[0].weight, index=0, bit=3 if rank == 2 else 5)
        held.append(model[0].weight._local_tensor.clone())

    hook = _in_update(opt, {1: fault})
    result: dict[str, Any] = {"error": None}
    try:
        with torchverity.TrainingGuard(model, opt, replica_every=1) as guard:
            _train(guard, model, opt, loss, lambda s: batch(300 + rank + s), 2)
    except ReplicaMismatchError as exc:
        result = {"error": type(exc).__name__, "message": exc.message, "step": exc.step,
                  "untouched": torch.equal(held[0], model[0].weight._local_tensor)}
    hook.remove()
    return result


def guard_rollback(rank: int, out: Path, loss: Callable[..., Any],
                   batch: Callable[[int], Any]) -> dict[str, Any]:
    """Six plain replicas (every rank trains the same batches): update 2 leaves ranks 0-2 and
    3-5 with different bytes, a 3-3 split; with checkpoint_dir= the guard rolls back."""
    import torch

    import torchverity
    import torchverity.distributed as tvd

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def fault() -> None:
        if rank >= 3:
            _flip_local(model[0].weight, index=0, bit=4)

    hook = _in_update(opt, {2: fault})
    log = out / "rollback_guard.jsonl"
    guard = torchverity.TrainingGuard(model, opt, reducer=tvd.FlagReducer(), replica_every=1,
                                      checkpoint_dir=out / "ckpt", log=log)  # rank 0 writes
    _train(guard, model, opt, loss, lambda s: batch(700 + s), 4)
    summary = guard.close()
    hook.remove()
    mine = log.with_name(f"{log.stem}.rank{rank}{log.suffix}") if rank else log
    return {"replicas": _log(mine, "replicas"), "rollbacks": summary.rollbacks,
            "agree": tvd.check_replicas(model, opt).ok}
