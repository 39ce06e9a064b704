"""The ranks behind test_trainer_sharded.py: a real Lightning ``Trainer`` with
``ModelParallelStrategy`` (FSDP2 over a ``data_parallel`` mesh of 2 CPU processes, gloo),
the guard's callback, and a ``ModelCheckpoint`` saving a distributed checkpoint folder
every 5 steps.

Run as ``torchrun --nproc-per-node 2 trainer_sharded_workers.py OUT``: the runs of
:data:`RUNS` in turn, in one process group; each rank writes ``OUT/<run>/rank<N>.json``
(the guard's events, the checkpoints its event log records, whether the run stopped).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

FLIP_STEP = 12  # after update 11, before update 12
FLIP_RANK = 1
STEPS = 30

_RECORD = {"policies": {"weights_changed": "record"}}
# name: (flip a bit?, the callback's options, a distributed checkpoint folder? else one file)
RUNS: dict[str, tuple[bool, dict[str, Any], bool]] = {
    "clean": (False, {}, True),
    "record": (True, _RECORD, True),
    "record_full": (True, _RECORD, False),
    "stop": (True, {}, True),  # the default policy
}


def _module() -> Any:
    import lightning.pytorch as pl
    import torch
    from torch.distributed.fsdp import fully_shard

    class Sharded(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)  # the same initial weights on every rank
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                           torch.nn.Linear(16, 1))

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net[0], mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Sharded()


def _drill(rank: int) -> Any:
    import lightning.pytorch as pl

    from torchverity import faults

    class Drill(pl.Callback):  # type: ignore[misc]
        def on_train_batch_start(self, trainer: Any, module: Any, *args: Any) -> None:
            if trainer.global_step == FLIP_STEP and rank == FLIP_RANK:
                # A mantissa bit: the loss hardly moves; only the at-rest check sees it.
                faults.flip_bit(module.net[0].weight.to_local(), 5, 20)

    return Drill()


def _events(guard: Any) -> list[dict[str, Any]]:
    return [{"step": e.step, "kind": e.kind, "action": e.action, "suspects": list(e.suspects)}
            for e in guard.events]


def _logged(log: Path, rank: int) -> list[dict[str, Any]]:
    mine = log.with_name(f"{log.stem}.rank{rank}{log.suffix}") if rank else log
    lines = [json.loads(line) for line in mine.read_text().splitlines()]
    return [{"step": e["step"], "path": e["path"], "certified": e["certified"]}
            for e in lines if e["event"] == "checkpoint"]


def run(name: str, out: Path, rank: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy

    from torchverity.errors import TrainingAnomalyError
    from torchverity.integrations.lightning import GuardCallback

    flip, options, distributed = RUNS[name]
    where = out / name
    guard = GuardCallback(log=where / "events.jsonl", **options)
    saver = pl.callbacks.ModelCheckpoint(dirpath=where / "ckpt", every_n_train_steps=5,
                                         save_top_k=-1)
    trainer = pl.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=2, logger=False,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                       save_distributed_checkpoint=distributed),
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=where,
        callbacks=([_drill(rank)] if flip else []) + [guard, saver])
    data = torch.utils.data.TensorDataset(torch.randn(320, 8, generator=torch.Generator()
                                                      .manual_seed(rank)), torch.randn(320, 1))
    stopped = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            trainer.fit(_module(), torch.utils.data.DataLoader(data, batch_size=8))
        except TrainingAnomalyError as exc:
            stopped = {"step": exc.step, "kind": exc.kind, "suspects": list(exc.suspects)}
    assert guard.guard is not None
    return {"events": _events(guard.guard), "checkpoints": _logged(where / "events.jsonl", rank),
            "stopped": stopped, "global_step": trainer.global_step}


def _main(out: Path, names: list[str]) -> None:
    import torch.distributed as dist

    for name in names:
        rank = int(os.environ["RANK"])
        record = run(name, out, rank)
        (out / name / f"rank{rank}.json").write_text(json.dumps(record))
        dist.barrier()
    # Torn down together: a rank whose interpreter exits with the group alive can abort
    # ("terminate called without an active exception") while the other is still in it.
    dist.destroy_process_group()


if __name__ == "__main__":
    _main(Path(sys.argv[1]), sys.argv[2:] or list(RUNS))
