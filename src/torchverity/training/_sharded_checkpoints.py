"""The guard's own checkpoints of a sharded model: distributed checkpoints every rank certifies.

Under FSDP2, HSDP and tensor parallelism no rank holds the whole model, so the guard
saves a distributed checkpoint folder with :func:`~torchverity.distributed.save_dcp`
(published by one rename, a manifest, per-rank fingerprints) holding the model and
optimizer state dicts of ``torch.distributed.checkpoint.state_dict`` and, per rank, the
guard's rule state and RNG states. Every rank verifies its own shards at rest; the
verdicts are gathered and the checkpoint is certified only when every rank's is, so a
flip on one rank makes it uncertified for all. The agreed certification is recorded
with the fingerprints (docs/formats/distributed.md). A rollback agrees on the folder
on every rank, refuses one whose record is not certified, and loads it with
:func:`~torchverity.distributed.load_dcp` (verified before anything is unpickled).
Every exchange waits at most :data:`~torchverity.distributed.DEFAULT_TIMEOUT_S`.
"""

from __future__ import annotations

import hashlib
import io
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchverity._generation_pointer import MANIFEST_IN_GENERATION
from torchverity.distributed._checkpoint import load_dcp, read_certification, save_dcp
from torchverity.distributed._comm import DEFAULT_TIMEOUT_S, Comm, all_gather_json, open_comm
from torchverity.distributed._dcp_generations import data_folder
from torchverity.errors import IntegrityError, UsageError, shell_path

if TYPE_CHECKING:
    from torchverity.training._guard import TrainingGuard


def _comm(what: str) -> Comm:
    return open_comm(None, DEFAULT_TIMEOUT_S, f"TrainingGuard: {what}")


def any_rank(flag: bool, what: str) -> bool:
    """Whether ``flag`` holds on any rank (the same answer on every rank)."""
    return any(all_gather_json(_comm(what), bool(flag), what))


# ------------------------------------------------------------------ certification


def agree(local: dict[str, Any]) -> dict[str, Any]:
    """One certification for the whole model from every rank's own: certified only when
    every rank's shards passed and no rank has an unresolved anomaly."""
    records = all_gather_json(_comm("certification"), local, "the certification exchange")
    states = {r["verified"]["at_rest"] for r in records}
    at_rest = ("failed" if "failed" in states else
               "unavailable" if "unavailable" in states else "passed")
    verified = {**records[0]["verified"], "at_rest": at_rest, **{
        k: sum(r["verified"][k] for r in records)
        for k in ("tensors", "parameters", "optimizer_state", "frozen_parameters")
        if k in records[0]["verified"]}}
    return {"certified": all(r["certified"] for r in records), "step": local["step"],
            "verified": verified,
            "changed": [f"{n} (rank {i})" for i, r in enumerate(records) for n in r["changed"]],
            "unresolved": _merged(records), "guard": records[0]["guard"],
            "world_size": len(records), "ranks": {str(i): r for i, r in enumerate(records)}}


def _merged(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranks' unresolved anomalies, one per step and kind, with every rank's suspects."""
    merged: dict[tuple[int, str], dict[str, Any]] = {}
    for r in records:
        for u in r["unresolved"]:
            into = merged.setdefault((u["step"], u["kind"]),
                                     {"step": u["step"], "kind": u["kind"], "suspects": []})
            into["suspects"] += [s for s in u["suspects"] if s not in into["suspects"]]
    return list(merged.values())


# ------------------------------------------------------------------ save


def save(guard: TrainingGuard, path: Path, certification: dict[str, Any],
         rules: dict[str, Any]) -> str:
    """Save a distributed checkpoint of the guard's model and optimizer, with this rank's
    ``rules`` state and RNG states, and the agreed ``certification``; returns the SHA-256
    of the manifest the pointer names."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    g = guard
    # torch's state-dict helper runs a zero-learning-rate step to create a missing state
    # (Adam's step count would then be off by one): an optimizer that has not stepped
    # is saved as its hyperparameters only, and restored with no state.
    own = _own_state(g, rules)
    shared = all_gather_json(_comm("the guard-state exchange"), {
        "stepped": bool(g.optimizer.state), "sha256": hashlib.sha256(own).hexdigest()},
        "the guard-state exchange")
    with_state = all(r["stepped"] for r in shared)
    state: dict[str, Any] = {"model": get_model_state_dict(g.model),
                             "guard": {f"rank{g.rank}": own}}
    if with_state:
        state["optim"] = get_optimizer_state_dict(g.model, g.optimizer)
    record = {**certification, "optimizer_state": with_state, "ranks": {
        i: {**r, "own_state_sha256": shared[int(i)]["sha256"]}
        for i, r in certification["ranks"].items()}}
    save_dcp(state, path, timeout=DEFAULT_TIMEOUT_S, certification=record)
    return hashlib.sha256((data_folder(path) / MANIFEST_IN_GENERATION).read_bytes()).hexdigest()


def _own_state(g: TrainingGuard, rules: dict[str, Any]) -> bytes:
    """This rank's guard rule state, RNG states and optimizer hyperparameters (restored
    from here when the optimizer had not stepped), as ``torch.save`` bytes that load
    with ``weights_only=True``."""
    from torchverity.determinism import capture_rng

    groups = [{k: v for k, v in group.items() if k != "params"}
              for group in g.optimizer.state_dict()["param_groups"]]
    buf = io.BytesIO()
    torch.save({"guard": rules, "rng": capture_rng().to_state(), "param_groups": groups}, buf)
    return buf.getvalue()


def remove(guard: TrainingGuard, path: Path) -> None:
    """Prune one checkpoint folder (rank 0 deletes; every rank forgets it)."""
    if guard.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------ rollback


def choose(certified: list[Path]) -> Path:
    """The newest certified checkpoint, the same on every rank."""
    mine = str(certified[-1]) if certified else None
    chosen = all_gather_json(_comm("rollback"), mine, "the rollback checkpoint exchange")
    if all(c is None for c in chosen):
        raise UsageError("no certified checkpoint to roll back to",
                         hint="give checkpoint_dir= (the guard saves one when it starts)")
    if any(c != chosen[0] for c in chosen):
        raise UsageError(
            "TrainingGuard: the ranks do not have the same certified checkpoint to roll back "
            f"to ({', '.join(f'rank {i}: {c}' for i, c in enumerate(chosen))})",
            hint="give every rank the same checkpoint_dir and reducer=torchverity.distributed."
                 "FlagReducer(), so that they save and roll back together")
    return Path(str(chosen[0]))


def load(guard: TrainingGuard, path: Path) -> dict[str, Any]:
    """Load a certified checkpoint into the guard's model and optimizer on every rank;
    returns this rank's own guard state (rule state, RNG states)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    g = guard
    record = read_certification(path)  # load_dcp verifies the file it sits in
    if record is None or not record["certified"] or "optimizer_state" not in record:
        raise IntegrityError(
            f"{path}: not a certified checkpoint of the training guard; nothing was loaded",
            path=path, hint=f"torchverity verify {shell_path(path)}; roll back to an older "
                            "checkpoint")
    key = f"rank{g.rank}"
    state: dict[str, Any] = {"model": get_model_state_dict(g.model), "guard": {key: b""}}
    if record["optimizer_state"]:
        state["optim"] = get_optimizer_state_dict(g.model, g.optimizer)
    load_dcp(state, path, timeout=DEFAULT_TIMEOUT_S)
    own_bytes = state["guard"][key]
    expected = record["ranks"][str(g.rank)]["own_state_sha256"]
    if not isinstance(own_bytes, bytes) or hashlib.sha256(own_bytes).hexdigest() != expected:
        raise IntegrityError(
            f"{path}: rank {g.rank}'s guard state loaded from the checkpoint differs from "
            "the digest recorded at save", path=path, expected=expected,
            hint="the files verified, so memory or the load path corrupted it: roll back again")
    own = torch.load(io.BytesIO(own_bytes), weights_only=True)
    set_model_state_dict(g.model, state["model"])
    if record["optimizer_state"]:
        set_optimizer_state_dict(g.model, g.optimizer, state["optim"])
    else:  # saved before the first update: no state, the hyperparameters of then
        current = g.optimizer.state_dict()["param_groups"]
        g.optimizer.load_state_dict({"state": {}, "param_groups": [
            {**saved, "params": now["params"]}
            for saved, now in zip(own["param_groups"], current, strict=True)]})
    return dict(own)
