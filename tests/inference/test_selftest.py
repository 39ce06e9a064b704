"""Hardware self-test on the CPU: clean runs pass, a simulated faulty device is caught."""

from __future__ import annotations

import json

import pytest
import torch

from torchverity.errors import UsageError
from torchverity.selftest import KERNELS, TESTS, FaultyKernels, run_selftest

CLEAN_REPEATS = 5


def _status(result, kernel):
    return {c.status for c in result.checks if c.kernel == kernel}


def test_clean_cpu_passes_every_time():
    for seed in range(CLEAN_REPEATS):
        result = run_selftest("cpu", seed=seed, memory_mb=4)
        assert result.ok, result.failures
        assert result.rounds == 1
        assert len(result.checks) == len(KERNELS) * 3 * len(TESTS) + 1
        assert all(c.status == "pass" and c.runs == 1 for c in result.checks)


def test_seconds_keeps_testing_with_fresh_inputs():
    result = run_selftest("cpu", seconds=1.0, memory_mb=4)
    assert result.ok and result.rounds >= 1
    assert all(c.runs == result.rounds for c in result.checks)


def test_table_is_kernel_by_dtype():
    columns, rows = run_selftest("cpu", memory_mb=4).table()
    assert columns == ["kernel", "float32", "float16", "bfloat16", "int32"]
    assert rows == [
        ["matmul", "pass", "pass", "pass", "-"],
        ["conv2d", "pass", "pass", "pass", "-"],
        ["reduce", "pass", "pass", "pass", "-"],
        ["memory", "-", "-", "-", "pass"],
    ]


@pytest.mark.parametrize(
    ("op", "kernel"), [("mm", "matmul"), ("convolution", "conv2d"), ("sum", "reduce")]
)
def test_faulty_kernel_is_caught_and_located(op, kernel):
    with FaultyKernels(ops=(op,), every=3) as fault:
        result = run_selftest("cpu", memory_mb=0)
    assert fault.hits
    assert not result.ok
    assert {c.kernel for c in result.failures} == {kernel}
    assert _status(result, kernel) & {"FAIL"}
    for other in set(KERNELS) - {kernel}:
        assert _status(result, other) == {"pass"}
    detail = result.failures[0].detail
    assert detail.startswith("round 0: ") and " at [" in detail


def test_lowest_mantissa_bit_fault_is_caught():
    with FaultyKernels(ops=("mm",), every=2, bit=0):
        result = run_selftest("cpu", memory_mb=0)
    failed = {(c.dtype, c.test) for c in result.failures}
    assert not result.ok
    assert {t for _, t in failed} <= {"known-answer", "repeat"}
    assert {d for d, _ in failed} == {"float32", "float16", "bfloat16"}


def test_stuck_memory_bit_is_caught_with_its_address():
    with FaultyKernels(ops=("fill_",), every=1) as fault:
        result = run_selftest("cpu", dtypes=(), memory_mb=1)
    (failure,) = result.failures
    word = fault.hits[0][2]
    assert (failure.kernel, failure.dtype, failure.test) == ("memory", "int32", "pattern")
    assert f"word {word} (byte {4 * word}): wrote 0x0, read 0x2000" in failure.detail


def test_bad_devices_and_dtypes_are_usage_errors():
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="CUDA was asked for"):
            run_selftest("cuda")
    with pytest.raises(UsageError, match="unsupported device"):
        run_selftest("meta")
    with pytest.raises(UsageError, match="cannot test int8"):
        run_selftest("cpu", dtypes=(torch.int8,))


def test_cli_selftest_passes(run_cli):
    result = run_cli("selftest", "--seconds", "0", "--memory-mb", "4")
    assert result.code == 0, result.out
    assert "kernel  float32  float16  bfloat16  int32" in result.out
    assert "selftest passed: 28 checks, 1 round(s)" in result.out


def test_cli_selftest_json_and_failure_exit(run_cli):
    clean = run_cli("selftest", "--seconds", "0", "--memory-mb", "0", "--json")
    doc = json.loads(clean.out)
    assert clean.code == 0 and doc["ok"] is True and doc["device"] == "cpu"
    with FaultyKernels(ops=("mm",), every=3):
        bad = run_cli("selftest", "--seconds", "0", "--memory-mb", "0")
    assert bad.code == 1
    assert "matmul  FAIL" in bad.out and "conv2d  pass" in bad.out
    assert "selftest FAILED" in bad.out and "do not trust it" in bad.err
    if not torch.cuda.is_available():
        nocuda = run_cli("selftest", "--device", "cuda")
        assert nocuda.code == 2 and "CUDA was asked for" in nocuda.err
