"""consistency_check and golden record/check on real small models, clean and corrupted."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import pytest
import torch
from torch import nn

import torchverity
from torchverity import golden
from torchverity.errors import FormatError, InputError, UsageError
from torchverity.selftest import FaultyKernels

CLEAN_REPEATS = 10


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.drop = nn.Dropout(0.5)  # eval mode must switch it off
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.bn(self.c1(x))), 2)
        x = torch.relu(self.c2(x)).mean((2, 3))
        return self.fc(self.drop(x))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(12, 32)
        self.l2 = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.cls = nn.Linear(8, 3)
        self.reg = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.relu(self.body(x))
        return {"logits": self.cls(h), "box": self.reg(h) * scale}


def _cnn() -> tuple[SmallCNN, torch.Tensor]:
    torch.manual_seed(0)
    model = SmallCNN()
    with torch.no_grad():  # non-trivial running stats, so eval-mode BN matters
        model.bn.running_mean.uniform_(-0.1, 0.1)
        model.bn.running_var.uniform_(0.5, 1.5)
    return model, torch.randn(4, 3, 16, 16)


def _mlp() -> tuple[MLP, torch.Tensor]:
    torch.manual_seed(1)
    return MLP(), torch.randn(6, 12)


def _flip_bit(tensor: torch.Tensor, index: int, bit: int) -> None:
    with torch.no_grad():
        tensor.view(-1).view(torch.int32)[index] ^= 1 << bit


def _baseline_recipe_passes(before: torch.Tensor, after: torch.Tensor, tol: float = 1e-4) -> bool:
    """The blog recipe: mean/max/std of the outputs within 1e-4."""
    return all(abs(float(f(before)) - float(f(after))) <= tol
               for f in (torch.mean, torch.max, torch.std))


# ------------------------------------------------------------ consistency_check


@pytest.mark.parametrize("build", [_cnn, _mlp])
def test_consistency_clean_runs_are_identical_every_time(build):
    model, x = build()
    for _ in range(CLEAN_REPEATS):
        result = torchverity.consistency_check(model, x, runs=3)
        assert result.ok and result.identical and result.mode == "exact"
        assert result.where is None and result.max_abs_diff == 0.0


def test_consistency_restores_each_submodules_training_flag():
    model, x = _cnn()
    model.train()
    model.bn.eval()  # a mixed state (frozen BN) must survive unchanged
    torchverity.consistency_check(model, x)
    assert model.training and model.c1.training and model.drop.training
    assert not model.bn.training
    assert x.grad is None and model.fc.weight.grad is None


def test_consistency_catches_faulty_kernel_and_names_run_output_element():
    model, x = _mlp()
    # Two addmm per forward; the 4th call is run 1's last layer, so the
    # flipped element is exactly an output element.
    with FaultyKernels(ops=("addmm",), every=4) as fault:
        result = torchverity.consistency_check(model, x, runs=2)
    (op, call, flat), = fault.hits
    assert (op, call) == ("addmm", 4)
    assert not result.ok and not result.identical and not result.within_tolerance
    assert result.run == 1
    assert result.where == f"output 'output' at {list(golden.unravel(flat, (6, 5)))}"
    assert result.expected != result.actual
    assert "INCONSISTENT" in result.summary()


def test_consistency_low_bit_fault_fails_exact_and_is_within_tolerance():
    model, x = _mlp()
    with FaultyKernels(ops=("addmm",), every=4, bit=0):
        exact = torchverity.consistency_check(model, x, runs=2)
    with FaultyKernels(ops=("addmm",), every=4, bit=0):
        loose = torchverity.consistency_check(model, x, runs=2, exact=False)
    assert not exact.ok and not exact.identical and exact.within_tolerance
    assert loose.ok and not loose.identical and loose.mode == "tolerance"
    assert loose.max_abs_diff > 0


def test_consistency_names_nested_outputs_and_calls_with_kwargs():
    torch.manual_seed(2)
    model = TwoHeads()
    sample = {"x": torch.randn(3, 6), "scale": torch.full((3, 1), 2.0)}
    assert torchverity.consistency_check(model, sample).ok
    with FaultyKernels(ops=("mul",), every=2):
        result = torchverity.consistency_check(model, sample)
    assert not result.ok and result.differing_outputs == ("box",)
    assert result.where is not None and result.where.startswith("output 'box' at [")


def test_consistency_rejects_single_run():
    model, x = _mlp()
    with pytest.raises(UsageError, match="runs >= 2"):
        torchverity.consistency_check(model, x, runs=1)


# ------------------------------------------------------------ golden record / check


@pytest.mark.parametrize("build", [_cnn, _mlp])
def test_golden_clean_check_passes_every_time(build, tmp_path):
    model, x = build()
    rec = golden.record(model, x, tmp_path / "g.json")
    assert rec.outputs[0].shape == (x.shape[0], model.fc.out_features if build is _cnn else 5)
    assert rec.environment["torch"] == torch.__version__
    for _ in range(CLEAN_REPEATS):
        result = golden.check(model, tmp_path / "g.json")
        assert result.ok, result.failures
        assert result.mode == "exact" and result.environment_differences == ()
    assert golden.check(model, tmp_path / "g.json", weights=True).weights_changed == ()


def test_golden_record_file_holds_every_part(tmp_path):
    model, x = _cnn()
    golden.record(model, x, tmp_path / "g.json", sample_size=16)
    doc = json.loads((tmp_path / "g.json").read_text())
    assert doc["format"] == "torchverity-golden" and doc["version"] == 1
    assert doc["inputs"]["fingerprint"] == torchverity.fingerprint({"input": x}).root
    assert doc["model"]["root"] == torchverity.fingerprint(model.state_dict()).root
    out = doc["outputs"][0]
    assert set(out["summary"]) == {"mean", "std", "min", "max"}
    assert len(out["sample"]["index"]) == len(out["sample"]["values"]) == 16
    assert out["sample"]["index"][0] == 0 and out["sample"]["index"][-1] == 39
    assert len(out["digest"]) == 64
    assert {"torch", "device", "device_name", "threads"} <= set(doc["environment"])


def test_golden_catches_one_flipped_weight_bit_the_baseline_misses(tmp_path):
    model, x = _cnn()
    with torch.no_grad():
        model.eval()
        before = model(x)
    golden.record(model, x, tmp_path / "g.json")
    _flip_bit(model.c1.weight, index=7, bit=12)  # a 0.05% change of one weight
    with torch.no_grad():
        after = model(x)
    assert not torch.equal(before, after)
    assert _baseline_recipe_passes(before, after), "the mean/max/std recipe misses this flip"

    result = golden.check(model, tmp_path / "g.json")
    assert not result.ok
    assert result.parts == ["digest", "sample", "summary", "weights"]
    moved = {f.stat for f in result.failures if f.part == "summary"}
    assert "mean" in moved
    mean = next(f for f in result.failures if f.stat == "mean")
    assert mean.expected != mean.actual and "mean of 'output' moved" in mean.message
    assert result.weights_changed == ("c1.weight",)


def test_golden_catches_every_random_flip_that_changes_outputs(tmp_path):
    model, x = _cnn()
    golden.record(model, x, tmp_path / "g.json")
    params = [p for p in model.parameters()]
    rng = random.Random(7)
    changed = caught = 0
    with torch.no_grad():
        model.eval()
        clean = model(x)
    for _ in range(40):
        p = rng.choice(params)
        index, bit = rng.randrange(p.numel()), rng.randrange(31)  # sign bit excluded: 0.0
        _flip_bit(p, index, bit)
        with torch.no_grad():
            differs = not torch.equal(model(x), clean)
        outputs_only = golden.check(model, tmp_path / "g.json", weights=False)
        changed += differs
        assert outputs_only.ok == (not differs)  # outputs: caught exactly when they changed
        # By default the record's fingerprint is compared too: every flip is caught,
        # also one that moves no output bit on the golden inputs.
        caught += not golden.check(model, tmp_path / "g.json").ok
        _flip_bit(p, index, bit)
    assert changed >= 30 and caught == 40
    assert golden.check(model, tmp_path / "g.json").ok


def test_golden_catches_faulty_device(tmp_path):
    model, x = _cnn()
    golden.record(model, x, tmp_path / "g.json")
    # The last layer's addmm: nothing after it can mask the flipped element.
    with FaultyKernels(ops=("addmm",), every=1) as fault:
        result = golden.check(model, tmp_path / "g.json")
    assert len(fault.hits) == 1
    assert not result.ok and result.parts == ["digest", "sample", "summary"]
    assert result.weights_changed == ()  # same weights: the computation changed


def _set_environment(path: Path, **changes: object) -> None:
    doc = json.loads(path.read_text())
    doc["environment"].update(changes)
    path.write_text(json.dumps(doc))


def test_golden_other_environment_uses_tolerances(tmp_path):
    model, x = _cnn()
    path = tmp_path / "g.json"
    golden.record(model, x, path)
    _set_environment(path, torch="2.0.0", device_name="Another CPU")
    for _ in range(CLEAN_REPEATS):
        result = golden.check(model, path)
        assert result.ok and result.mode == "tolerance"
    assert result.environment_differences == (
        "torch: '2.0.0' -> " + repr(torch.__version__),
        f"device_name: 'Another CPU' -> {golden.device_name(torch.device('cpu'))!r}",
    )
    _flip_bit(model.c1.weight, index=7, bit=12)
    # Outputs stay within cross-device tolerance: only exact outputs see it ...
    assert golden.check(model, path, weights=False).ok
    assert not golden.check(model, path, exact=True, weights=False).ok
    assert golden.check(model, path).parts == ["weights"]  # ... and the weights' fingerprint
    _flip_bit(model.c1.weight, index=7, bit=12)
    _flip_bit(model.fc.bias, index=3, bit=29)  # an exponent bit: a large change
    result = golden.check(model, path)
    assert not result.ok and "digest" not in result.parts
    assert {"sample", "summary", "weights"} <= set(result.parts)
    sample = next(f for f in result.failures if f.part == "sample")
    assert ", 3]:" in sample.message  # the corrupted bias feeds output column 3


def test_golden_thread_count_change_switches_to_tolerance(tmp_path):
    model, x = _mlp()
    golden.record(model, x, tmp_path / "g.json")
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        result = golden.check(model, tmp_path / "g.json")
    finally:
        torch.set_num_threads(threads)
    assert result.ok and result.mode == "tolerance"
    assert result.environment_differences == (f"threads: {threads} -> {threads + 1}",)


def test_golden_damaged_inputs_are_reported_not_run(tmp_path):
    model, x = _mlp()
    path = tmp_path / "g.json"
    golden.record(model, x, path)
    doc = json.loads(path.read_text())
    raw = bytearray(base64.b64decode(doc["inputs"]["tensors"][0]["data"]))
    raw[5] ^= 0x10
    doc["inputs"]["tensors"][0]["data"] = base64.b64encode(bytes(raw)).decode()
    path.write_text(json.dumps(doc))
    result = golden.check(model, path)
    assert not result.ok and result.parts == ["inputs"]
    assert "golden file is damaged" in result.failures[0].message


def test_golden_structure_and_nonfinite_changes(tmp_path):
    torch.manual_seed(3)
    model = TwoHeads()
    sample = (torch.randn(4, 6), torch.ones(4, 1))
    path = tmp_path / "g.json"
    rec = golden.record(model, sample, path)
    assert [o.name for o in rec.outputs] == ["logits", "box"]
    assert golden.check(model, path).ok
    with torch.no_grad():
        model.reg.bias.fill_(float("nan"))
    result = golden.check(model, path)
    nonfinite = next(f for f in result.failures if f.part == "nonfinite")
    assert nonfinite.output == "box" and (nonfinite.expected, nonfinite.actual) == (0, 4)
    other = TwoHeads()
    other.cls = nn.Linear(8, 4)
    result = golden.check(other, path)
    structure = next(f for f in result.failures if f.part == "structure")
    assert structure.message == "output 'logits' was float32[4, 3], now float32[4, 4]"


def test_golden_nan_outputs_recorded_and_rechecked(tmp_path):
    model, x = _mlp()
    with torch.no_grad():
        model.l2.bias[1] = float("nan")
    golden.record(model, x, tmp_path / "g.json")
    doc = json.loads((tmp_path / "g.json").read_text())
    assert doc["outputs"][0]["nonfinite"] == 6
    for _ in range(3):
        assert golden.check(model, tmp_path / "g.json").ok


def test_golden_bfloat16_model(tmp_path):
    model, x = _mlp()
    model = model.to(torch.bfloat16)
    x = x.to(torch.bfloat16)
    golden.record(model, x, tmp_path / "g.json")
    assert golden.check(model, tmp_path / "g.json").ok
    _flip_bit(model.l2.weight.view(-1)[:2].view(torch.float32), index=0, bit=3)
    result = golden.check(model, tmp_path / "g.json")
    assert not result.ok and result.weights_changed == ("l2.weight",)


def test_golden_bad_files(tmp_path):
    model, x = _mlp()
    with pytest.raises(InputError, match="no such golden file"):
        golden.check(model, tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(FormatError, match="not a readable golden file"):
        golden.check(model, tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"format": "else"}))
    with pytest.raises(FormatError, match="not a torchverity golden file"):
        golden.check(model, tmp_path / "other.json")
    golden.record(model, x, tmp_path / "g.json")
    doc = json.loads((tmp_path / "g.json").read_text())
    del doc["outputs"][0]["digest"]
    (tmp_path / "g.json").write_text(json.dumps(doc))
    with pytest.raises(FormatError, match="malformed golden file"):
        golden.check(model, tmp_path / "g.json")
    with pytest.raises(UsageError, match="must all be tensors"):
        golden.record(model, (x, 3), tmp_path / "h.json")


# ------------------------------------------------------------ CLI


MODEL_MODULE = '''
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 8 * 8, 5))
'''


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    (tmp_path / "tv_golden_cli_models.py").write_text(MODEL_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import tv_golden_cli_models

    state = tv_golden_cli_models.build().state_dict()
    torchverity.save(state, tmp_path / "good.pt")
    _flip_bit(state["3.weight"], index=11, bit=12)
    torchverity.save(state, tmp_path / "flipped.pt")  # valid sidecar: no file check sees it
    return tmp_path


def test_cli_golden_record_check_and_flipped_bit(run_cli, model_dir):
    model = ("--model", "tv_golden_cli_models:build")
    rec = run_cli("golden", "record", *model, "--weights", "good.pt", "--golden", "g.json",
                  "--shape", "2,3,8,8")
    assert rec.code == 0, rec.err
    assert "recorded g.json: 1 output(s) on cpu" in rec.out
    ok = run_cli("golden", "check", *model, "--weights", "good.pt", "--golden", "g.json")
    assert ok.code == 0 and "golden check passed" in ok.out and "exact mode" in ok.out
    bad = run_cli("golden", "check", *model, "--weights", "flipped.pt", "--golden", "g.json")
    assert bad.code == 1
    assert "failed parts: digest, sample, summary, weights" in bad.out
    assert "mean of 'output' moved" in bad.out and "(3.weight)" in bad.out
    assert "torchverity selftest --device cpu" in bad.err
    js = run_cli("golden", "check", *model, "--weights", "flipped.pt", "--golden", "g.json",
                 "--json")
    doc = json.loads(js.out)
    assert js.code == 1 and doc["ok"] is False and doc["weights_changed"] == ["3.weight"]
    assert {f["part"] for f in doc["failures"]} == {"digest", "sample", "summary", "weights"}


def test_cli_golden_inputs_file_and_usage_errors(run_cli, model_dir):
    torch.save(torch.randn(1, 3, 8, 8), model_dir / "inputs.pt")
    model = ("--model", "tv_golden_cli_models:build", "--weights", "good.pt")
    rec = run_cli("golden", "record", *model, "--golden", "g.json", "--inputs", "inputs.pt",
                  "--json")
    assert rec.code == 0 and json.loads(rec.out)["record"]["outputs"][0]["shape"] == [1, 5]
    both = run_cli("golden", "record", *model, "--golden", "h.json")
    assert both.code == 2 and "exactly one of --inputs FILE or --shape" in both.err
    missing = run_cli("golden", "check", *model, "--golden", "nope.json")
    assert missing.code == 2 and "no such golden file" in missing.err
    nocuda = run_cli("golden", "check", *model, "--golden", "g.json", "--device", "cuda")
    if not torch.cuda.is_available():
        assert nocuda.code == 2 and "CUDA was asked for" in nocuda.err


def test_cli_golden_refuses_malicious_weights_without_running_them(run_cli, model_dir):
    sentinel = model_dir / "pwned"

    class Payload:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {sentinel}",))

    torch.save({"3.weight": Payload()}, model_dir / "evil.pt")
    result = run_cli("golden", "record", "--model", "tv_golden_cli_models:build",
                     "--weights", "evil.pt", "--golden", "g.json", "--shape", "1,3,8,8")
    assert result.code != 0
    assert not sentinel.exists()
    assert not (model_dir / "g.json").exists()


def test_cli_golden_check_in_a_fresh_process_is_exact(run_cli, model_dir):
    import os
    import subprocess
    import sys

    model = ("--model", "tv_golden_cli_models:build", "--weights", "good.pt")
    assert run_cli("golden", "record", *model, "--golden", "g.json", "--shape", "8,3,8,8").code == 0
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()),
           "PYTHONPATH": str(model_dir)}
    done = subprocess.run(
        [sys.executable, "-m", "torchverity", "golden", "check", *model, "--golden", "g.json"],
        cwd=model_dir, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "exact mode, same environment" in done.stdout
