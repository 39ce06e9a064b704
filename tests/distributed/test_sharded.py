"""Placement-derived checks on real FSDP2, HSDP, tensor-parallel and FSDP+TP meshes (gloo).

Three launches serve every test here:

- ``mesh``: two ``torchrun`` launchers as two "nodes" (``--nnodes 2``, c10d
  rendezvous on 127.0.0.1), two processes each. The 4 ranks train DDP, FSDP2,
  HSDP (2x2), TP and FSDP+TP for 50 clean steps with every check on every
  step, then flip bits in one rank's parameter shard, AdamW state and
  reduce-scattered gradient, perturb one rank's forward under pure FSDP, and
  save a verified DCP checkpoint of the HSDP model.
- ``heal``: 6 processes on a 3x2 HSDP mesh: a clean run and a run whose
  corrupted shard and AdamW state are healed from the majority end with the
  same weights bit for bit; an unclear vote is refused.
- ``reshard``: 2 processes load the 4-rank HSDP checkpoint into a 2-rank
  FSDP2 model, verified against the full tensors' fingerprints.
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

DEADLINE_S = 240
STEPS = 50


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _wait(procs: list[subprocess.Popen[str]], what: str) -> list[str]:
    deadline = time.monotonic() + DEADLINE_S
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            _stop(procs)
            pytest.fail(f"{what} hung for {DEADLINE_S} s")
    for p, log in zip(procs, logs, strict=True):
        if p.returncode:
            pytest.fail(f"{what}: a process exited {p.returncode}:\n{log[-4000:]}")
    return logs


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    """SIGTERM first: a torchrun launcher passes it on to its workers; then SIGKILL."""
    for q in procs:
        q.terminate()
    for q in procs:
        try:
            q.wait(timeout=10)
        except subprocess.TimeoutExpired:
            q.kill()
            q.wait()


def _records(out: Path, world: int) -> list[dict[str, Any]]:
    missing = [r for r in range(world) if not (out / f"rank{r}.json").exists()]
    if missing:
        pytest.fail(f"ranks {missing} wrote no record in {out}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _two_nodes(scenario: str, out: Path) -> list[dict[str, Any]]:
    """Two torchrun launchers on one machine, joined by a c10d rendezvous: 2 nodes x 2 ranks."""
    port = _free_port()
    def cmd(node: int) -> list[str]:
        # The first launcher hosts the rendezvous store, as the first node of a cluster would.
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"tv-{port}",
                "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", "127.0.0.1",
                "--max-restarts", "0", __file__, scenario, str(out)]

    procs = [subprocess.Popen(cmd(node), env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for node in range(2)]
    _wait(procs, f"torchrun --nnodes 2 ({scenario})")
    return _records(out, 4)


def _spawn(scenario: str, world: int, out: Path, *extra: str) -> list[dict[str, Any]]:
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, __file__, scenario, str(out), str(rank), str(world), str(port), *extra],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(world)]
    _wait(procs, f"{scenario} ({world} processes)")
    return _records(out, world)


@pytest.fixture(scope="module")
def mesh_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mesh")


@pytest.fixture(scope="module")
def mesh(mesh_dir: Path) -> list[dict[str, Any]]:
    return _two_nodes("mesh", mesh_dir)


@pytest.fixture(scope="module")
def reshard(mesh: list[dict[str, Any]], mesh_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn("reshard", 2, tmp_path_factory.mktemp("reshard"), str(mesh_dir))


@pytest.fixture(scope="module")
def heal(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn("heal", 6, tmp_path_factory.mktemp("heal"))


def _same(records: list[dict[str, Any]], *keys: str) -> Any:
    values = []
    for r in records:
        v = r
        for k in keys:
            v = v[k]
        values.append(v)
    assert all(v == values[0] for v in values), f"ranks disagree on {keys}: {values}"
    return values[0]


# ------------------------------------------------------------------ 4 ranks, 2 nodes


@pytest.mark.timeout(300)
def test_mesh_spans_two_torchrun_nodes(mesh: list[dict[str, Any]]) -> None:
    assert [r["node"] for r in mesh] == [r["group_rank"] for r in mesh]
    assert sorted({r["node"] for r in mesh}) == [0, 1]
    assert [r["local_rank"] for r in mesh] == [0, 1, 0, 1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["ddp", "fsdp", "hsdp", "tp", "fsdp_tp"])
def test_clean_run_raises_nothing(mesh: list[dict[str, Any]], layout: str) -> None:
    clean = _same(mesh, layout, "clean")
    assert clean["steps"] == STEPS and clean["alarms"] == []
    assert clean["replica_checks"] == STEPS and clean["grad_checks"] == STEPS
    assert clean["bytes"] < 4096  # digests of a few dozen tensors, never tensor data


@pytest.mark.timeout(300)
def test_ddp_flips_are_attributed_by_the_whole_world(mesh: list[dict[str, Any]]) -> None:
    param = _same(mesh, "ddp", "param")
    assert param["odd_ranks"] == [2] and param["tensors"] == ["0.weight"]
    assert param["shards"] == [""] and param["replicas"] == [[0, 1, 2, 3]]
    assert "rank 2 disagrees with the majority of 4 ranks" in param["summary"]
    assert _same(mesh, "ddp", "adamw")["tensors"] == ["optimizer.2.weight.exp_avg"]
    assert _same(mesh, "ddp", "grad")["odd_ranks"] == [1]


@pytest.mark.timeout(300)
def test_hsdp_compares_each_shard_inside_its_replicate_group(mesh: list[dict[str, Any]]) -> None:
    param = _same(mesh, "hsdp", "param")  # rank 3 = (replicate=1, shard=1)
    assert param["tensors"] == ["0.weight"] and param["shards"] == ["shard (shard=1)"]
    assert param["replicas"] == [[1, 3]] and param["odd_ranks"] == []
    assert ("rank 1 (replicate=0, shard=1), rank 3 (replicate=1, shard=1) hold different "
            "0.weight shard (shard=1)") in param["summary"]
    assert "third opinion" in param["summary"]
    adamw = _same(mesh, "hsdp", "adamw")  # rank 2 = (replicate=1, shard=0)
    assert adamw["tensors"] == ["optimizer.2.weight.exp_avg"]
    assert adamw["replicas"] == [[0, 2]] and adamw["shards"] == ["shard (shard=0)"]
    grad = _same(mesh, "hsdp", "grad")  # after reduce-scatter and the replicate all-reduce
    assert grad["tensors"] == ["2.bias.grad"] and grad["replicas"] == [[1, 3]]
    assert grad["kind"] == "gradients"
    link = _same(mesh, "hsdp", "grad_link")  # damaged on the reduction path itself
    assert link["tensors"] == ["unit (root) (2.weight, 2.bias, 3.weight (+1 more))",
                               "2.weight.grad"]
    assert link["replicas"] == [[1, 3], [1, 3]] and link["shards"] == ["shard (shard=1)"] * 2
    assert "rank 3 (replicate=1, shard=1)" in link["summary"]
    # Shards on the sharded dimension are never compared with each other.
    assert _same(mesh, "hsdp", "clean", "unreplicated") == 0


@pytest.mark.timeout(300)
def test_tensor_parallel_replicated_bias_and_norm_are_voted(mesh: list[dict[str, Any]]) -> None:
    param = _same(mesh, "tp", "param")
    assert param["odd_ranks"] == [1] and param["tensors"] == ["2.bias"]
    assert "rank 1 (tp=1) disagrees with the majority of 4 replicas of 2.bias" in param["summary"]
    adamw = _same(mesh, "tp", "adamw")
    assert adamw["odd_ranks"] == [3] and adamw["tensors"] == ["optimizer.3.weight.exp_avg"]
    grad = _same(mesh, "tp", "grad")
    assert grad["odd_ranks"] == [2] and grad["tensors"] == ["2.bias.grad"]
    # Colwise and rowwise weights are sharded on the only mesh dimension: no replica.
    assert _same(mesh, "tp", "clean", "unreplicated") > 0


@pytest.mark.timeout(300)
def test_fsdp_tp_compares_across_tp_inside_each_dp_shard(mesh: list[dict[str, Any]]) -> None:
    param = _same(mesh, "fsdp_tp", "param")  # rank 3 = (dp=1, tp=1); 2.bias Replicate on tp
    assert param["tensors"] == ["2.bias"] and param["replicas"] == [[2, 3]]
    assert param["shards"] == ["shard (dp=1)"]
    norm = _same(mesh, "fsdp_tp", "adamw")  # the norm lives on the dp sub-mesh
    assert norm["tensors"] == ["optimizer.3.weight.exp_avg"] and norm["replicas"] == [[0, 1]]
    assert "rank 0 (dp=0, tp=0)" in norm["summary"]


@pytest.mark.timeout(300)
def test_pure_fsdp_says_plainly_nothing_is_replicated(mesh: list[dict[str, Any]]) -> None:
    param = _same(mesh, "fsdp", "param")
    # Every parameter shard and its two AdamW moments: 6 x 3.
    assert param["ok"] is True and param["unreplicated"] == 18
    assert "18 tensors are held by one rank only" in param["summary"]
    assert "sharded_replay_audit" in param["summary"]


@pytest.mark.timeout(300)
def test_sharded_replay_names_the_rank_whose_forward_is_perturbed(
    mesh: list[dict[str, Any]],
) -> None:
    assert _same(mesh, "fsdp", "replay_clean")["ok"] is True
    replay = _same(mesh, "fsdp", "replay_fault")
    assert replay["suspects"] == [1] and replay["failed"] == 2
    assert "loss" in replay["tensors"] and "(root) gradient contribution" in replay["tensors"]
    assert "rank 1 (dp=1) computes results no other rank reproduces" in replay["summary"]
    assert _same(mesh, "fsdp", "grads_restored") is True
    assert "no FSDP unit reduce-scattered a gradient" in _same(mesh, "fsdp", "no_sync")
    # HSDP too: the replay runs through both FSDP units; rank 2's forward is perturbed there.
    hsdp = _same(mesh, "hsdp", "replay_fault")
    assert hsdp["suspects"] == [2] and "0 gradient contribution" in hsdp["tensors"]
    assert "rank 2 (replicate=1, shard=0) computes results" in hsdp["summary"]
    assert _same(mesh, "hsdp", "replay_clean")["ok"] is True


@pytest.mark.timeout(300)
def test_hsdp_checkpoint_is_verified_per_shard_and_whole(mesh: list[dict[str, Any]]) -> None:
    saved = _same(mesh, "hsdp", "dcp")
    assert {f"__{r}_0.distcp" for r in range(4)} <= set(saved["files"])
    assert saved["fingerprints_verified"] is True and saved["full_tensors_verified"] is True


@pytest.mark.timeout(300)
def test_resharded_load_4_to_2_ranks_is_verified_against_full_tensors(
    reshard: list[dict[str, Any]],
) -> None:
    for r in reshard:
        assert r["full_tensors_verified"] is True and r["fingerprints_verified"] is False
        assert r["equal_to_saved_full_tensors"] is True and r["uneven_equal"] is True
    tampered = _same(reshard, "tampered")
    assert tampered["error"] == "IntegrityError"
    assert "1 full tensor(s) loaded from the distributed checkpoint differ" in tampered["message"]
    assert tampered["tensors"] == ["model.2.weight"]


# ------------------------------------------------------------------ healing, 6 ranks


@pytest.mark.timeout(300)
def test_heal_from_majority_gives_the_clean_runs_weights_bit_for_bit(
    heal: list[dict[str, Any]],
) -> None:
    for r in heal:
        assert r["healed_final"] == r["clean_final"]
        assert r["clean_alarms"] == []
    repairs = _same(heal, "repairs")
    assert len(repairs) == 1 and repairs[0]["action"] == "repaired"
    assert repairs[0]["step"] == 3
    before = repairs[0]["before"]
    assert "rank 4 (replicate=2, shard=0) disagrees with the majority of 3 replicas of " \
           "0.weight shard (shard=0) (ranks 0, 2, 4)" in before
    assert "rank 1 (replicate=0, shard=1)" in before and "exp_avg" in before
    assert sorted(repairs[0]["fixed"]) == [
        "0.weight shard (shard=0): rank 0 -> rank 4",
        "optimizer.2.weight.exp_avg shard (shard=1): rank 3 -> rank 1",
    ]
    assert repairs[0]["after_ok"] is True


@pytest.mark.timeout(300)
def test_heal_refuses_without_a_clear_majority(heal: list[dict[str, Any]]) -> None:
    unclear = _same(heal, "unclear")
    assert unclear["stop"] == "ReplicaMismatchError"
    assert "no strict majority for 0.weight shard (shard=0)" in unclear["message"]
    assert "rank 2 (replicate=1, shard=0), rank 4 (replicate=2, shard=0)" in unclear["message"]
    assert "third opinion" not in unclear["message"]
    assert unclear["rollback"] == "rollback" and unclear["untouched"] is True


# ================================================================== workers


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
    record: dict[str, Any] = {"node": int(os.environ["GROUP_RANK"]),
                              "group_rank": rank // 2, "local_rank": int(os.environ["LOCAL_RANK"])}
    for layout in FAULTS:
        model, opt, data = _build(layout, rank)
        rec = {"clean": _clean_run(model, opt, data), **_faults(layout, model, opt, data, rank)}
        if layout in ("fsdp", "hsdp"):
            rec.update(_sharded_replay(model, opt, rank, nudged=1 if layout == "fsdp" else 2))
        if layout == "hsdp":
            rec["dcp"] = _hsdp_dcp(model, opt, rank, out)
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
            "repairs": repairs, "unclear": _unclear(rank)}


# ------------------------------------------------------------------ entry point


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "mesh": scenario_mesh, "heal": scenario_heal, "reshard": scenario_reshard,
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
