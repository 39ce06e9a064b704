"""Distributed integrity checks on real torch.distributed (gloo, several processes).

Each scenario is one launch of N processes running this file as a script, the
way torchrun would: they build a real process group on a free 127.0.0.1 port,
train a tiny model with real DDP, inject faults on one rank and write what
every rank saw to ``rank<N>.json``. The tests then assert on those records:
each fault caught with the right rank and tensor named, clean runs silent,
every rank deciding the same, and a dead or stuck rank ending in a timeout
error instead of a hang. One launch serves several tests to save start-up time.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

LAUNCH_DEADLINE_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(scenario: str, world: int, out: Path) -> list[dict[str, Any]]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, scenario, str(rank), str(world), str(port), str(out)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(world)
    ]
    deadline = time.monotonic() + LAUNCH_DEADLINE_S
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"scenario {scenario} hung for {LAUNCH_DEADLINE_S} s")
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        if p.returncode or not (out / f"rank{rank}.json").exists():
            pytest.fail(f"rank {rank} of {scenario} exited {p.returncode}:\n{log[-3000:]}")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launch("four", 4, tmp_path_factory.mktemp("four"))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launch("pair", 2, tmp_path_factory.mktemp("pair"))


def _same_on_all(records: list[dict[str, Any]], key: str) -> Any:
    values = [r[key] for r in records]
    assert all(v == values[0] for v in values), f"ranks disagree on {key}: {values}"
    return values[0]


# ------------------------------------------------------------------ 4 ranks


@pytest.mark.timeout(300)
def test_clean_training_raises_no_alarm(four: list[dict[str, Any]]) -> None:
    clean = _same_on_all(four, "clean")
    assert clean["steps"] == 200
    assert clean["replica_checks"] == 10 and clean["grad_checks"] == 200
    assert clean["replays"] == 4 and clean["flag_reductions"] == 200
    assert clean["alarms"] == []
    assert clean["bytes_per_replica_check"] < 4096  # digests only, never tensors


@pytest.mark.timeout(300)
def test_bit_flip_in_one_parameter_names_rank_and_tensor(four: list[dict[str, Any]]) -> None:
    flip = _same_on_all(four, "param_flip")
    assert flip["odd_ranks"] == [2] and flip["tensors"] == ["fc1.weight"]
    assert flip["attributed"] is True
    assert "rank 2 disagrees with the majority of 4 ranks" in flip["summary"]
    assert "fc1.weight" in flip["summary"] and "step 200" in flip["summary"]
    assert flip["error"] == "ReplicaMismatchError" and flip["error_ranks"] == [2]
    device = _same_on_all(four, "param_flip_device_mode")
    assert device["odd_ranks"] == [2] and device["tensors"] == ["fc1.weight"]
    after = _same_on_all(four, "after_repair")
    assert after["ok"] is True


@pytest.mark.timeout(300)
def test_optimizer_state_corruption_is_named(four: list[dict[str, Any]]) -> None:
    opt = _same_on_all(four, "optimizer_flip")
    assert opt["odd_ranks"] == [1] and opt["tensors"] == ["optimizer.fc2.weight.exp_avg"]


@pytest.mark.timeout(300)
def test_corrupted_reduced_gradient_names_rank_bucket_and_parameter(
    four: list[dict[str, Any]],
) -> None:
    hook = _same_on_all(four, "grad_hook_corruption")
    assert hook["odd_ranks"] == [1]
    assert any(t.startswith("bucket ") for t in hook["tensors"])
    assert hook["tensors"][1:] == ["fc2.bias.grad"]  # element 0 of bucket 0
    direct = _same_on_all(four, "grad_direct_corruption")
    assert direct["odd_ranks"] == [3] and direct["tensors"] == ["fc1.bias.grad"]


@pytest.mark.timeout(300)
def test_wrong_computation_on_one_rank_is_caught_by_replay(four: list[dict[str, Any]]) -> None:
    # All-reduce spreads rank 1's wrong gradients to everybody: replicas stay
    # equal, which is exactly why the replay audit exists.
    assert _same_on_all(four, "replicas_after_wrong_step")["ok"] is True
    replay = _same_on_all(four, "replay_fault")
    assert replay["suspects"] == [1] and "loss" in replay["tensors"]
    assert "fc1.weight.grad" in replay["tensors"]
    assert "rank 1 computes results no other rank reproduces" in replay["summary"]
    assert replay["error"] == "ReplicaMismatchError"


@pytest.mark.timeout(300)
def test_all_ranks_take_the_same_action_on_one_ranks_flag(four: list[dict[str, Any]]) -> None:
    flags = _same_on_all(four, "flags")
    assert flags["float"] == [0.0, 1.0, 0.0]
    assert flags["bool"] == [False, True]
    assert flags["actions"] == ["skip"]


@pytest.mark.timeout(300)
def test_subgroup_of_replicas_and_layout_mismatch(four: list[dict[str, Any]]) -> None:
    members = [r["subgroup"] for r in four[:3]]
    assert all(m == members[0] for m in members)
    assert members[0]["odd_ranks"] == [1] and members[0]["ranks"] == [0, 1, 2]
    assert "subgroup" not in four[3]
    layout = _same_on_all(four, "layout")
    assert layout["error"] == "ReplicaMismatchError" and layout["ranks"] == [3]
    assert "do not hold the same set of parameters" in layout["message"]


@pytest.mark.timeout(300)
def test_training_guard_with_flag_reducer_acts_on_every_rank(four: list[dict[str, Any]]) -> None:
    for rank, record in enumerate(four):
        events = record["guard"]["events"]
        assert [(e["step"], e["kind"], e["action"]) for e in events] == [
            (3, "nonfinite_loss", "skipped")
        ]
        assert events[0]["rank"] == rank
    assert all(r["guard"]["replicas"]["ok"] is True for r in four)
    # Without the reducer only rank 2 skips, and the replicas drift apart: caught and named.
    assert [len(r["guard_without_reducer"]["events"]) for r in four] == [0, 0, 1, 0]
    drift = [r["guard_without_reducer"]["replicas"] for r in four]
    assert all(d == drift[0] for d in drift)
    assert drift[0]["odd_ranks"] == [2] and "fc1.weight" in drift[0]["tensors"]


# ------------------------------------------------------------------ 2 ranks


@pytest.mark.timeout(300)
def test_two_replicas_name_tensors_but_ask_for_a_third_opinion(pair: list[dict[str, Any]]) -> None:
    flip = _same_on_all(pair, "param_flip")
    assert flip["tensors"] == ["fc2.bias"] and flip["odd_ranks"] == []
    assert flip["attributed"] is False
    assert "ranks 0 and 1 disagree" in flip["summary"]
    assert "the faulty one cannot be named without a third opinion" in flip["summary"]
    replay = _same_on_all(pair, "replay_fault")
    assert replay["suspects"] == [] and replay["failed"] == 2
    assert "cannot be named" in replay["summary"]


@pytest.mark.timeout(300)
def test_rank0_verified_save_and_refusal_to_save_diverged_replicas(
    pair: list[dict[str, Any]],
) -> None:
    saved = [r["save_rank0"] for r in pair]
    assert saved[0]["written"] is True and saved[1]["written"] is False
    assert saved[0]["verified"] is True and saved[1]["file_seen_after_return"] is True
    refused = _same_on_all(pair, "save_refused")
    assert refused["error"] == "ReplicaMismatchError" and refused["file_exists"] is False


@pytest.mark.timeout(300)
def test_distributed_checkpoint_manifest_verify_and_load(pair: list[dict[str, Any]]) -> None:
    dcp = _same_on_all(pair, "dcp")
    assert dcp["verify_rc"] == 0 and dcp["loaded_equal"] is True
    assert dcp["fingerprints_verified"] is True
    assert {".metadata", "torchverity.shards.json"} <= set(dcp["manifest_files"])
    assert any(f.startswith("__1_") for f in dcp["manifest_files"])


@pytest.mark.timeout(300)
def test_corrupted_shard_or_metadata_is_refused_before_unpickling(
    pair: list[dict[str, Any]],
) -> None:
    shard = _same_on_all(pair, "dcp_shard_flip")
    assert shard["error"] == "IntegrityError" and shard["verify_rc"] == 1
    assert "__1_0.distcp mismatched (checked by rank 1)" in shard["message"]
    assert shard["untouched"] is True  # nothing was loaded into the state
    evil = _same_on_all(pair, "dcp_evil_metadata")
    assert evil["error"] == "IntegrityError" and ".metadata mismatched" in evil["message"]
    assert evil["sentinel_exists"] is False
    link = _same_on_all(pair, "dcp_symlink")
    assert link["error"] == "IntegrityError"
    assert "__1_0.distcp symlink (checked by rank 1)" in link["message"]


# ------------------------------------------------------------------ dead ranks


@pytest.mark.timeout(300)
def test_dead_rank_ends_the_check_with_a_timeout_error(four: list[dict[str, Any]]) -> None:
    for r in (record["lost_rank"] for record in four[:3]):
        assert r["error"] == "DistributedTimeoutError"
        assert r["seconds"] < 20
        assert r["missing_ranks"] == [3]
        assert "rank(s) 3 never reached this check" in r["message"]
        assert "a peer dropped out" in r["message"]


@pytest.mark.timeout(300)
def test_stuck_rank_ends_the_check_with_a_timeout_error(pair: list[dict[str, Any]]) -> None:
    r = pair[0]["lost_rank"]
    assert r["error"] == "DistributedTimeoutError" and 2.5 < r["seconds"] < 15
    assert r["missing_ranks"] == [1] and "within 3 s" in r["message"]


def test_needs_an_initialised_process_group() -> None:
    import torch

    from torchverity.distributed import FlagReducer, check_replicas
    from torchverity.errors import UsageError

    with pytest.raises(UsageError, match=r"needs torch\.distributed, which is not initialised"):
        check_replicas(torch.nn.Linear(2, 2))
    flags = torch.tensor([0.0, 1.0])
    assert FlagReducer().reduce(flags) is flags


def test_vote_without_a_strict_majority_names_tensors_but_no_rank() -> None:
    import torch

    from torchverity.distributed._checks import ReplicaCheckResult, _vote

    same, other = [1, 2], [1, 3]
    gathered = torch.tensor([[[5, 5], same], [[5, 5], same], [[5, 5], other], [[5, 5], other]])
    disagreements = _vote((0, 1, 2, 3), ["a", "b"], gathered)
    assert [d.name for d in disagreements] == ["b"]
    assert disagreements[0].groups == ((0, 1), (2, 3)) and disagreements[0].odd_ranks == ()
    result = ReplicaCheckResult("parameters", 0, (0, 1, 2, 3), 2, 0, disagreements)
    assert not result.ok and not result.attributed and result.odd_ranks == ()
    assert "disagree across 4 ranks with no majority: 1 of 2 tensors differ: b" in result.summary()


def test_one_failed_replay_comparison_is_reported_as_transient() -> None:
    from torchverity.distributed._checks import (
        ReplayAuditResult,
        ReplayComparison,
        _replay_suspects,
    )

    comparisons = (ReplayComparison(0, 2, ()), ReplayComparison(1, 0, ("loss",)),
                   ReplayComparison(2, 1, ()))
    assert _replay_suspects((0, 1, 2), comparisons) == ()
    result = ReplayAuditResult(0, (0, 1, 2), comparisons, (), 0, step=9)
    assert not result.ok and result.tensors == ["loss"]
    assert "no rank fails all its comparisons, a transient fault is likely" in result.summary()


# ================================================================== workers
# Everything below runs inside the launched processes.


def _net() -> Any:
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(8, 16)
            self.norm = nn.LayerNorm(16)
            self.drop = nn.Dropout(0.1)
            self.fc2 = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(self.drop(torch.relu(self.norm(self.fc1(x)))))

    torch.manual_seed(0)  # identical initial replicas
    return Net()


def _batch(rank: int, step: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def _loss(module: Any, batch: tuple[Any, Any]) -> Any:
    import torch.nn.functional as F

    x, y = batch
    return F.mse_loss(module(x), y)


def _flip_bit(t: Any, index: int = 3, bit: int = 7) -> None:
    import torch

    with torch.no_grad():
        t.view(-1).view(torch.int32)[index] ^= 1 << bit


def _result(res: Any) -> dict[str, Any]:
    return {"ok": res.ok, "odd_ranks": list(res.odd_ranks), "tensors": res.tensors,
            "attributed": res.attributed, "summary": res.summary()}


def _replay_record(res: Any) -> dict[str, Any]:
    rec = {"ok": res.ok, "suspects": list(res.suspects), "tensors": res.tensors,
           "failed": len(res.failed), "summary": res.summary()}
    try:
        res.raise_if_failed()
    except Exception as exc:
        rec["error"] = type(exc).__name__
    return rec


def _ddp(world: int) -> tuple[Any, Any, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _net()
    ddp = DDP(model, bucket_cap_mb=0.001)  # tiny buckets: several per model
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    return model, ddp, opt


def _train_step(ddp: Any, opt: Any, batch: Any, after_backward: Callable[[], object]) -> Any:
    opt.zero_grad()
    loss = _loss(ddp, batch)
    loss.backward()
    after_backward()
    opt.step()
    return loss


def scenario_four(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import torchverity.distributed as tvd
    from torchverity.errors import ReplicaMismatchError

    model, ddp, opt = _ddp(world)
    check = tvd.GradientCheck(ddp)
    corrupt_reduced = {"on": False}

    def faulty_link(state: Any, bucket: Any) -> Any:
        def damage(fut: Any) -> Any:
            reduced = fut.value()
            if corrupt_reduced["on"] and rank == 1:
                _flip_bit(reduced, index=0, bit=20)
            return reduced

        return allreduce_hook(state, bucket).then(damage)

    ddp.register_comm_hook(None, check.comm_hook(faulty_link))
    reducer = tvd.FlagReducer()
    out: dict[str, Any] = {}
    alarms: list[str] = []
    counts = {"replica_checks": 0, "grad_checks": 0, "replays": 0, "flag_reductions": 0}
    bytes_per_check = 0

    def grad_check() -> None:
        counts["grad_checks"] += 1
        res = check.check(step=step)
        if not res.ok:
            alarms.append(res.summary())

    for step in range(1, 201):
        batch = _batch(rank, step)
        loss = _train_step(ddp, opt, batch, grad_check)
        flags = reducer.reduce(torch.stack([(~torch.isfinite(loss)).float(), loss * 0]))
        counts["flag_reductions"] += 1
        if flags.any():
            alarms.append(f"flag at step {step}")
        if step % 20 == 0:
            res = tvd.check_replicas(ddp, opt, step=step)
            counts["replica_checks"] += 1
            bytes_per_check = res.bytes_exchanged
            if not res.ok:
                alarms.append(res.summary())
        if step % 50 == 0:
            counts["replays"] += 1
            audit = tvd.replay_audit(ddp, _loss, batch, step=step, seed=step)
            if not audit.ok:
                alarms.append(audit.summary())
    out["clean"] = {"steps": step, "alarms": alarms, "bytes_per_replica_check": bytes_per_check,
                    **counts}

    # (a) one bit of one parameter flips on rank 2 after the optimizer step.
    saved = model.fc1.weight.detach().clone()
    if rank == 2:
        _flip_bit(model.fc1.weight)
    res = tvd.check_replicas(ddp, opt, step=step)
    out["param_flip"] = _result(res)
    try:
        res.raise_if_failed()
    except ReplicaMismatchError as exc:
        out["param_flip"].update(error=type(exc).__name__, error_ranks=exc.ranks)
    out["param_flip_device_mode"] = _result(tvd.check_replicas(ddp, opt, mode="device"))
    with torch.no_grad():
        model.fc1.weight.copy_(saved)
    out["after_repair"] = _result(tvd.check_replicas(ddp, opt))

    state = opt.state[model.fc2.weight]["exp_avg"]
    saved = state.clone()
    if rank == 1:
        _flip_bit(state, index=5, bit=1)
    out["optimizer_flip"] = _result(tvd.check_replicas(ddp, opt))
    state.copy_(saved)

    # (b) a corrupted reduced gradient: on the link (comm hook) and in .grad.
    corrupt_reduced["on"] = True
    opt.zero_grad()
    _loss(ddp, _batch(rank, 999)).backward()
    corrupt_reduced["on"] = False
    out["grad_hook_corruption"] = _result(check.check())
    opt.zero_grad()
    _loss(ddp, _batch(rank, 998)).backward()
    if rank == 3:
        _flip_bit(model.fc1.bias.grad, index=2, bit=0)
    out["grad_direct_corruption"] = _result(check.check())
    opt.zero_grad()

    # (c) a wrong computation on rank 1 only: a forward hook nudges an activation.
    nudge = model.norm.register_forward_hook(
        lambda mod, inp, output: output + 1e-3 if rank == 1 else None
    )
    _train_step(ddp, opt, _batch(rank, 997), check.check)
    out["replicas_after_wrong_step"] = _result(tvd.check_replicas(ddp, opt))
    out["replay_fault"] = _replay_record(
        tvd.replay_audit(ddp, _loss, _batch(rank, 996), seed=7)
    )
    nudge.remove()

    # One rank's anomaly flag reaches every rank, so all take the same action.
    raised = 1.0 if rank == 2 else 0.0
    f = reducer.reduce(torch.tensor([0.0, raised, 0.0]))
    b = reducer.reduce(torch.tensor([False, rank == 3]))
    actions = ["skip"] if bool(f.any()) else []
    out["flags"] = {"float": f.tolist(), "bool": b.tolist(), "actions": actions}

    # A replica group smaller than the world (HSDP replicates each shard this way).
    sub = dist.new_group([0, 1, 2])
    if rank < 3:
        saved = model.fc2.bias.detach().clone()
        if rank == 1:
            _flip_bit(model.fc2.bias, index=0)
        res = tvd.check_replicas(model, group=sub)
        out["subgroup"] = {**_result(res), "ranks": list(res.ranks)}
        with torch.no_grad():
            model.fc2.bias.copy_(saved)

    out["guard"] = _guard_run(rank, model, ddp, opt, tvd.FlagReducer())
    out["guard_without_reducer"] = _guard_run(rank, model, ddp, opt, None)

    odd = torch.nn.Linear(3, 4 if rank == 3 else 3)
    try:
        tvd.check_replicas(odd)
        out["layout"] = {"error": None}
    except ReplicaMismatchError as exc:
        out["layout"] = {"error": type(exc).__name__, "ranks": exc.ranks, "message": exc.message}
    return out


def _guard_run(rank: int, model: Any, ddp: Any, opt: Any, reducer: Any) -> dict[str, Any]:
    """A real TrainingGuard; at guard step 3 only rank 2 reports a NaN loss."""
    import torch

    import torchverity.distributed as tvd
    from torchverity.training import TrainingGuard

    guard = TrainingGuard(model, opt, reducer=reducer, check_every=1)
    for i in range(6):
        opt.zero_grad()
        loss = _loss(ddp, _batch(rank, 500 + i))
        loss.backward()
        reported = loss * torch.nan if (i == 3 and rank == 2) else loss
        guard.check(reported)
        guard.step()
    guard.close()
    events = [{"step": e.step, "kind": e.kind, "action": e.action, "rank": e.rank}
              for e in guard.events]
    return {"events": events, "replicas": _result(tvd.check_replicas(ddp, opt))}


def scenario_pair(rank: int, world: int, work: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import torchverity.distributed as tvd
    from torchverity.cli import main as cli

    model, ddp, opt = _ddp(world)
    for step in range(1, 4):
        _train_step(ddp, opt, _batch(rank, step), lambda: None)
    out: dict[str, Any] = {}
    saved = model.fc2.bias.detach().clone()
    if rank == 1:
        _flip_bit(model.fc2.bias, index=1)
    out["param_flip"] = _result(tvd.check_replicas(ddp, opt))

    path = work / "diverged.pt"
    try:
        tvd.save_rank0(model.state_dict(), path, check=ddp, optimizer=opt)
        out["save_refused"] = {"error": None}
    except Exception as exc:
        out["save_refused"] = {"error": type(exc).__name__, "file_exists": path.exists()}
    with torch.no_grad():
        model.fc2.bias.copy_(saved)

    nudge = model.norm.register_forward_hook(
        lambda mod, inp, output: output * 1.001 if rank == 1 else None
    )
    out["replay_fault"] = _replay_record(tvd.replay_audit(ddp, _loss, _batch(rank, 9)))
    nudge.remove()

    path = work / "model.pt"
    report = tvd.save_rank0(model.state_dict(), path, check=ddp, optimizer=opt)
    out["save_rank0"] = {"written": report.written, "file_seen_after_return": path.exists()}
    if rank == 0:
        from torchverity.verify import verify_file

        out["save_rank0"]["verified"] = verify_file(path).ok
    out["dcp"] = _dcp_roundtrip(rank, model, opt, work)
    out["dcp_shard_flip"] = _dcp_shard_flip(rank, model, work, cli)
    out["dcp_evil_metadata"] = _dcp_evil_metadata(rank, model, work)
    out["dcp_symlink"] = _dcp_symlink(rank, model, work)
    dist.barrier()
    return out


def _state(model: Any) -> dict[str, Any]:
    return {"model": model.state_dict()}


def _live(folder: Path) -> Path:
    """The generation folder holding a distributed checkpoint's files now."""
    from torchverity._generation_pointer import live_generation

    return live_generation(folder)


def _zeros_like_state(model: Any) -> dict[str, Any]:
    import torch

    return {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}


def _dcp_roundtrip(rank: int, model: Any, opt: Any, work: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import torchverity.distributed as tvd
    from torchverity.cli import main as cli

    folder = work / "dcp"
    manifest = tvd.save_dcp(_state(model), folder)
    dist.barrier()
    rc = cli(["verify", str(folder)]) if rank == 0 else 0
    target = _zeros_like_state(model)
    report = tvd.load_dcp(target, folder)
    equal = all(torch.equal(v, target["model"][k]) for k, v in model.state_dict().items())
    rcs = [0, 0]
    dist.all_gather_object(rcs, rc)
    return {"verify_rc": max(rcs), "loaded_equal": equal,
            "fingerprints_verified": report.fingerprints_verified,
            "manifest_files": sorted(e.path for e in manifest.entries)}


def _dcp_shard_flip(rank: int, model: Any, work: Path, cli: Callable[..., int]) -> dict[str, Any]:
    import torch.distributed as dist

    import torchverity.distributed as tvd

    folder = work / "dcp_flip"
    tvd.save_dcp(_state(model), folder)
    dist.barrier()
    if rank == 0:
        shard = _live(folder) / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
    dist.barrier()
    rc = cli(["verify", str(folder)]) if rank == 0 else 1
    target = _zeros_like_state(model)
    rec: dict[str, Any] = {"verify_rc": rc}
    try:
        tvd.load_dcp(target, folder)
        rec["error"] = None
    except Exception as exc:
        rec.update(error=type(exc).__name__, message=getattr(exc, "message", str(exc)))
    rec["untouched"] = all(not v.any() for v in target["model"].values())
    return rec


def _dcp_symlink(rank: int, model: Any, work: Path) -> dict[str, Any]:
    """A shard swapped for a link to an identical file elsewhere is still refused."""
    import shutil

    import torch.distributed as dist

    import torchverity.distributed as tvd

    folder = work / "dcp_link"
    tvd.save_dcp(_state(model), folder)
    dist.barrier()
    if rank == 0:
        outside = work / "outside.distcp"
        shard = _live(folder) / "__1_0.distcp"
        shutil.copy(shard, outside)
        shard.unlink()
        shard.symlink_to(outside)
    dist.barrier()
    try:
        tvd.load_dcp(_zeros_like_state(model), folder)
        return {"error": None}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": getattr(exc, "message", str(exc))}


class _Evil:
    def __init__(self, sentinel: str) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.sentinel, "w"))


def _dcp_evil_metadata(rank: int, model: Any, work: Path) -> dict[str, Any]:
    import pickle

    import torch.distributed as dist

    import torchverity.distributed as tvd

    folder = work / "dcp_evil"
    sentinel = work / "SENTINEL"
    tvd.save_dcp(_state(model), folder)
    dist.barrier()
    if rank == 0:
        (_live(folder) / ".metadata").write_bytes(pickle.dumps(_Evil(str(sentinel))))
    dist.barrier()
    rec: dict[str, Any] = {}
    try:
        tvd.load_dcp(_zeros_like_state(model), folder)
        rec["error"] = None
    except Exception as exc:
        rec.update(error=type(exc).__name__, message=getattr(exc, "message", str(exc)))
    dist.barrier()
    rec["sentinel_exists"] = sentinel.exists()
    return rec


def _check_without_lost_rank(timeout: float) -> dict[str, Any]:
    import torchverity.distributed as tvd

    start = time.monotonic()
    try:
        tvd.check_replicas(_net(), timeout=timeout)
        return {"error": None}
    except Exception as exc:
        return {"error": type(exc).__name__, "seconds": time.monotonic() - start,
                "missing_ranks": getattr(exc, "missing_ranks", None),
                "message": getattr(exc, "message", str(exc))}


def _worker(scenario: str, rank: int, world: int, port: int, out: Path) -> None:
    """Run the scenario, then lose the last rank: it dies ("four") or hangs ("pair")."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    record = scenario_four(rank, world) if scenario == "four" else scenario_pair(rank, world, out)
    record_file = out / f"rank{rank}.json"
    if rank == world - 1:
        record_file.write_text(json.dumps(record))
        if scenario == "pair":
            time.sleep(5)  # stuck in a long host-side stall, never reaching the check
        os._exit(0)  # gone without a word; never tears the group down
    record["lost_rank"] = _check_without_lost_rank(timeout=5 if scenario == "four" else 3)
    record_file.write_text(json.dumps(record))
    # Rank 0 hosts the rendezvous store the others still query to name the lost rank.
    time.sleep(2 if rank == 0 else 0)
    os._exit(0)  # the group is broken; tearing it down would wait for the lost rank


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))


def test_demo_step_names_each_failed_rank_with_its_status_and_output(tmp_path: Path) -> None:
    from torchverity.demo._s50_distributed import _failures

    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for code in ("pass", "print('Address already in use'); raise SystemExit(3)",
                          "raise SystemExit(4)")]
    logs = [p.communicate()[0] for p in procs]
    text = _failures(procs, logs, tmp_path / "result.json")
    assert text == ("rank 1 exited with status 3:\nAddress already in use\n"
                    "rank 2 exited with status 4:\n(no output)")
    clean = [procs[0]]
    assert _failures(clean, logs[:1], tmp_path / "result.json") == (
        f"every rank exited cleanly but rank 0 wrote no {tmp_path / 'result.json'}")
