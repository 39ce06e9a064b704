"""``save_dcp`` killed at any instant leaves the previous distributed checkpoint whole:
``load_dcp`` and ``torchverity verify`` accept it, never a mix of two saves (a training
guard's certification included: it is published with its checkpoint), and the next save
sweeps what the killed one left. Real torch.distributed.checkpoint on a one-rank gloo
group in a child forked per run (strace kills it at its K-th rename, or a timer does).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from crash_harness import count_renames, kill_after, kill_at_rename, need_strace, run_child, tmpfs

VALUES = {"A": 1.0, "B": 100.0, "C": 1000.0}
CERTIFIED = {"A": True, "B": False, "C": True}  # a guard's verdict saved with each


def _state(value: float, size: int = 4000) -> dict[str, Any]:
    return {"model": {f"layer{i}.weight": torch.full((size,), value + i) for i in range(4)}}


def _in_group(store: Path, body: Callable[[], None]) -> Callable[[], None]:
    def action() -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", store=dist.FileStore(str(store), 1), rank=0,
                                world_size=1)
        try:
            body()
        finally:
            dist.destroy_process_group()
    return action


def _store() -> Path:
    """A fresh rendezvous file outside the checkpoint's disk (which may be full or read-only)."""
    return Path(tempfile.gettempdir()) / f"tv-dcp-store-{os.getpid()}-{time.monotonic_ns()}"


def _save(root: Path, which: str, size: int = 4000) -> Callable[[], None]:
    import torchverity.distributed as tvd

    certification = {"certified": CERTIFIED[which], "step": int(VALUES[which])}
    return _in_group(_store(), lambda: tvd.save_dcp(_state(VALUES[which], size), root,
                                                   certification=certification) and None)


def _inspect(root: Path) -> dict[str, Any]:
    """Load and verify ``root`` in a child (its own process group); what it held."""
    import torchverity.distributed as tvd
    from torchverity.verify import verify_path

    out = _store().with_suffix(".json")

    def body() -> None:
        target = _state(0.0)
        try:
            tvd.load_dcp(target, root)
        except Exception as exc:
            out.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
            return
        first = float(target["model"]["layer0.weight"][0])
        held = [k for k, v in VALUES.items() if v == first]
        whole = held and all(torch.equal(t, _state(VALUES[held[0]])["model"][k])
                             for k, t in target["model"].items())
        out.write_text(json.dumps({"held": held[0] if whole else "a mix",
                                   "verify_rc": 0 if verify_path(root).ok else 1,
                                   "certified": (tvd.read_certification(root) or {}).get(
                                       "certified")}))

    assert run_child(_in_group(_store(), body)) == "finished"
    return dict(json.loads(out.read_text()))


@pytest.fixture(autouse=True, scope="module")
def _warm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One save and load in this process first: DCP's lazy imports then happen once,
    not in every forked child. Afterwards, the rendezvous files killed children left."""
    import torchverity.distributed as tvd

    work = tmp_path_factory.mktemp("warm")
    _in_group(work / "store", lambda: tvd.load_dcp(
        _state(0.0), work / "dcp") if tvd.save_dcp(_state(1.0), work / "dcp") else None)()
    yield
    for left in Path(tempfile.gettempdir()).glob(f"tv-dcp-store-{os.getpid()}-*"):
        left.unlink(missing_ok=True)


def _prepared(tmp_path: Path) -> Path:
    template = tmp_path / "template"
    if not template.exists():
        template.mkdir()
        assert run_child(_save(template / "dcp", "A")) == "finished"
    run = tmp_path / f"run-{time.monotonic_ns()}"
    shutil.copytree(template, run)
    return run / "dcp"


def _after_kill(root: Path) -> str:
    seen = _inspect(root)
    assert "error" not in seen and seen["verify_rc"] == 0, seen
    assert seen["held"] in ("A", "B"), seen
    assert seen["certified"] is CERTIFIED[seen["held"]], seen
    assert run_child(_save(root, "C")) == "finished"
    after = _inspect(root)
    assert after["held"] == "C" and after["verify_rc"] == 0, after
    assert [p.name for p in root.iterdir() if p.is_dir()] == [
        json.loads((root / "torchverity.current.json").read_text())["current"]]
    return str(seen["held"])


def test_every_rename_window_of_save_dcp(tmp_path: Path) -> None:
    need_strace()
    renames = count_renames(_save(_prepared(tmp_path), "B"))
    assert renames >= 3
    held = []
    for k in range(1, renames + 1):
        root = _prepared(tmp_path)
        assert kill_at_rename(_save(root, "B"), k) == "killed", k
        held.append(_after_kill(root))
    # Only the pointer's rename (the last) switches the folder to the new save.
    assert held == ["A"] * renames, held
    root = _prepared(tmp_path)
    assert kill_at_rename(_save(root, "B"), renames + 1) == "finished"
    assert _inspect(root)["held"] == "B"


def test_random_kills_of_save_dcp(tmp_path: Path) -> None:
    root = _prepared(tmp_path)
    start = time.perf_counter()
    assert run_child(_save(root, "B")) == "finished"
    took = time.perf_counter() - start
    rng = random.Random(5)
    seen = []
    for _ in range(8):
        root = _prepared(tmp_path)
        kill_after(_save(root, "B"), rng.uniform(0, took * 1.2))
        seen.append(_after_kill(root))
    assert set(seen) <= {"A", "B"}


def test_a_stale_temp_file_is_swept_and_ignored(tmp_path: Path) -> None:
    root = _prepared(tmp_path)
    stale = root / f".torchverity.current.json.tmp-{2 ** 22 + 7}"
    stale.write_text("left by a killed save")
    assert _inspect(root)["held"] == "A"
    assert run_child(_save(root, "B")) == "finished"
    assert not stale.exists() and _inspect(root)["held"] == "B"


def test_a_disk_that_fills_mid_save_dcp_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    import torchverity.distributed as tvd

    with tmpfs(tmp_path / "disk", "400k") as disk:
        root = disk / "dcp"
        assert run_child(_save(root, "A")) == "finished"
        out = tmp_path / "error.json"

        def body() -> None:
            try:
                tvd.save_dcp(_state(5.0, size=40000), root)  # 640 kB: does not fit
                out.write_text(json.dumps({"error": None}))
            except Exception as exc:
                out.write_text(json.dumps({"error": type(exc).__name__, "message": str(exc),
                                           "intact": getattr(exc, "previous_intact", None)}))

        assert run_child(_in_group(tmp_path / "store-full", body)) == "finished"
        failure = json.loads(out.read_text())
        assert failure["error"] == "CheckpointWriteError" and failure["intact"], failure
        assert "disk is full" in failure["message"] and "intact" in failure["message"]
        assert _inspect(root) == {"held": "A", "verify_rc": 0, "certified": True}
        assert run_child(_save(root, "B")) == "finished"  # the failed save gave its space back
        assert _inspect(root)["held"] == "B"


def test_a_read_only_folder_is_a_write_error_for_save_dcp(tmp_path: Path) -> None:
    import torchverity.distributed as tvd

    with tmpfs(tmp_path / "disk", "1m") as disk:
        root = disk / "dcp"
        assert run_child(_save(root, "A")) == "finished"
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        out = tmp_path / "error.json"

        def body() -> None:
            try:
                tvd.save_dcp(_state(2.0), root)
                out.write_text(json.dumps({"error": None}))
            except Exception as exc:
                out.write_text(json.dumps({"error": type(exc).__name__, "message": str(exc),
                                           "intact": getattr(exc, "previous_intact", None)}))

        assert run_child(_in_group(tmp_path / "store-ro", body)) == "finished"
        failure = json.loads(out.read_text())
        assert failure["error"] == "CheckpointWriteError" and failure["intact"], failure
        assert "read-only" in failure["message"]
        assert _inspect(root)["held"] == "A"


def test_the_documented_pointer_is_the_one_written(tmp_path: Path) -> None:
    """docs/formats/distributed.md's pointer example has exactly the written fields."""
    doc = (Path(__file__).parents[2] / "docs/formats/distributed.md").read_text()
    block = doc.split("### `torchverity.current.json`", 1)[1].split("```json", 1)[1]
    documented = json.loads(block.split("```", 1)[0])
    root = _prepared(tmp_path)
    written = json.loads((root / "torchverity.current.json").read_text())
    assert set(documented) == set(written)
    assert documented["format"] == written["format"] and documented["version"] == written["version"]
    assert (root / written["current"] / "torchverity.manifest.json").is_file()
