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
- ``rollback``: 2 processes, FSDP2: the guard's own distributed checkpoints,
  certified by both ranks, and rollback to the last certified one.
"""

from __future__ import annotations

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
from sharded_workers import STEPS

DEADLINE_S = 240
WORKERS = str(Path(__file__).with_name("sharded_workers.py"))


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
                "--max-restarts", "0", WORKERS, scenario, str(out)]

    procs = [subprocess.Popen(cmd(node), env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for node in range(2)]
    _wait(procs, f"torchrun --nnodes 2 ({scenario})")
    return _records(out, 4)


def _spawn(scenario: str, world: int, out: Path, *extra: str) -> list[dict[str, Any]]:
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, WORKERS, scenario, str(out), str(rank), str(world), str(port), *extra],
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
def rollback(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn("rollback", 2, tmp_path_factory.mktemp("rollback"))


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


# ------------------------------------------------------------------ the guard on sharded meshes


@pytest.mark.timeout(300)
def test_guard_heals_a_corrupted_update_and_matches_the_clean_run(
    heal: list[dict[str, Any]],
) -> None:
    for r in heal:  # the unguarded clean run, bit for bit
        assert r["guard_final"] == r["clean_final"]
        assert r["guard_events"] == []  # the healed bytes are the next window's record
    (healed,) = _same(heal, "guard_replicas")
    assert healed["action"] == "repaired" and healed["step"] == 2
    assert healed["ranks"] == [1, 4]
    assert sorted((r["tensor"], r["shard"], r["targets"], r["target_coordinates"])
                  for r in healed["repairs"]) == [
        ("0.weight", "shard (shard=0)", [4], ["replicate=2, shard=0"]),
        ("optimizer.2.weight.exp_avg", "shard (shard=1)", [1], ["replicate=0, shard=1"]),
    ]
    assert {r["source"] for r in healed["repairs"]} == {0, 3}


@pytest.mark.timeout(300)
def test_guard_refuses_to_heal_without_a_clear_majority(
    heal: list[dict[str, Any]], mesh: list[dict[str, Any]],
) -> None:
    unclear = _same(heal, "guard_unclear")  # 3 replicas, all different
    assert unclear["error"] == "ReplicaMismatchError" and unclear["step"] == 0
    assert "no strict majority for 0.weight shard (shard=0)" in unclear["message"]
    assert unclear["untouched"] is True
    pair = _same(mesh, "hsdp", "guard")  # HSDP 2x2: two replicas, no third opinion
    assert pair["error"] == "ReplicaMismatchError" and pair["step"] == 1
    assert "0.weight shard (shard=1) has only 2 replicas" in pair["message"]
    assert "rank 1 (replicate=0, shard=1), rank 3 (replicate=1, shard=1)" in pair["message"]
    rollback = _same(heal, "guard_rollback")  # plain replicas split 3-3, checkpoint_dir given
    (event,) = rollback["replicas"]
    assert event["action"] == "rolled_back" and event["step"] == 1 and event["ranks"] == []
    assert "no strict majority for 0.weight" in event["reason"]
    assert rollback["rollbacks"] == 1 and rollback["agree"] is True


@pytest.mark.timeout(300)
def test_guard_verifies_each_ranks_fsdp_shards_at_rest(mesh: list[dict[str, Any]]) -> None:
    for r in mesh:
        guard = r["fsdp"]["guard"]
        assert guard["coverage"]["verification"] == "two passes"
        assert "FlagReducer()" in guard["checkpoint_dir"]  # without one, ranks would part
        assert guard["clip_is_whole"] is True
        assert "local shards" in guard["coverage"]["fallback_reason"]
        # The flag is combined across ranks; the rank holding the shard names it.
        assert [e["step"] for e in guard["events"]] == [9, 11]
        assert all(e["kind"] == "weights_changed" and e["rank"] == r["rank"]
                   for e in guard["events"])
        mine = {e["step"]: e["suspects"] for e in guard["events"] if e["suspects"]}
        expected = {2: {9: ["0.weight shard (dp=2)"]},
                    1: {11: ["optimizer.2.weight.exp_avg shard (dp=1)"]}}
        assert mine == expected.get(r["rank"], {})
    assert len({r["fsdp"]["guard"]["clip_total"] for r in mesh}) == 1  # the same on every rank


@pytest.mark.timeout(300)
def test_tp_forward_audit_names_the_rank_whose_forward_is_wrong(
    mesh: list[dict[str, Any]],
) -> None:
    clean = _same(mesh, "tp", "tp_clean")
    assert clean["ok"] is True and clean["checked"] == 4 and clean["unreplicated"] == 2
    assert "2 outputs are shards of an activation" in clean["summary"]
    fault = _same(mesh, "tp", "tp_fault")
    assert fault["odd_ranks"] == [1] and fault["tensors"] == ["3 output", "(root) output", "loss"]
    assert "rank 1 (tp=1) disagrees with the majority of 4 replicas of 3 output" in \
        fault["summary"]


# ------------------------------------------------------------------ the guard's DCP checkpoints


@pytest.mark.timeout(300)
def test_guard_checkpoints_of_a_clean_fsdp2_run_are_all_certified(
    rollback: list[dict[str, Any]],
) -> None:
    clean = _same(rollback, "clean")
    assert clean["events"] == [] and clean["rollbacks"] == 0
    assert clean["checkpoints"] == [f"guard-step{s:08d}" for s in (0, 4, 8, 12, 16)]
    assert clean["certified"] == [True] * 5 and clean["verified"] == [True] * 5
    assert clean["ranks_in_record"] == ["0", "1"]
    # Before the first update the optimizer has no state: saved as its hyperparameters.
    assert clean["optimizer_state"] == [False, True, True, True, True]
    assert "FlagReducer()" in _same(rollback, "refused")


@pytest.mark.timeout(300)
def test_guard_rolls_every_rank_back_to_its_last_certified_dcp_checkpoint(
    rollback: list[dict[str, Any]],
) -> None:
    for r in rollback:
        run = r["rollback"]
        (event,) = run["events"]  # reported at the next update, named by the rank holding it
        assert event["step"] == 7 and event["kind"] == "weights_changed"
        assert event["suspects"] == (["0.weight shard (dp=1)"] if r is rollback[1] else [])
        assert run["equal_to_checkpoint"] is True  # every local shard and AdamW moment
        assert run["rollbacks"] == 1
    done = _same(rollback, "rollback", "rollback")
    assert done["checkpoint"].endswith("guard-step00000006") and done["restored_step"] == 6
    assert done["anomaly_step"] == 7


@pytest.mark.timeout(300)
def test_checkpoints_saved_with_a_flip_unresolved_are_uncertified_and_skipped(
    rollback: list[dict[str, Any]], run_cli: Callable[..., Any],
) -> None:
    for r in rollback:  # reported at the update after the flip, named by rank 1
        (event,) = r["uncertified"]["events"]
        assert event["step"] == 5
        assert event["suspects"] == (["2.weight shard (dp=1)"] if r is rollback[1] else [])
    unc = _same([{"u": {k: v for k, v in r["uncertified"].items() if k != "events"}}
                 for r in rollback], "u")
    assert unc["certified"] == [True, False, False]
    # B: only rank 1 saw its shard changed at rest; the verdict is agreed by both ranks.
    assert unc["b_changed"] == ["2.weight shard (dp=1) (rank 1)"]
    assert unc["b_verify_ok"] is True and unc["b_verify_certified"] is False
    assert unc["c_unresolved"] == [{"step": 5, "kind": "weights_changed",
                                    "suspects": ["2.weight shard (dp=1)"]}]
    # keep_checkpoints=2 prunes B, never A, the newest certified; rollback goes to A.
    assert unc["kept"] == [unc["a"], "guard-step00000006"]
    assert unc["restored_from"] == unc["a"] and unc["equal_to_a"] is True
    verdict = run_cli("verify", unc["b_copy"])
    assert verdict.code == 1
    assert "UNCERTIFIED: saved at step 5" in verdict.out
    assert "changed at rest: 2.weight shard (dp=1) (rank 1)" in verdict.out
    described = run_cli("inspect", unc["b_copy"])
    assert described.code == 2 and "a distributed checkpoint folder" in described.err
    assert f"torchverity verify {unc['b_copy']}" in described.err
