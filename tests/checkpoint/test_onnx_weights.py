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


@pytest.fixture(scope="module")
def external(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """torch.onnx.export's default for all but tiny models: weights in model.onnx.data."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256)).eval()
    path = tmp_path_factory.mktemp("onnx-external") / "model.onnx"
    torch.onnx.export(model, (torch.randn(1, 256),), path, dynamo=True, verbose=False)
    assert (path.parent / "model.onnx.data").is_file()
    return path, model


def _copy(path: Path, to: Path, *, data: bool = True) -> Path:
    import shutil

    to.mkdir()
    shutil.copy(path, to / path.name)
    if data:
        shutil.copy(path.parent / "model.onnx.data", to / "model.onnx.data")
    return to / path.name


def test_external_data_is_listed_and_fingerprinted_as_the_state_dict(
        external: tuple[Path, torch.nn.Module], run_cli, tmp_path: Path) -> None:
    from torch_free_probe import cli

    path, model = external
    want = torchverity.fingerprint(model.state_dict())
    assert fingerprint_file(path) == want
    assert fingerprint_file(path, mode="sha256") == torchverity.fingerprint(
        model.state_dict(), mode="sha256")
    result = torchverity.inspect(path)
    assert result.not_loaded is None and result.fingerprint == want.root
    assert sorted((t.name, t.dtype, t.shape, t.nbytes) for t in result.tensors) == [
        ("0.bias", "float32", (256,), 1024), ("0.weight", "float32", (256, 256), 262144)]
    for command in ("inspect", "fingerprint"):
        probed = cli(command, path, "--json")
        assert probed["code"] == 0 and probed["torch"] is False, (command, probed)
        assert want.root in str(probed["out"])
    # One byte of one weight changed in the data file: the fingerprint names that weight.
    changed = _copy(path, tmp_path / "changed")
    data = changed.parent / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    layout = {i.name: {e.key: e.value for e in i.external_data}
              for i in onnx.load(str(path), load_external_data=False).graph.initializer}
    raw[int(layout["0.bias"]["offset"])] ^= 0x01
    data.write_bytes(bytes(raw))
    assert want.differing(fingerprint_file(changed)) == ["0.bias"]
    # verify_export runs the same file (ONNX Runtime reads its data file itself).
    pytest.importorskip("onnxruntime")
    assert torchverity.verify_export(model, (torch.randn(1, 256),), path).ok


def test_missing_or_short_external_data_is_named_with_the_file_to_copy(
        external: tuple[Path, torch.nn.Module], run_cli, tmp_path: Path) -> None:
    path, _ = external
    missing = _copy(path, tmp_path / "missing", data=False)
    with pytest.raises(FormatError, match=r"model\.onnx\.data, which does not exist") as caught:
        fingerprint_file(missing)
    assert "copy model.onnx.data" in (caught.value.hint or "")
    for command in ("inspect", "fingerprint"):
        shown = run_cli(command, missing)
        assert shown.code == 2 and "model.onnx.data, which does not exist" in shown.err
        assert "Traceback" not in shown.err and "restore the file" not in shown.err
    short = _copy(path, tmp_path / "short")
    data = short.parent / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(FormatError, match=r"holds 1000 bytes, but .* needs bytes") as caught:
        torchverity.inspect(short)
    assert caught.value.path == str(data) and "model.onnx.data" in (caught.value.hint or "")


@pytest.mark.parametrize("where", ["dotdot", "absolute", "link"])
def test_external_data_outside_the_models_folder_is_never_read(
        external: tuple[Path, torch.nn.Module], tmp_path: Path, where: str) -> None:
    path, _ = external
    outside = tmp_path / "outside.data"
    outside.write_bytes((path.parent / "model.onnx.data").read_bytes())  # would fit exactly
    model = onnx.load(str(path), load_external_data=False)
    location = {"dotdot": "../outside.data", "absolute": str(outside),
                "link": "model.onnx.data"}[where]
    for init in model.graph.initializer:
        for entry in init.external_data:
            if entry.key == "location":
                entry.value = location
    (tmp_path / "m").mkdir()
    target = tmp_path / "m" / "model.onnx"
    onnx.save(model, str(target))
    if where == "link":
        (tmp_path / "m" / "model.onnx.data").symlink_to(outside)
    before = outside.stat().st_atime_ns
    with pytest.raises(FormatError, match=r"outside the model's folder|leaves the model's folder"):
        fingerprint_file(target)
    with pytest.raises(FormatError, match="it was not read"):
        torchverity.inspect(target)
    assert outside.stat().st_atime_ns == before
    # Inside the folder, through a link that stays in it, the same bytes are read.
    if where == "link":
        (tmp_path / "m" / "model.onnx.data").unlink()
        (tmp_path / "m" / "sub").mkdir()
        outside.rename(tmp_path / "m" / "sub" / "data")
        (tmp_path / "m" / "model.onnx.data").symlink_to("sub/data")
        assert fingerprint_file(target) == fingerprint_file(path)
