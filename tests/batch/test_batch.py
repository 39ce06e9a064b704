"""Batch jobs: exactly-once outputs under SIGKILL, input/output checks, journal and disk faults.

Everything is real: input files in tmp_path, the CLI in subprocesses killed
with SIGKILL, SQLite on disk, a 1 MiB tmpfs and a read-only bind mount in a
private mount namespace (``unshare``) for the full-disk and read-only cases.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from torchverity.batch import BatchItem, run_batch, verify_batch
from torchverity.batch._engine_local import HELPER_MIN_BYTES
from torchverity.batch._journal import JOURNAL_NAME, Journal
from torchverity.errors import BatchError, FormatError

MODEL_SOURCE = '''
import hashlib, os, time

def transform(data):
    return hashlib.sha256(data).hexdigest().encode() + b"\\n" + data[::-1]

def build(state=None):
    delay = float(os.environ.get("TV_BATCH_DELAY", "0"))
    scale = float(state["w"].sum()) if state is not None else 1.0
    def fn(item):
        if delay:
            time.sleep(delay)
        return transform(item.data) + f"\\n{scale}".encode()
    return fn

def build_other(state=None):
    return lambda item: item.data
'''


def expected_output(data: bytes, scale: float = 1.0) -> bytes:
    return hashlib.sha256(data).hexdigest().encode() + b"\n" + data[::-1] + f"\n{scale}".encode()


def make_inputs(folder: Path, count: int, size: int = 100, nested: bool = True) -> dict[str, bytes]:
    """``count`` small real files (some in a subfolder) with distinct content."""
    rng = random.Random(count)
    files = {}
    for i in range(count):
        key = f"part{i % 3}/item{i:05d}.bin" if nested else f"item{i:05d}.bin"
        data = f"{i:08d}".encode() + rng.randbytes(size - 8)
        (folder / key).parent.mkdir(parents=True, exist_ok=True)
        (folder / key).write_bytes(data)
        files[key] = data
    return files


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "tvbatch_model.py").write_text(MODEL_SOURCE)
    return folder


def cli_env(model_dir: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(model_dir), **extra)
    env.pop("TORCHVERITY_DEBUG", None)
    return env


def cli(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "torchverity", *map(str, args)]


def journal_counts(out: Path) -> dict[str, int]:
    journal = Journal.open(out)  # also runs SQLite's quick_check
    try:
        return journal.counts()
    finally:
        journal.close()


def committed_now(out: Path) -> int:
    """Read the journal the way any outside reader may while a job runs."""
    if not (out / JOURNAL_NAME).exists():
        return 0
    with sqlite3.connect(f"file:{out / JOURNAL_NAME}?mode=ro", uri=True, timeout=5) as conn:
        row = conn.execute("SELECT COUNT(*) FROM items WHERE state = 'committed'").fetchone()
    return int(row[0])


def wait_for(condition: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def assert_exactly_once(out: Path, files: dict[str, bytes], scale: float = 1.0) -> None:
    """Identity, not counts: each input has its one output with the right bytes, nothing else."""
    data = out / "data"
    found = sorted(p.relative_to(data).as_posix() for p in data.rglob("*") if p.is_file())
    assert found == sorted(f"{k}.out" for k in files)
    for key, content in files.items():
        assert (data / f"{key}.out").read_bytes() == expected_output(content, scale), key


# ------------------------------------------------------------ SIGKILL, resume, verify


@pytest.mark.parametrize("workers", ["1", "2"])  # 1: items on the driver's own thread
def test_sigkill_at_random_moments_then_resume_gives_exactly_one_output_per_input(
    tmp_path: Path, model_dir: Path, run_cli: Callable[..., Any], workers: str
) -> None:
    files = make_inputs(tmp_path / "in", 2000)
    out = tmp_path / "out"
    args = cli("batch", "run", "--inputs", tmp_path / "in", "--model", "tvbatch_model:build",
               "--out", out, "--workers", workers)
    env = cli_env(model_dir, TV_BATCH_DELAY="0.002")
    rng = random.Random(9 + int(workers))
    landed_mid_job = 0
    for attempt in range(4):
        before = committed_now(out)
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if attempt == 0:  # anywhere: start-up, listing, journal creation or work
            time.sleep(rng.uniform(0.1, 1.0))
        else:  # somewhere after this run has committed something of its own
            wait_for(lambda p=proc, n=before: committed_now(out) > n or p.poll() is not None)
            time.sleep(rng.uniform(0.0, 0.2))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        counts = journal_counts(out) if (out / JOURNAL_NAME).exists() else {"committed": 0}
        landed_mid_job += 0 < counts["committed"] < len(files)
    assert landed_mid_job >= 3, "the kills should interrupt the job while it works"

    final = subprocess.run([*args, "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert final.returncode == 0, final.stderr
    report = json.loads(final.stdout)
    assert report["ok"] and report["resumed"]
    assert report["committed"] == report["total"] == len(files)
    assert report["failed"] == report["changed"] == report["pending"] == 0
    assert not report["repaired"] and not report["problems"]
    assert not list(out.rglob("*.tvtmp"))
    assert_exactly_once(out, files)

    verified = subprocess.run(cli("batch", "verify", out), env=env, capture_output=True,
                              text=True, timeout=60)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "2000 inputs, each with exactly one verified output" in verified.stdout
    sums = subprocess.run(["sha256sum", "--quiet", "-c", "manifest-sha256.txt"], cwd=out,
                          capture_output=True, text=True)
    assert sums.returncode == 0, sums.stdout
    bag_info = (out / "bag-info.txt").read_text()
    total_bytes = sum(len(expected_output(c)) for c in files.values())
    assert f"Payload-Oxum: {total_bytes}.2000" in bag_info


def test_clean_rerun_of_a_finished_job_changes_nothing(tmp_path: Path) -> None:
    files = make_inputs(tmp_path / "in", 40)
    out = tmp_path / "out"
    # Durable by one syncfs per commit point here; the other tests fsync every output.
    first = run_batch(tmp_path / "in", _transform, out, workers=2, durability="group")
    assert first.ok and not first.resumed and first.processed == 40 and not first.problems
    stamp = {p: p.stat().st_mtime_ns for p in (out / "data").rglob("*.out")}
    again = run_batch(tmp_path / "in", _transform, out, workers=2)
    assert again.ok and again.resumed and again.processed == 0
    assert (again.interrupted, again.orphans_removed, again.repaired) == (0, 0, ())
    assert {p: p.stat().st_mtime_ns for p in (out / "data").rglob("*.out")} == stamp
    assert verify_batch(out).ok
    assert_exactly_once(out, files)


def _transform(item: BatchItem) -> bytes:
    return expected_output(item.data)


def test_commit_points_flush_after_the_renames_they_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal calls an output committed only after a flush that began once it was in
    place; the flushes run on the committer thread while the items go on."""
    from torchverity.batch import _item, _journal

    files = make_inputs(tmp_path / "in", 600, nested=False)
    out = tmp_path / "out"
    flushes: list[tuple[set[str], str]] = []  # outputs in place as a flush began, its thread
    recorded: list[tuple[set[str], int]] = []  # outputs recorded committed, flushes before
    flush, record = _item.Durability.commit_point, _journal.Journal.record

    def spied_flush(self: _item.Durability, folders: set[Path]) -> None:
        present = {p.name for p in (out / "data").iterdir() if p.name.endswith(".out")}
        flushes.append((present, threading.current_thread().name))
        flush(self, folders)

    def spied_record(self: _journal.Journal, outcomes: Any, running: Any = ()) -> None:
        ids = {o.id for o in outcomes if o.state == "committed"}
        names = {f"item{i - 1:05d}.bin.out" for i in ids}
        recorded.append((names, len(flushes)))
        record(self, outcomes, running)

    monkeypatch.setattr(_item.Durability, "commit_point", spied_flush)
    monkeypatch.setattr(_journal.Journal, "record", spied_record)

    def slow(item: BatchItem) -> bytes:
        time.sleep(0.001)  # several commit points while the job runs
        return _transform(item)

    assert run_batch(tmp_path / "in", slow, out).ok
    assert len(recorded) >= 3
    assert {thread for _, thread in flushes} == {"tv-journal-commit"}
    for names, flushed in recorded:
        assert flushed and names <= flushes[flushed - 1][0]
    assert set().union(*(names for names, _ in recorded)) == {f"{k}.out" for k in files}
    assert_exactly_once(out, files)


def test_outputs_finished_before_a_hung_item_are_committed_while_it_hangs(
    tmp_path: Path,
) -> None:
    """One worker runs items on the caller's thread; a watchdog records the finished ones
    (and marks the hung one running) so a kill during the hang loses none of them."""
    files = make_inputs(tmp_path / "in", 40, nested=False)
    out = tmp_path / "out"
    release = threading.Event()

    def hangs_at_25(item: BatchItem) -> bytes:
        if item.key == "item00025.bin":
            release.wait(30)
        return _transform(item)

    reports: list[Any] = []
    job = threading.Thread(target=lambda: reports.append(run_batch(tmp_path / "in",
                                                                   hangs_at_25, out)))
    job.start()
    try:
        wait_for(lambda: committed_now(out) == 25, timeout=20)
        with sqlite3.connect(f"file:{out / JOURNAL_NAME}?mode=ro", uri=True) as conn:
            states = dict(conn.execute("SELECT key, state FROM items"))
        assert states["item00025.bin"] == "running"
        assert {states[f"item{i:05d}.bin"] for i in range(25)} == {"committed"}
        assert {states[f"item{i:05d}.bin"] for i in range(26, 40)} <= {"pending", "running"}
    finally:
        release.set()
        job.join(30)
    [report] = reports
    assert report.ok and report.processed == 40
    assert_exactly_once(out, files)


@pytest.mark.parametrize(("size", "durability", "threads"), [
    (HELPER_MIN_BYTES - 1, "group", 0),  # small items: all on the caller's thread
    (HELPER_MIN_BYTES, "group", 2),  # large items: one helper thread beside the model
    (10 * 1024, "file", 5),  # an fsync per output: four helpers hide its latency
])
def test_local_engine_adds_helper_threads_only_where_they_pay(
    tmp_path: Path, size: int, durability: str, threads: int
) -> None:
    files = make_inputs(tmp_path / "in", 12, size=size)
    seen: set[str] = set()
    callers: set[str] = set()

    def transform(item: BatchItem) -> bytes:
        seen.update(t.name for t in threading.enumerate() if t.name.startswith("tv-batch-"))
        callers.add(threading.current_thread().name)
        return _transform(item)

    out = tmp_path / "out"
    report = run_batch(tmp_path / "in", transform, out, durability=durability)
    assert report.ok and len(seen) == threads, seen
    assert (callers == {"MainThread"}) == (threads == 0), callers
    assert_exactly_once(out, files)
    assert verify_batch(out).ok


def test_a_job_moves_from_the_callers_thread_to_the_pool_at_its_first_large_item(
    tmp_path: Path,
) -> None:
    """Small items run inline until a large one comes up; every item still ends exactly once,
    and a changed input is caught on either side of the move."""
    folder = tmp_path / "in"
    files = {f"a{i:03d}.bin": os.urandom(100) for i in range(40)}
    files |= {f"b{i:03d}.bin": os.urandom(HELPER_MIN_BYTES) for i in range(8)}
    for key, content in files.items():
        (folder / key).parent.mkdir(parents=True, exist_ok=True)
        (folder / key).write_bytes(content)
    callers: dict[str, str] = {}

    def transform(item: BatchItem) -> bytes:
        callers[item.key] = threading.current_thread().name
        if item.key == "a000.bin":  # one input of each kind changes after listing
            for changed in ("a030.bin", "b005.bin"):
                raw = bytearray((folder / changed).read_bytes())
                raw[7] ^= 0x01
                (folder / changed).write_bytes(raw)
        return _transform(item)

    out = tmp_path / "out"
    report = run_batch(folder, transform, out)
    assert (report.committed, report.changed, report.failed) == (46, 2, 0)
    assert {p.key for p in report.problems} == {"a030.bin", "b005.bin"}
    # The first items ran inline; those not started yet when b000 came up moved with it.
    assert {callers[f"a{i:03d}.bin"] for i in range(16)} == {"MainThread"}
    assert all(callers[k].startswith("tv-batch-") for k in callers if k.startswith("b"))
    assert "a030.bin" not in callers and "b005.bin" not in callers
    kept = {k: v for k, v in files.items() if k not in ("a030.bin", "b005.bin")}
    data = out / "data"
    assert sorted(p.name for p in data.iterdir()) == sorted(f"{k}.out" for k in kept)
    for key, content in kept.items():
        assert (data / f"{key}.out").read_bytes() == expected_output(content), key


# ------------------------------------------------------------ inputs that change


def test_input_modified_during_the_job_is_recorded_as_changed_and_never_processed(
    tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    files = make_inputs(tmp_path / "in", 30, nested=False)
    grown, flipped = tmp_path / "in/item00020.bin", tmp_path / "in/item00025.bin"

    def fn(item: BatchItem) -> bytes:
        if item.key == "item00005.bin":  # later inputs change while the job runs
            with open(grown, "ab") as fh:
                fh.write(b"more")
            raw = bytearray(flipped.read_bytes())
            raw[50] ^= 0x01  # same size, one bit: only the digest can tell
            flipped.write_bytes(raw)
        return expected_output(item.data)

    out = tmp_path / "out"
    report = run_batch(tmp_path / "in", fn, out)
    assert (report.committed, report.changed, report.failed) == (28, 2, 0)
    assert not report.ok
    reasons = {p.key: p for p in report.problems}
    assert set(reasons) == {"item00020.bin", "item00025.bin"}
    assert reasons["item00020.bin"].state == "input-changed"
    assert "size is 104 bytes, was 100" in str(reasons["item00020.bin"].error)
    assert "sha256 is" in str(reasons["item00025.bin"].error)
    assert not (out / "data/item00020.bin.out").exists()
    assert not (out / "data/item00025.bin.out").exists()
    for key in set(files) - set(reasons):
        assert (out / "data" / f"{key}.out").read_bytes() == expected_output(files[key])

    result = run_cli("batch", "verify", out)
    assert result.code == 1
    assert "input-changed: item00020.bin: input changed since listing" in result.out
    assert "FAILED: 2 problems" in result.out


# ------------------------------------------------------------ outputs damaged after the job


def test_verify_names_every_damaged_missing_and_extra_output(
    tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    make_inputs(tmp_path / "in", 12, nested=False)
    out = tmp_path / "out"
    # Lazy durability: no flush of outputs, so the rerun's re-hash is what repairs them.
    assert run_batch(tmp_path / "in", _transform, out, durability="lazy").ok
    clean = run_cli("batch", "verify", out, "--json")
    assert clean.code == 0 and json.loads(clean.out)["problems"] == []

    damaged = out / "data/item00003.bin.out"
    raw = bytearray(damaged.read_bytes())
    raw[10] ^= 0x40
    damaged.write_bytes(raw)
    (out / "data/item00007.bin.out").unlink()
    shutil.copy(out / "data/item00001.bin.out", out / "data/item00001.bin.out.copy")

    result = run_cli("batch", "verify", out, "--json")
    assert result.code == 1
    found = {(p["kind"], p["key"], p["path"]) for p in json.loads(result.out)["problems"]}
    assert found == {
        ("missing-output", "item00007.bin", "data/item00007.bin.out"),
        ("output-mismatch", "item00003.bin", "data/item00003.bin.out"),
        ("extra-output", None, "data/item00001.bin.out.copy"),
    }
    human = run_cli("batch", "verify", out)
    assert "output-mismatch: item00003.bin: data/item00003.bin.out: sha256 is" in human.out

    # Resuming redoes the damaged and missing outputs; the stray copy stays an error.
    again = run_batch(tmp_path / "in", _transform, out, durability="lazy")
    assert again.ok and set(again.repaired) == {"item00003.bin", "item00007.bin"}
    assert again.processed == 2
    assert [p.kind for p in verify_batch(out).problems] == ["extra-output"]
    (out / "data/item00001.bin.out.copy").unlink()
    assert verify_batch(out).ok


def test_a_tampered_bag_manifest_is_named(tmp_path: Path) -> None:
    make_inputs(tmp_path / "in", 5, nested=False)
    out = tmp_path / "out"
    run_batch(tmp_path / "in", _transform, out)
    manifest = out / "manifest-sha256.txt"
    lines = manifest.read_text().splitlines()
    lines[2] = "0" * 64 + lines[2][64:]
    manifest.write_text("\n".join(lines) + "\n")
    problems = verify_batch(out).problems
    assert [(p.kind, p.key) for p in problems] == [("manifest-mismatch", "item00002.bin")]


# ------------------------------------------------------------ retries


def test_failing_items_are_retried_with_backoff_then_recorded(
    tmp_path: Path, model_dir: Path
) -> None:
    make_inputs(tmp_path / "in", 10, nested=False)
    calls: dict[str, int] = {}

    def flaky(item: BatchItem) -> bytes:
        calls[item.key] = calls.get(item.key, 0) + 1
        if item.key == "item00002.bin":
            raise ValueError("cannot decode this image")
        if item.key == "item00004.bin" and calls[item.key] <= 2:
            raise TimeoutError("transient")
        return expected_output(item.data)

    out = tmp_path / "out"
    report = run_batch(tmp_path / "in", flaky, out, retries=2, backoff=0.01)
    assert (report.committed, report.failed, report.retries) == (9, 1, 4)
    assert calls["item00002.bin"] == 3 and calls["item00004.bin"] == 3
    [problem] = report.problems
    assert (problem.key, problem.state, problem.attempts) == ("item00002.bin", "failed", 3)
    assert problem.error == "ValueError: cannot decode this image"
    [verify_problem] = verify_batch(out).problems
    assert verify_problem.kind == "failed" and "after 3 attempts" in verify_problem.detail
    # A job run from Python has no command: the step names the call to repeat.
    step = ("fix the failed inputs or the model, then rerun: the same "
            "run_batch/run_model_batch call with retry_failed=True")
    assert report.next_step == step and verify_batch(out).next_step == step


def test_cli_exit_code_and_summary_when_items_fail(tmp_path: Path, model_dir: Path) -> None:
    make_inputs(tmp_path / "in", 6, nested=False)
    (model_dir / "tvbatch_bad.py").write_text(
        "def build():\n"
        "    def fn(item):\n"
        "        if item.key.endswith('3.bin'):\n"
        "            raise RuntimeError('bad item')\n"
        "        return item.data\n"
        "    return fn\n"
    )
    out = tmp_path / "out"
    result = subprocess.run(
        cli("batch", "run", "--inputs", tmp_path / "in", "--model", "tvbatch_bad:build",
            "--out", out, "--retries", "1"),
        env=cli_env(model_dir), capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1, result.stderr
    assert "committed      5" in result.stdout and "failed         1" in result.stdout
    assert "items/s" in result.stdout
    assert "failed: item00003.bin: RuntimeError: bad item" in result.stdout


# ------------------------------------------------------------ weights and job identity


def test_weights_are_verified_before_the_first_item(
    tmp_path: Path, model_dir: Path, run_cli: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    import torchverity

    monkeypatch.syspath_prepend(str(model_dir))
    files = make_inputs(tmp_path / "in", 8, nested=False)
    weights = tmp_path / "w.pt"
    torchverity.save({"w": torch.full((4,), 0.5)}, weights)
    out = tmp_path / "out"
    base = ["batch", "run", "--inputs", tmp_path / "in", "--model", "tvbatch_model:build",
            "--out", out]
    good = run_cli(*base, "--weights", weights, "--json")
    assert good.code == 0, good.err
    assert_exactly_once(out, files, scale=2.0)
    journal = Journal.open(out)
    job = json.loads(journal.job()["job"])
    journal.close()
    import blake3

    assert job["model"]["weights_digest"] == \
        f"blake3:{blake3.blake3(weights.read_bytes()).hexdigest()}"
    assert job["model"]["model_fingerprint"] == torchverity.fingerprint(
        {"w": torch.full((4,), 0.5)}).root

    # Other weights (re-saved, so their sidecar matches) make another job: refused.
    torchverity.save({"w": torch.full((4,), 0.25)}, weights)
    refused = run_cli(*base, "--weights", weights)
    assert refused.code == 2
    assert "holds a different job" in refused.err and "differs in: model" in refused.err
    assert "--force" in refused.err

    # Corrupted weights: refused before any item, nothing written.
    raw = bytearray(weights.read_bytes())
    raw[-100] ^= 0x01
    weights.write_bytes(raw)
    fresh = tmp_path / "fresh"
    bad = run_cli(*base[:-1], fresh, "--weights", weights)
    assert bad.code == 1, bad.err
    assert "w.pt" in bad.err and "blake3 digest does not match" in bad.err
    assert not fresh.exists()

    # No sidecar at all: the weights cannot be verified, so the job does not start.
    (tmp_path / "w.pt.blake3").unlink()
    missing = run_cli(*base[:-1], fresh, "--weights", weights)
    assert missing.code != 0 and "sidecar" in missing.err
    assert not fresh.exists()


def _linear_predictor(seed: int) -> Any:
    """A real model behind a per-item function, as a golden-checked build() returns it."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 2).eval()

    def predict(item: BatchItem) -> bytes:
        x = torch.frombuffer(bytearray(item.data[:32]), dtype=torch.float32).reshape(1, 8)
        with torch.no_grad():
            return model(x.nan_to_num()).numpy().tobytes()

    predict.model = model  # type: ignore[attr-defined]
    return predict


def test_golden_check_gates_the_job_before_and_after(tmp_path: Path) -> None:
    import torch

    from torchverity.errors import IntegrityError
    from torchverity.golden import record

    make_inputs(tmp_path / "in", 20, nested=False)
    golden = tmp_path / "golden.json"
    good = _linear_predictor(0)
    record(good.model, torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), golden)

    clean = run_batch(tmp_path / "in", good, tmp_path / "clean", golden=golden, name="linear")
    assert clean.ok and verify_batch(tmp_path / "clean").ok

    # Other weights: refused before anything is written.
    with pytest.raises(IntegrityError, match="failed its golden check before the first item"):
        run_batch(tmp_path / "in", _linear_predictor(1), tmp_path / "other", golden=golden,
                  name="linear")
    assert not (tmp_path / "other").exists()

    # One weight bit flips while the job runs (silent corruption on the device):
    # the check after the run fails and this run's outputs are discarded.
    weight_bits = good.model.weight.data.view(torch.int32)

    def flips_midway(item: BatchItem) -> bytes:
        if item.key == "item00010.bin":
            weight_bits[0, 3] ^= 1 << 22
        return good(item)  # type: ignore[no-any-return]

    flips_midway.model = good.model  # type: ignore[attr-defined]
    out = tmp_path / "flipped"
    with pytest.raises(IntegrityError, match=r"after producing this run's outputs.*the 20 "
                       r"outputs this run produced were discarded"):
        run_batch(tmp_path / "in", flips_midway, out, golden=golden, name="linear")
    assert not list((out / "data").iterdir())
    assert {p.kind for p in verify_batch(out).problems} == {"not-done"}

    weight_bits[0, 3] ^= 1 << 22  # the device is fixed: rerun the same job
    again = run_batch(tmp_path / "in", good, out, golden=golden, name="linear")
    assert again.ok and again.processed == 20 and verify_batch(out).ok
    for name in (p.name for p in (out / "data").iterdir()):
        assert (out / "data" / name).read_bytes() == (tmp_path / "clean/data" / name).read_bytes()


def test_force_starts_the_job_again(tmp_path: Path) -> None:
    make_inputs(tmp_path / "in", 4, nested=False)
    out = tmp_path / "out"
    run_batch(tmp_path / "in", _transform, out)
    with pytest.raises(BatchError, match=r"different job .*differs in: model"):
        run_batch(tmp_path / "in", lambda item: item.data, out, name="identity")
    report = run_batch(tmp_path / "in", lambda item: item.data, out, name="identity", force=True)
    assert report.ok and not report.resumed and report.processed == 4
    output = (out / "data/item00000.bin.out").read_bytes()
    assert output == (tmp_path / "in/item00000.bin").read_bytes()


def test_input_list_file_and_output_folder_inside_the_inputs(tmp_path: Path) -> None:
    files = make_inputs(tmp_path / "in", 6, nested=False)
    listing = tmp_path / "in/list.txt"
    listing.write_text("# chosen inputs\nitem00001.bin\n\nitem00004.bin\n")
    out = tmp_path / "in/results"
    report = run_batch(listing, _transform, out)
    assert report.total == 2 and report.ok
    assert sorted(p.name for p in (out / "data").iterdir()) == ["item00001.bin.out",
                                                                 "item00004.bin.out"]
    everything = run_batch(tmp_path / "in", _transform, tmp_path / "in/all")
    assert everything.total == len(files) + 1  # list.txt is an input; job folders never are
    listing.write_text("item00001.bin\nitem00001.bin\n")
    with pytest.raises(Exception, match="listed twice"):
        run_batch(listing, _transform, tmp_path / "dup")


def test_listing_takes_regular_files_at_any_depth_and_nothing_else(tmp_path: Path) -> None:
    from torchverity.batch._inputs import list_inputs

    root = tmp_path / "in"
    files = make_inputs(root, 4)  # in part0/, part1/, part2/
    (root / "a/b/c").mkdir(parents=True)
    (root / "a/b/c/deep.bin").write_bytes(b"deep")
    (root / "link-to-file.bin").symlink_to(root / "a/b/c/deep.bin")  # a file: listed
    (root / "link-to-folder").symlink_to(root / "a")  # not entered: no double listing
    (root / "broken-link").symlink_to(tmp_path / "nowhere")
    (root / "empty").mkdir()
    (root / "old-job/data").mkdir(parents=True)  # another job's folder: never an input
    (root / "old-job" / JOURNAL_NAME).write_bytes(b"")
    (root / "old-job/data/x.out").write_bytes(b"x")
    (root / "results/data").mkdir(parents=True)  # this job's output folder
    (root / "results/data/y.out").write_bytes(b"y")

    records = list_inputs(root, exclude=root / "results")
    expected = {**files, "a/b/c/deep.bin": b"deep", "link-to-file.bin": b"deep"}
    assert [r.key for r in records] == sorted(expected)
    for record in records:
        content = expected[record.key]
        assert record.digest == hashlib.sha256(content).hexdigest(), record.key
        assert record.size == len(content)
        assert record.path == os.fspath(root.resolve() / record.key)
        assert record.mtime_ns == os.stat(record.path).st_mtime_ns
    assert [r.key for r in list_inputs(root)] == sorted([*expected, "results/data/y.out"])


@pytest.mark.parametrize("sizes", [
    (100, 10 * 1024),  # small inputs: listed on one thread
    (64 * 1024, 200 * 1024, 9 * 1024 * 1024),  # large ones: on every core, the last streamed
])
def test_listing_records_each_inputs_size_mtime_and_digest(
    tmp_path: Path, sizes: tuple[int, ...]
) -> None:
    from torchverity.batch._inputs import list_inputs

    expected = {}
    for i in range(6):
        path = tmp_path / f"in/f{i}.bin"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(os.urandom(sizes[i % len(sizes)]))
        raw = path.read_bytes()
        expected[path.name] = (len(raw), path.stat().st_mtime_ns, hashlib.sha256(raw).hexdigest())
    records = list_inputs(tmp_path / "in")
    assert [r.key for r in records] == sorted(expected)
    assert {r.key: (r.size, r.mtime_ns, r.digest) for r in records} == expected


def test_a_second_run_on_the_same_folder_is_refused_while_the_first_works(
    tmp_path: Path,
) -> None:
    import threading

    make_inputs(tmp_path / "in", 4, nested=False)
    out = tmp_path / "out"
    started, release = threading.Event(), threading.Event()

    def slow(item: BatchItem) -> bytes:
        started.set()
        release.wait(30)
        return expected_output(item.data)

    first = threading.Thread(target=run_batch, args=(tmp_path / "in", slow, out))
    first.start()
    try:
        assert started.wait(30)
        with pytest.raises(BatchError, match="another 'torchverity batch run' is working"):
            run_batch(tmp_path / "in", slow, out)
    finally:
        release.set()
        first.join(30)
    assert verify_batch(out).ok


# ------------------------------------------------------------ journal faults


def test_deleted_journal_gives_a_clear_error(tmp_path: Path, run_cli: Callable[..., Any],
                                             model_dir: Path) -> None:
    make_inputs(tmp_path / "in", 5, nested=False)
    out = tmp_path / "out"
    run_batch(tmp_path / "in", _transform, out)
    (out / JOURNAL_NAME).unlink()
    with pytest.raises(BatchError, match="holds outputs in data/ but no journal"):
        run_batch(tmp_path / "in", _transform, out)
    result = run_cli("batch", "verify", out)
    assert result.code == 2
    assert "no batch journal (batch-journal.sqlite) in this folder" in result.err


def test_corrupted_journal_gives_a_clear_error(
    tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    make_inputs(tmp_path / "in", 5, nested=False)
    out = tmp_path / "out"
    run_batch(tmp_path / "in", _transform, out)
    journal = out / JOURNAL_NAME
    raw = bytearray(journal.read_bytes())
    raw[0:16] = b"this is no db!!\0"
    journal.write_bytes(raw)
    with pytest.raises(FormatError, match="the batch journal is damaged"):
        run_batch(tmp_path / "in", _transform, out)
    result = run_cli("batch", "verify", out)
    assert result.code == 2
    assert "batch journal is damaged" in result.err and "next:" in result.err

    # Damage inside a page SQLite reads (not the header) is caught by the integrity check.
    fresh = tmp_path / "out2"
    run_batch(tmp_path / "in", _transform, fresh)
    with sqlite3.connect(fresh / JOURNAL_NAME) as conn:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    raw = bytearray((fresh / JOURNAL_NAME).read_bytes())
    for i in range(page_size + 8, 3 * page_size, 7):
        raw[i] ^= 0xFF
    (fresh / JOURNAL_NAME).write_bytes(raw)
    with pytest.raises(FormatError, match="damaged"):
        verify_batch(fresh)


# ------------------------------------------------------------ full disk, read-only folder


def _namespace_available() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    return probe.returncode == 0


needs_namespace = pytest.mark.skipif(
    not _namespace_available(), reason="needs unshare -rm (user + mount namespaces)"
)


def _in_namespace(
    setup: str, args: list[str], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    script = f"set -e; {setup}; exec {' '.join(map(_quote, args))}"
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], env=env, capture_output=True,
                          text=True, timeout=60)


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


@needs_namespace
@pytest.mark.parametrize(("workers", "count", "size"), [
    ("1", 300, 10_000),  # small items: written on the driver's own thread
    ("2", 30, 100_000),  # by the pool threads
])
def test_full_disk_stops_the_job_with_a_clear_error_and_resumes_after(
    tmp_path: Path, model_dir: Path, workers: str, count: int, size: int
) -> None:
    files = make_inputs(tmp_path / "in", count, size=size, nested=False)  # 3 MB of outputs
    disk = tmp_path / "disk"
    disk.mkdir()
    run = " ".join(map(_quote, cli("batch", "run", "--inputs", tmp_path / "in", "--model",
                                   "tvbatch_model:build", "--out", disk / "out", "--workers",
                                   workers)))
    log = tmp_path / "first.err"
    script = (
        f"mount -t tmpfs -o size=1m tmpfs {disk}; "
        f"{run} 2>{log}; echo first=$? >>{log}; "
        # Free space (grow the filesystem) and rerun the same command: it resumes.
        f"mount -o remount,size=16m {disk}; {run} >/dev/null; "
        f"cp -r {disk}/out {tmp_path}/kept"
    )
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=cli_env(model_dir),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    first = log.read_text()
    assert "first=2" in first
    # Whichever write meets the full disk first, an output or the journal, says so.
    assert re.search(r"(cannot write output .*/data/item\d+\.bin\.out: No space left on device"
                     r"|cannot write the batch journal: database or disk is full)"
                     rf"; the job stopped with \d+ of {count} items committed", first), first
    assert "next: free space or fix permissions of the --out folder, then rerun the same " \
        "command" in first
    assert "Traceback" not in first
    assert verify_batch(tmp_path / "kept").ok
    assert_exactly_once(tmp_path / "kept", files)


@needs_namespace
def test_read_only_output_folder_gives_a_clear_error(tmp_path: Path, model_dir: Path) -> None:
    make_inputs(tmp_path / "in", 3, nested=False)
    out = tmp_path / "out"
    out.mkdir()
    args = cli("batch", "run", "--inputs", tmp_path / "in", "--model", "tvbatch_model:build",
               "--out", out)
    setup = f"mount --bind {out} {out}; mount -o remount,bind,ro {out}"
    result = _in_namespace(setup, args, cli_env(model_dir))
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{out}: the output folder is not writable: Read-only file system" in result.stderr
    assert "next: choose a writable --out folder" in result.stderr
    assert not any(out.iterdir())


@needs_namespace
def test_verify_works_on_a_read_only_copy_of_the_folder(tmp_path: Path, model_dir: Path) -> None:
    make_inputs(tmp_path / "in", 5, nested=False)
    out = tmp_path / "out"
    assert run_batch(tmp_path / "in", _transform, out).ok
    (out / "data/item00002.bin.out").write_bytes(b"tampered")
    setup = f"mount --bind {out} {out}; mount -o remount,bind,ro {out}"
    result = _in_namespace(setup, cli("batch", "verify", out), cli_env(model_dir))
    assert result.returncode == 1, result.stderr
    assert "output-mismatch: item00002.bin: data/item00002.bin.out" in result.stdout


def test_bad_usage_is_refused_before_any_work(tmp_path: Path) -> None:
    make_inputs(tmp_path / "in", 2, nested=False)
    with pytest.raises(Exception, match="output suffix"):
        run_batch(tmp_path / "in", _transform, tmp_path / "out", suffix="")
    with pytest.raises(Exception, match="unknown durability"):
        run_batch(tmp_path / "in", _transform, tmp_path / "out", durability="sometimes")
    with pytest.raises(Exception, match="no such folder or list file"):
        run_batch(tmp_path / "missing", _transform, tmp_path / "out")
    assert not (tmp_path / "out" / JOURNAL_NAME).exists()



def test_progress_bar_shows_items_per_second_and_eta_on_a_terminal() -> None:
    import io

    from torchverity.cli._cmd_batch import _progress
    from torchverity.cli._output import Output

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    err = Terminal()
    with _progress(Output(stderr=err)) as advance:
        for done in range(0, 11):
            advance(done, 10)
            time.sleep(0.01)
    assert "items/s" in err.getvalue() and "10/10" in err.getvalue()
    quiet = io.StringIO()  # not a terminal: nothing drawn
    with _progress(Output(stderr=quiet)) as advance:
        advance(1, 2)
    assert quiet.getvalue() == ""
