"""Demo step: an HSDP mesh over two torchrun "nodes"; a corrupted shard is named and healed.

Two ``torchrun`` launchers start as two nodes (``--nnodes 2``, c10d rendezvous
on 127.0.0.1), three gloo processes each, the way a cluster job starts; this
module is the entry point of the six ranks. They train a tiny MLP with FSDP2
on a 3x2 HSDP mesh ``(replicate, shard)``. After a few steps rank 4's shard of
one weight gets a flipped bit: ``check_replicas`` reads the DTensor
placements, compares each shard only with its replicas, and the majority of
three names rank 4, its mesh coordinates and the shard. ``repair_replicas``
copies the majority's bytes into rank 4's shard, the check passes again, and
the ranks write a verified distributed checkpoint that ``torchverity verify``
checks like any folder. Then a ``TrainingGuard(replica_every=1)`` takes over:
rank 2's next update corrupts its shard of an AdamW moment, and the guard
heals it from the majority by itself, training on. Last, a guard with
``checkpoint_dir=`` saves distributed checkpoints that every rank certifies: a
bit that flips at rest in rank 4's shard is reported at the next update, and
every rank rolls back to the last certified checkpoint together.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from torchverity.demo import DemoContext, DemoFailure, small_model

TITLE = ("Distributed: a corrupted shard on an HSDP mesh is named, healed from its replicas "
         "or rolled back to a certified checkpoint")
NODES, PER_NODE = 2, 3
DEADLINE_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launcher(port: int, out: Path, node: int = 0) -> list[str]:
    # The first launcher hosts the rendezvous store, as the first node of a cluster would.
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES),
            "--nproc-per-node", str(PER_NODE), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"torchverity-demo-{port}",
            "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", "127.0.0.1",
            "--max-restarts", "0", "-m", __name__, str(out)]


def run(ctx: DemoContext) -> None:
    out = ctx.workdir / "distributed"
    out.mkdir()
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ctx.say(f"launching {NODES} torchrun nodes x {PER_NODE} gloo processes, rendezvous on "
            f"127.0.0.1:{port} (FSDP2 on a 3x2 HSDP mesh, a tiny MLP)")
    procs = [subprocess.Popen(_launcher(port, out, node), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for node in range(NODES)]
    logs = [_wait(p, procs) for p in procs]
    result_file = out / "result.json"
    if any(p.returncode for p in procs) or not result_file.exists():
        raise DemoFailure(
            "demo: the distributed step failed: "
            f"{_failures(procs, logs, result_file, what='launcher')}",
            hint=f"rerun the demo; to run the nodes by hand: {' '.join(_launcher(port, out)[2:])} "
                 "and the same with is_host=0",
        )
    result = json.loads(result_file.read_text())
    ctx.say(f"after 3 steps all replicas agree: {result['clean']}")
    ctx.say("rank 4 flips one bit of its shard of 0.weight; every rank runs check_replicas:")
    ctx.say(f"  {result['flip']}")
    ctx.expect(result["odd_ranks"] == [4] and result["tensors"] == ["0.weight"],
               "the majority of 3 replicas of that shard names rank 4 and tensor 0.weight")
    ctx.say(f"repair_replicas: {result['repair']}")
    ctx.expect(result["healed"], "after the repair every shard agrees with its replicas again")
    ctx.say("the ranks wrote a distributed checkpoint with tvd.save_dcp (+ manifest):")
    ctx.cli("verify", str(out / "dcp"))
    ctx.say("TrainingGuard(replica_every=1) trains on; rank 2's next update corrupts its "
            "shard of an AdamW moment:")
    for line in result["guard"]:
        ctx.say(f"  {line}")
    ctx.expect(len(result["guard"]) == 1 and "into rank 2 (replicate=1, shard=0)"
               in result["guard"][0] and result["guard_clean"],
               "the guard healed rank 2 from the majority by itself and training went on")
    ctx.say("TrainingGuard(checkpoint_dir=...) saves distributed checkpoints every rank "
            "certifies; a bit of rank 4's shard flips at rest between two updates:")
    ctx.say(f"  rank 4: {result['anomaly']}")
    ctx.say(f"  every rank: {result['rollback']}")
    ctx.expect(result["anomaly"].endswith("in 0.weight shard (shard=0)")
               and result["rollbacks"] == 1, "every rank rolled back to a certified checkpoint")
    ctx.cli("verify", result["checkpoint"])


def _failures(procs: list[subprocess.Popen[str]], logs: list[str], result: Path,
              what: str = "rank") -> str:
    """Each process that failed, with its exit status and the end of its output."""
    parts = [f"{what} {i} exited with status {p.returncode}:\n"
             f"{logs[i][-1500:].rstrip() or '(no output)'}"
             for i, p in enumerate(procs) if p.returncode]
    return "\n".join(parts) or f"every {what} exited cleanly but rank 0 wrote no {result}"


def _wait(proc: subprocess.Popen[str], procs: list[subprocess.Popen[str]]) -> str:
    try:
        return proc.communicate(timeout=DEADLINE_S)[0]
    except subprocess.TimeoutExpired:
        for p in procs:  # SIGTERM first: a torchrun launcher passes it on to its workers
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        raise DemoFailure(f"demo: the distributed step did not finish in {DEADLINE_S} s",
                          hint="is another process using many cores?") from None


def _worker(out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import torchverity.distributed as tvd

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (3, 2), mesh_dim_names=("replicate", "shard"))
    model = small_model()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 16, generator=gen)).square().mean().backward()
        opt.step()
    clean = tvd.check_replicas(model, opt).summary()
    if rank == 4:
        shard: Any = model[0].weight  # a DTensor: this rank's shard is its local tensor
        with torch.no_grad():
            shard.to_local().view(-1).view(torch.int32)[5] ^= 1 << 22
    flipped = tvd.check_replicas(model, opt, step=3)
    repair = tvd.repair_replicas(model, opt, flipped)
    msd, osd = get_state_dict(model, opt)
    tvd.save_dcp({"model": msd, "optim": osd}, out / "dcp")
    healed = _guarded(model, opt, rank, gen, out)
    rolled = _rolled_back(model, opt, rank, gen, out)
    if rank == 0:
        record: dict[str, Any] = {
            "clean": clean, "flip": flipped.summary(), "odd_ranks": list(flipped.odd_ranks),
            "tensors": flipped.tensors, "repair": repair.summary(), "healed": repair.after.ok,
            **healed, **rolled}
        (out / "result.json").write_text(json.dumps(record))
    # A rank that tears down while a peer is still in the last exchange can make
    # gloo abort one of them ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


def _guarded(model: Any, opt: Any, rank: int, gen: Any, out: Path) -> dict[str, Any]:
    """Three steps under a guard that checks the replicas after every update; rank 2's
    second update flips a bit of its AdamW moment (a faulty kernel, say)."""
    import torch

    import torchverity
    import torchverity.distributed as tvd

    updates: list[int] = []

    def faulty(optimizer: Any, args: Any, kwargs: Any) -> None:
        updates.append(1)
        if rank == 2 and len(updates) == 2:
            state: Any = opt.state[model[2].weight]["exp_avg"]
            with torch.no_grad():
                state.to_local().view(-1).view(torch.int32)[3] ^= 1 << 9

    opt.register_step_post_hook(faulty)
    log = out / "guard.jsonl"
    guard = torchverity.TrainingGuard(model, opt, reducer=tvd.FlagReducer(), replica_every=1,
                                      log=log)
    _train(guard, model, opt, gen, 3)
    summary = guard.close()
    events = [json.loads(line) for line in log.read_text().splitlines()]
    repaired = [e for e in events if e["event"] == "replicas" and e["action"] == "repaired"]
    lines = [f"step {e['step']}: {r['tensor']} {r['shard']} copied from rank {r['source']} "
             f"({r['source_coordinates']}) into rank {r['targets'][0]} "
             f"({r['target_coordinates'][0]})" for e in repaired for r in e["repairs"]]
    return {"guard": lines, "guard_clean": summary.clean and tvd.check_replicas(model, opt).ok}


def _train(guard: Any, model: Any, opt: Any, gen: Any, steps: int) -> None:
    import torch

    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(8, 16, generator=gen)).square().mean()
        loss.backward()
        guard.check(loss)
        guard.step()


def _rolled_back(model: Any, opt: Any, rank: int, gen: Any, out: Path) -> dict[str, Any]:
    """Four steps under a guard with certified distributed checkpoints; after the second
    update a bit flips at rest in rank 4's shard of 0.weight."""
    import torch
    import torch.distributed as dist

    import torchverity
    import torchverity.distributed as tvd

    log = out / "rollback.jsonl"
    guard = torchverity.TrainingGuard(model, opt, reducer=tvd.FlagReducer(), check_every=1,
                                      checkpoint_dir=out / "guard", checkpoint_every=1, log=log)
    _train(guard, model, opt, gen, 2)
    if rank == 4:
        with torch.no_grad():
            model[0].weight.to_local().view(-1).view(torch.int32)[1] ^= 1 << 20
    _train(guard, model, opt, gen, 2)
    summary = guard.close()
    dist.barrier()  # rank 4's log is complete
    named = [e for e in map(json.loads, log.with_name("rollback.rank4.jsonl").read_text()
                            .splitlines()) if e["event"] == "anomaly"]
    (done,) = [e for e in map(json.loads, log.read_text().splitlines())
               if e["event"] == "rollback"]
    return {"anomaly": f"step {named[0]['step']}: {named[0]['kind']} in "
                       f"{', '.join(named[0]['suspects'])}",
            "rollback": f"step {done['step']}: rolled back to {Path(done['checkpoint']).name} "
                        f"(restored step {done['restored_step']})",
            "rollbacks": summary.rollbacks, "checkpoint": done["checkpoint"]}


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
