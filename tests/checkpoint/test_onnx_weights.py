"""ONNX files from torch.onnx.export: inspect lists the initializers, fingerprint covers
them (a changed initializer changes it, an identical re-export does not), load names the
format with a next step that is not load.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import torchverity
from torchverity.checkpoint import fingerprint_file
from torchverity.errors import FormatError

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    path = tmp_path_factory.mktemp("onnx") / "model.onnx"
    torch.onnx.export(model.eval(), (torch.randn(1, 4),), path, dynamo=True,
                      external_data=False, verbose=False)
    return path


def test_inspect_lists_initializers_and_fingerprint_covers_them(exported: Path, run_cli,
                                                                tmp_path: Path) -> None:
    result = torchverity.inspect(exported)
    assert result.format == "onnx" and result.not_loaded is None
    shapes = sorted(t.shape for t in result.tensors)
    assert (2,) in shapes and (8,) in shapes and len(result.tensors) == 4
    fp = fingerprint_file(exported)
    assert fp.root == result.fingerprint and len(fp.entries) == 4
    shown = run_cli("inspect", exported)
    assert shown.code == 0 and "4 tensors" in shown.out
    # One initializer value changed: the fingerprint names it.
    model = onnx.load(str(exported))
    init = model.graph.initializer[0]
    array = onnx.numpy_helper.to_array(init).copy()
    array.flat[0] += 1.0
    init.CopyFrom(onnx.numpy_helper.from_array(array, init.name))
    changed = tmp_path / "changed.onnx"
    onnx.save(model, str(changed))
    assert fp.differing(fingerprint_file(changed)) == [init.name]


def test_inspect_and_fingerprint_read_onnx_without_torch_as_torch_would(
        exported: Path) -> None:
    from torch_free_probe import cli
    from torchverity.checkpoint._fingerprint import fingerprint
    from torchverity.checkpoint._onnx import onnx_initializers

    as_tensors = fingerprint(onnx_initializers(exported))  # the same initializers via torch
    assert fingerprint_file(exported) == as_tensors
    for command in ("inspect", "fingerprint"):
        probed = cli(command, exported, "--json")
        assert probed["code"] == 0 and probed["torch"] is False, (command, probed)
        assert as_tensors.root in str(probed["out"])


def test_load_names_onnx_and_points_elsewhere(exported: Path) -> None:
    with pytest.raises(FormatError, match="an ONNX model") as caught:
        torchverity.load(exported)
    assert "onnxruntime" in (caught.value.hint or "")
    assert "torchverity.load" not in (caught.value.hint or "")
