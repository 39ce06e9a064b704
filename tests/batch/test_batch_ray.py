"""The Ray engine passes the same end-to-end checks as the local one.

One local Ray cluster for the whole module (``ray.init(num_cpus=2)``). Drivers
run the real CLI in subprocesses that join it and are killed with SIGKILL;
Ray then ends their actors, and the next driver resumes from the journal.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_batch import (
    MODEL_SOURCE,
    assert_exactly_once,
    cli,
    cli_env,
    committed_now,
    expected_output,
    make_inputs,
    wait_for,
)

from torchverity.batch import BatchItem, run_batch, verify_batch

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    # This module's functions pickle by reference to test_batch: workers need its folder.
    tests = str(Path(__file__).parent)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": tests}})
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def test_ray_driver_killed_with_sigkill_then_resumed_gives_exactly_one_output_per_input(
    tmp_path: Path, ray_address: str
) -> None:
    code = tmp_path / "code"
    code.mkdir()
    # Actors of a running cluster do not see the driver's environment, so the per-item
    # delay is written into the model code: 10 ms per item on 2 actors makes each run
    # outlive its first commit point (0.25 s) long enough for the kill below to land
    # while items run, even on a resumed job.
    delayed = MODEL_SOURCE.replace('os.environ.get("TV_BATCH_DELAY", "0")', '"0.01"')
    assert delayed != MODEL_SOURCE
    (code / "tvbatch_model.py").write_text(delayed)
    import torch

    import torchverity

    files = make_inputs(tmp_path / "in", 300)
    weights = tmp_path / "w.pt"
    torchverity.save({"w": torch.full((4,), 0.75)}, weights)  # each actor verifies it
    out = tmp_path / "out"
    args = cli("batch", "run", "--inputs", tmp_path / "in", "--model", "tvbatch_model:build",
               "--weights", weights, "--out", out, "--engine", "ray", "--workers", "2")
    # Ray workers import the model from the driver's working folder, as on a cluster.
    env = cli_env(code, RAY_ADDRESS=ray_address)
    rng = random.Random(7)
    for _ in range(2):
        before = committed_now(out)
        proc = subprocess.Popen(args, env=env, cwd=code, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        wait_for(lambda p=proc, n=before: committed_now(out) > n or p.poll() is not None, 120)
        time.sleep(rng.uniform(0.0, 0.1))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert 0 < committed_now(out) < len(files), "the kill should land while items run"

    final = subprocess.run([*args, "--json"], env=env, cwd=code, capture_output=True,
                           text=True, timeout=180)
    assert final.returncode == 0, final.stderr
    report = json.loads(final.stdout)
    assert report["engine"] == "ray" and report["resumed"] and report["ok"]
    assert report["committed"] == report["total"] == len(files)
    assert not report["problems"] and not report["repaired"]
    assert_exactly_once(out, files, scale=3.0)
    verified = subprocess.run(cli("batch", "verify", out), env=env, capture_output=True,
                              text=True, timeout=60)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_ray_engine_records_changed_inputs_and_failures_by_name(
    tmp_path: Path, ray_address: str
) -> None:
    files = make_inputs(tmp_path / "in", 30, nested=False)
    later = tmp_path / "in/item00027.bin"

    def change_a_later_input(done: int, total: int) -> None:
        if done == 3:
            later.write_bytes(later.read_bytes() + b"changed")

    def fn(item: BatchItem) -> bytes:
        if item.key == "item00011.bin":
            raise ValueError("undecodable")
        return expected_output(item.data)

    out = tmp_path / "out"
    report = run_batch(tmp_path / "in", fn, out, engine="ray", workers=2, retries=1,
                       backoff=0.01, progress=change_a_later_input)
    assert report.engine == "ray"
    assert (report.committed, report.failed, report.changed) == (28, 1, 1)
    problems = {p.key: (p.state, p.error) for p in report.problems}
    assert problems["item00011.bin"] == ("failed", "ValueError: undecodable")
    assert problems["item00027.bin"][0] == "input-changed"
    for key in set(files) - set(problems):
        assert (out / "data" / f"{key}.out").read_bytes() == expected_output(files[key])
    kinds = {(p.kind, p.key) for p in verify_batch(out).problems}
    assert kinds == {("failed", "item00011.bin"), ("input-changed", "item00027.bin")}


def test_ray_actors_each_pass_the_golden_check_or_the_job_does_not_start(
    tmp_path: Path, ray_address: str
) -> None:
    import torch
    from test_batch import _linear_predictor

    from torchverity.errors import IntegrityError
    from torchverity.golden import record

    make_inputs(tmp_path / "in", 12, nested=False)
    golden = tmp_path / "golden.json"
    good = _linear_predictor(0)
    record(good.model, torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), golden)
    report = run_batch(tmp_path / "in", good, tmp_path / "ok", engine="ray", workers=2,
                       golden=golden, name="linear")
    assert report.ok and verify_batch(tmp_path / "ok").ok

    with pytest.raises(IntegrityError, match="failed its golden check before the first item"):
        run_batch(tmp_path / "in", _linear_predictor(1), tmp_path / "bad", engine="ray",
                  workers=1, golden=golden, name="linear")
    assert not list((tmp_path / "bad" / "data").rglob("*.out"))
