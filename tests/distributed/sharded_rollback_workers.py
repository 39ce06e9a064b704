"""The guard's own distributed checkpoints on FSDP2: the worker side of test_sharded_rollback.py.

Called from sharded_workers.py (scenario ``rollback``, 2 spawned processes, FSDP2 on a
``(dp=2)`` mesh): a clean run whose every checkpoint is certified; a run where a bit flips
in rank 1's weight shard between two updates and the guard rolls both ranks back; a run
where checkpoints saved while a flip is unresolved are uncertified and rollback skips them.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sharded_guard_workers import _events, _flip_local, _log


def _fsdp2(mlp: Callable[[], Any]) -> tuple[Any, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


class _Run:
    """A guarded FSDP2 loop that keeps the local digests of every checkpoint it saved."""

    def __init__(self, rank: int, out: Path, name: str, mlp: Callable[[], Any],
                 loss: Callable[..., Any], batch: Callable[[int], Any],
                 digests: Callable[[Any, Any], list[str]], **options: Any) -> None:
        import torchverity
        import torchverity.distributed as tvd

        self.rank, self.loss, self.batch, self.digests = rank, loss, batch, digests
        self.model, self.opt = _fsdp2(mlp)
        self.log = out / f"{name}.jsonl"
        self.saved: dict[str, list[str]] = {}
        self.guard = torchverity.TrainingGuard(
            self.model, self.opt, reducer=tvd.FlagReducer(), checkpoint_dir=out / name,
            check_every=1, log=self.log, **options)
        self._note()
        self.step = 0

    def _note(self) -> None:
        for path in self.guard.checkpoints:
            self.saved.setdefault(str(path), self.digests(self.model, self.opt))

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.opt.zero_grad()
            value = self.loss(self.model, self.batch(1000 + 10 * self.rank + self.step))
            value.backward()
            self.guard.check(value)
            self.guard.step()
            self.step += 1
            self._note()

    def save(self) -> str:
        path = str(self.guard.save_checkpoint())
        self.saved[path] = self.digests(self.model, self.opt)
        return path

    def record(self, event: str) -> list[dict[str, Any]]:
        mine = self.log.with_name(f"{self.log.stem}.rank{self.rank}{self.log.suffix}") \
            if self.rank else self.log
        return _log(mine, event)


def _certifications(paths: list[str]) -> list[dict[str, Any] | None]:
    import torchverity.distributed as tvd

    return [tvd.read_certification(p) for p in paths]


def clean(rank: int, out: Path, *args: Any) -> dict[str, Any]:
    """16 clean steps, a checkpoint every 4: nothing raised, every checkpoint certified."""
    from torchverity.verify import verify_path

    run = _Run(rank, out, "clean", *args, checkpoint_every=4, keep_checkpoints=10)
    run.train(16)
    summary = run.guard.close()
    paths = [str(p) for p in run.guard.checkpoints]
    return {"events": _events(run.guard), "checkpoints": [Path(p).name for p in paths],
            "certified": [c["certified"] if c else None for c in _certifications(paths)],
            "verified": [verify_path(p).ok for p in paths], "rollbacks": summary.rollbacks,
            "ranks_in_record": sorted(_certifications(paths)[-1]["ranks"]),  # type: ignore[index]
            "optimizer_state": [c["optimizer_state"] if c else None
                                for c in _certifications(paths)]}


def rollback(rank: int, out: Path, *args: Any) -> dict[str, Any]:
    """A checkpoint every 3 steps; after update 7 a bit flips in rank 1's shard of 0.weight:
    update 8 reports it, both ranks roll back to the step-6 checkpoint, and training goes on."""
    run = _Run(rank, out, "rollback", *args, checkpoint_every=3)
    run.train(7)
    if rank == 1:
        _flip_local(run.model[0].weight, index=3, bit=21)
    run.train(1)
    (event,) = run.record("rollback")
    restored = run.digests(run.model, run.opt)
    run.train(4)  # no false alarm after the rollback
    summary = run.guard.close()
    return {"events": _events(run.guard), "rollback": event,
            "equal_to_checkpoint": restored == run.saved[event["checkpoint"]],
            "rollbacks": summary.rollbacks}


def uncertified(rank: int, out: Path, *args: Any) -> dict[str, Any]:
    """Under ``record``: A certified; B saved with rank 1's shard flipped at rest (only rank 1
    sees it); C saved after the flip was reported and let stand. Rollback goes to A."""
    from torchverity.verify import verify_path

    run = _Run(rank, out, "uncertified", *args, policies={"weights_changed": "record"})
    run.train(3)
    a = run.save()
    run.train(2)
    if rank == 1:
        _flip_local(run.model[2].weight, index=5, bit=17)
    b = run.save()
    b_copy = out / "uncertified-b"
    if rank == 0:  # B is pruned later: a copy for the CLI
        shutil.copytree(b, b_copy)
    b_verify = verify_path(b)
    (b_record,) = _certifications([b])
    run.train(1)  # reported at this update, let stand: unresolved
    c = run.save()
    records = _certifications([a, c])
    kept = [str(p) for p in run.guard.checkpoints]
    restored_from = str(run.guard.rollback())
    restored = run.digests(run.model, run.opt)
    run.train(3)
    run.guard.close()
    assert b_record is not None and records[1] is not None
    return {"certified": [x["certified"] if x else None for x in [records[0], b_record,
                                                                  records[1]]],
            "b_changed": b_record["changed"],
            "b_verify_certified": b_verify.certified, "b_verify_ok": b_verify.ok,
            "c_unresolved": records[1]["unresolved"],
            "kept": [Path(p).name for p in kept], "a": Path(a).name, "b_copy": str(b_copy),
            "restored_from": Path(restored_from).name,
            "equal_to_a": restored == run.saved[a], "events": _events(run.guard)}


def refused(rank: int, mlp: Callable[[], Any], out: Path) -> str | None:
    """checkpoint_dir= on a sharded model without a reducer: refused before anything runs."""
    import torchverity
    from torchverity.errors import UsageError

    model, opt = _fsdp2(mlp)
    try:
        torchverity.TrainingGuard(model, opt, checkpoint_dir=out / "refused")
    except UsageError as exc:
        return str(exc)  # with the hint: what to pass
    return None


def scenario(rank: int, out: Path, mlp: Callable[[], Any], loss: Callable[..., Any],
             batch: Callable[[int], Any], digests: Callable[[Any, Any], list[str]]
             ) -> dict[str, Any]:
    args = (mlp, loss, batch, digests)
    record = {"refused": refused(rank, mlp, out), "clean": clean(rank, out, *args),
              "rollback": rollback(rank, out, *args),
              "uncertified": uncertified(rank, out, *args)}
    json.dumps(record)  # fails here, with the rank's traceback, if anything is not JSON
    return record
