"""A real Lightning ``Trainer`` training a model sharded with FSDP2 (``ModelParallelStrategy``)
on 2 CPU processes (gloo, ``torchrun``), guarded by the callback at its default detection
settings: a clean run certifies every checkpoint it saves; a bit flipped in rank 1's local
shard of a weight between two updates is caught at the next update and named with its
shard, and every checkpoint saved after it is uncertified, as a distributed checkpoint
folder and as a full-state-dict file, for both ranks; ``torchverity verify`` fails those
and passes the clean ones; with the default policy every rank stops at that update.
The ranks' side is trainer_sharded_workers.py.

(The Hugging Face Trainer cannot train a sharded model on CPU: Accelerate keeps FSDP for
accelerators, so ``fsdp=`` with ``use_cpu=True`` trains unsharded.)
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from trainer_sharded_workers import FLIP_RANK, FLIP_STEP, STEPS

from torchverity.cli import main as cli_main

pytest.importorskip("lightning")

WORKERS = Path(__file__).with_name("trainer_sharded_workers.py")
SHARD = "net.0.weight shard (data_parallel=1)"
SAVED = list(range(5, STEPS + 1, 5))
DEADLINE_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(out: Path, *runs: str) -> tuple[int, str]:
    """``torchrun`` of the workers: its exit status and output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(WORKERS.parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "--max-restarts", "0", str(WORKERS), str(out), *runs]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        output = proc.communicate(timeout=DEADLINE_S)[0]
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        pass
    proc.terminate()  # torchrun ends its workers: SIGTERM, then SIGKILL after 30 s
    try:
        output = proc.communicate(timeout=60)[0][-6000:]
    except subprocess.TimeoutExpired:
        proc.kill()
        output = "(no output: torchrun did not end its workers)"
    pytest.fail(f"torchrun ({', '.join(runs)}) hung for {DEADLINE_S} s:\n{output}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sharded_trainer")
    code, log = _launch(out, "clean", "record", "record_full", "stop")
    if code:
        pytest.fail(f"torchrun exited {code}:\n{log[-6000:]}")
    return out


def _ranks(runs: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads((runs / name / f"rank{r}.json").read_text()) for r in range(2)]


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli_main(list(argv))
    return code, out.getvalue()


def _saved(runs: Path, name: str) -> list[Path]:
    return sorted((runs / name / "ckpt").glob("*.ckpt"),
                  key=lambda p: int(p.stem.rsplit("=", 1)[1]))


def _certification(path: Path) -> dict[str, Any]:
    meta = path / "meta.pt.meta.json" if path.is_dir() else Path(f"{path}.meta.json")
    return dict(json.loads(meta.read_text())["certification"])


def test_a_clean_sharded_run_raises_nothing_and_certifies_every_checkpoint(runs: Path) -> None:
    for rank in _ranks(runs, "clean"):
        assert rank["events"] == [] and rank["global_step"] == STEPS
        assert [(c["step"], c["certified"]) for c in rank["checkpoints"]] == [
            (s, True) for s in SAVED]
    saved = _saved(runs, "clean")
    assert [p.is_dir() for p in saved] == [True] * len(SAVED)  # distributed checkpoints
    for path in saved:
        cert = _certification(path)
        assert cert["certified"] and cert["world_size"] == 2
        assert [cert["ranks"][r]["certified"] for r in "01"] == [True, True]
        code, out = _cli("verify", str(path))
        assert code == 0 and "certified by the training guard" in out


@pytest.mark.parametrize("name", ["record", "record_full"])
def test_a_flip_in_one_ranks_shard_is_named_and_later_checkpoints_are_uncertified(
        runs: Path, name: str) -> None:
    ranks = _ranks(runs, name)
    # Every rank acts on it at the next update; the rank that holds the shard names it.
    for r, rank in enumerate(ranks):
        assert rank["events"] == [{"step": FLIP_STEP, "kind": "weights_changed",
                                   "action": "recorded",
                                   "suspects": [SHARD] if r == FLIP_RANK else []}]
    for rank in ranks:  # every rank's view of every checkpoint: the same verdict
        assert [(c["step"], c["certified"]) for c in rank["checkpoints"]] == [
            (s, s < FLIP_STEP) for s in SAVED]
    saved = _saved(runs, name)
    assert [p.is_dir() for p in saved] == [name == "record"] * len(SAVED)
    for step, path in zip(SAVED, saved, strict=True):
        cert = _certification(path)
        assert cert["certified"] is (step < FLIP_STEP)
        code, out = _cli("verify", str(path))
        if step < FLIP_STEP:
            assert code == 0 and "certified by the training guard" in out
            continue
        assert cert["unresolved"] == [{"step": FLIP_STEP, "kind": "weights_changed",
                                       "suspects": [SHARD]}]
        # Each rank's own verdict too: both know of the unresolved flip.
        assert [cert["ranks"][r]["certified"] for r in "01"] == [False, False]
        assert code == 1 and "UNCERTIFIED" in out and SHARD in out


def test_by_default_every_rank_stops_at_the_update_after_a_flip_in_one_ranks_shard(
        runs: Path) -> None:
    # The ranks' flags are combined (a FlagReducer by default): none is left waiting in a
    # collective that the stopped rank never joins.
    for rank in _ranks(runs, "stop"):
        assert rank["stopped"] is not None and rank["stopped"]["step"] == FLIP_STEP
        assert rank["stopped"]["kind"] == "weights_changed"
        assert [(e["step"], e["action"]) for e in rank["events"]] == [(FLIP_STEP, "stopped")]
        assert [(c["step"], c["certified"]) for c in rank["checkpoints"]] == [
            (s, True) for s in SAVED if s < FLIP_STEP]
    assert _ranks(runs, "stop")[FLIP_RANK]["stopped"]["suspects"] == [SHARD]
