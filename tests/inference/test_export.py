"""verify_export against ONNX Runtime, torch.export, TorchScript and torch.compile."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import torchverity
from torchverity.errors import InputError, UsageError

onnx = pytest.importorskip("onnx")
numpy_helper = pytest.importorskip("onnx.numpy_helper")
pytest.importorskip("onnxruntime")


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    return model, torch.randn(5, 8)


def _cnn() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(4, 3)).eval()
    return model, torch.randn(2, 3, 8, 8)


class _TwoInputs(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.inner(a + b)


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory) -> Path:
    model, x = _mlp()
    path = tmp_path_factory.mktemp("onnx") / "mlp.onnx"
    torch.onnx.export(model, (x,), path, dynamo=True, external_data=False, verbose=False)
    return path


def test_onnx_round_trip_passes(onnx_file):
    model, x = _mlp()
    for exported in (onnx_file, str(onnx_file), onnx.load(onnx_file)):
        result = torchverity.verify_export(model, x, exported)
        assert result.ok and result.status == "ok" and result.kind == "onnx"
        assert result.max_abs_diff < 1e-5


def test_altered_onnx_graph_fails_at_the_altered_column(onnx_file):
    model, x = _mlp()
    proto = onnx.load(onnx_file)
    bias = next(i for i in proto.graph.initializer if i.name.endswith("2.bias"))
    values = numpy_helper.to_array(bias).copy()
    values[2] += 0.05
    bias.CopyFrom(numpy_helper.from_array(values, bias.name))
    result = torchverity.verify_export(model, x, proto)
    assert not result.ok and result.status == "mismatch"
    assert result.worst is not None and result.worst.endswith(", 2]")
    assert result.actual - result.expected == pytest.approx(0.05, rel=1e-3)
    assert result.outputs[0].mismatched == 5  # every row of column 2


def test_altered_onnx_operator_fails(onnx_file):
    model, x = _mlp()
    proto = onnx.load(onnx_file)
    relu = next(n for n in proto.graph.node if n.op_type == "Relu")
    relu.op_type = "Abs"
    result = torchverity.verify_export(model, x, proto)
    assert not result.ok and result.max_abs_diff > 1e-3


def test_onnx_built_from_the_model_passes():
    model, x = _cnn()
    result = torchverity.verify_export(model, x, "onnx")
    assert result.ok and result.kind == "onnx"


def test_torch_export_program_and_file(tmp_path):
    model, x = _cnn()
    assert torchverity.verify_export(model, x, "torch.export").ok
    program = torch.export.export(model, (x,))
    torch.export.save(program, tmp_path / "cnn.pt2")
    result = torchverity.verify_export(model, x, tmp_path / "cnn.pt2")
    assert result.ok and result.kind == "torch.export"
    drifted = copy.deepcopy(model)
    with torch.no_grad():
        drifted[4].weight[1, 0] += 0.5
    result = torchverity.verify_export(model, x, torch.export.export(drifted, (x,)))
    assert not result.ok and result.worst is not None and result.worst.endswith(", 1]")


def test_torchscript(tmp_path):
    model, x = _mlp()
    assert torchverity.verify_export(model, x, "torchscript").ok
    drifted = copy.deepcopy(model)
    with torch.no_grad():
        drifted[2].bias[0] -= 1.0
    result = torchverity.verify_export(model, x, torch.jit.trace(drifted, (x,)))
    assert not result.ok and result.kind == "torchscript"
    assert result.expected - result.actual == pytest.approx(1.0, rel=1e-5)


def test_torch_compile_matches_eager():
    model, x = _mlp()
    result = torchverity.verify_export(model, x, "torch.compile")
    assert result.ok and result.status == "ok" and result.kind == "torch.compile"


def test_torch_compile_without_cpp_compiler_is_skipped_with_reason(monkeypatch):
    model, x = _mlp()
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    result = torchverity.verify_export(model, x, "torch.compile")
    assert result.status == "skipped"
    assert result.reason is not None and "needs a C++ compiler" in result.reason


def test_structure_mismatches():
    model, x = _mlp()
    result = torchverity.verify_export(model, x, lambda t: model(t)[:, :3])
    assert not result.ok and result.reason == "output 'output' has shape [5, 3], eager [5, 4]"
    result = torchverity.verify_export(model, x, lambda t: (model(t), model(t)))
    assert not result.ok and result.reason == "eager returns 1 output(s), function returns 2"


def test_bad_arguments(tmp_path, onnx_file):
    model, x = _mlp()
    with pytest.raises(UsageError, match="positional inputs"):
        torchverity.verify_export(model, {"x": x}, onnx_file)
    with pytest.raises(InputError, match="no such exported model"):
        torchverity.verify_export(model, x, tmp_path / "nope.onnx")
    (tmp_path / "m.bin").write_bytes(b"\0")
    with pytest.raises(UsageError, match=r"unknown exported model type '\.bin'"):
        torchverity.verify_export(model, x, tmp_path / "m.bin")
    with pytest.raises(UsageError, match="takes 1 input"):
        torchverity.verify_export(_TwoInputs(model), (x, x), onnx_file)


def test_a_sample_the_onnx_graph_refuses_is_named_with_what_it_takes(onnx_file):
    """onnxruntime's own exceptions do not leak: the error names the sample and the inputs
    the graph takes."""
    for sample in (torch.randn(5, 9), torch.randn(5, 8, dtype=torch.float64)):
        with pytest.raises(UsageError, match="the ONNX graph refused the sample") as refused:
            torchverity.verify_export(nn.Identity(), sample, onnx_file)
        assert "the graph takes" in (refused.value.hint or "")
