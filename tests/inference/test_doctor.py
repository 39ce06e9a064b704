"""torchverity doctor: load-safety report checked against torch's real behaviour."""

from __future__ import annotations

import fractions
import json

import pytest
import torch

from torchverity.doctor import FORCE_SAFE, FORCE_UNSAFE, diagnose, weights_only_status
from torchverity.selftest import FaultyKernels


def _levels(report, topic):
    return [f.level for f in report.findings if f.topic == topic]


def test_weights_only_status_reads_the_variables_like_torch():
    assert weights_only_status({})["effective"] == "True unless the caller passes weights_only"
    assert weights_only_status({FORCE_SAFE: "YES"})["effective"].startswith("True for every")
    assert weights_only_status({FORCE_UNSAFE: "1"})["effective"].startswith("False for calls")
    assert weights_only_status({FORCE_UNSAFE: "0"})["effective"].startswith("True unless")
    both = weights_only_status({FORCE_SAFE: "1", FORCE_UNSAFE: "true"})
    assert both["effective"].startswith("error")
    assert both[FORCE_SAFE] == "1" and both[FORCE_UNSAFE] == "true"


@pytest.fixture
def fraction_file(tmp_path):
    """A checkpoint holding a type outside the weights_only allowlist."""
    path = tmp_path / "fraction.pt"
    torch.save({"third": fractions.Fraction(1, 3)}, path)
    return path


def test_reported_effect_matches_torch_load(fraction_file, monkeypatch):
    monkeypatch.delenv(FORCE_SAFE, raising=False)
    monkeypatch.delenv(FORCE_UNSAFE, raising=False)
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(fraction_file)  # default: safe, as doctor says
    monkeypatch.setenv(FORCE_UNSAFE, "1")
    assert "arbitrary code" in weights_only_status()["effective"]
    with pytest.warns(UserWarning, match=FORCE_UNSAFE):
        # now it unpickles full objects
        assert torch.load(fraction_file)["third"] == fractions.Fraction(1, 3)
    monkeypatch.delenv(FORCE_UNSAFE)
    monkeypatch.setenv(FORCE_SAFE, "1")
    assert "even those passing weights_only=False" in weights_only_status()["effective"]
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(fraction_file, weights_only=False)


def test_diagnose_clean_machine():
    report = diagnose()
    assert report.ok
    assert report.versions["torch"] == torch.__version__
    assert report.versions["python"].count(".") == 2
    assert _levels(report, "weights_only") == ["ok"]
    assert _levels(report, "selftest") == ["ok"]
    assert report.selftests[0].device == "cpu" and report.selftests[0].ok
    assert set(report.determinism) >= {"deterministic_algorithms", "cudnn_benchmark"}
    if not report.gpus["available"]:
        assert "nvidia-ml-py" in report.gpus["reason"] or "NVML" in report.gpus["reason"]


def test_diagnose_flags_unsafe_load_and_failed_selftest(monkeypatch):
    monkeypatch.setenv(FORCE_UNSAFE, "1")
    with FaultyKernels(ops=("mm",), every=2):
        report = diagnose()
    assert not report.ok
    assert _levels(report, "weights_only") == ["warn"]
    (fail,) = [f for f in report.findings if f.level == "fail"]
    assert fail.topic == "selftest" and "matmul float32" in fail.message
    assert fail.hint == "rerun longer: torchverity selftest --device cpu --seconds 60"


def test_deterministic_algorithms_reported():
    torch.use_deterministic_algorithms(True)
    try:
        report = diagnose(selftest=False)
    finally:
        torch.use_deterministic_algorithms(False)
    assert report.determinism["deterministic_algorithms"] is True
    assert report.selftests == ()
    if not torch.cuda.is_available():
        assert _levels(report, "determinism") == ["ok"]


def test_cli_doctor_human_and_json(run_cli, monkeypatch):
    monkeypatch.delenv(FORCE_SAFE, raising=False)
    monkeypatch.delenv(FORCE_UNSAFE, raising=False)
    human = run_cli("doctor")
    assert human.code == 0, human.out
    assert f"torch        {torch.__version__}" in human.out
    assert "ok    weights_only" in human.out and "doctor: ok" in human.out
    js = run_cli("doctor", "--json", "--no-selftest")
    doc = json.loads(js.out)
    assert js.code == 0 and doc["ok"] is True and doc["selftests"] == []
    assert doc["weights_only"]["torch_default"] is True


def test_cli_doctor_fails_when_both_variables_set(run_cli, monkeypatch):
    monkeypatch.setenv(FORCE_SAFE, "1")
    monkeypatch.setenv(FORCE_UNSAFE, "1")
    result = run_cli("doctor", "--no-selftest")
    assert result.code == 1
    assert "FAIL  weights_only" in result.out and "doctor: FAILED" in result.out
    assert f"weights_only: next: unset {FORCE_UNSAFE}" in result.err
