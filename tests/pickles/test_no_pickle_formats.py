"""Files a Hugging Face repo holds beside the weights that are no pickle (a Keras HDF5
file, Flax msgpack weights, a sentencepiece tokenizer model, an ONNX model's external
tensor data) are named as what they are, not called broken; the same names given to a
pickle stay pickles, judged by what they would run."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pickle_corpus import run_plain_loader
from torchverity.pickles._scan import scan, scan_file


def _payload(sentinel: Path) -> bytes:
    return b"cposix\nsystem\n(S" + repr(f"touch {sentinel}").encode() + b"\ntR."


def _hdf5() -> bytes:
    """An HDF5 file as its format specification lays out the start (superblock version 0):
    signature, versions, offset/length sizes, B-tree K values, addresses, root group entry."""
    undefined = b"\xff" * 8
    superblock = (b"\x89HDF\r\n\x1a\n" + bytes([0, 0, 0, 0, 0, 8, 8, 0])
                  + struct.pack("<HHI", 4, 16, 0) + struct.pack("<Q", 0) + undefined
                  + struct.pack("<Q", 2048) + undefined
                  + struct.pack("<QQII", 0, 96, 1, 0) + bytes(16))
    return superblock + bytes(2048 - len(superblock))


def _msgpack(obj: Any) -> bytes:
    """msgpack as its specification encodes maps, strings, bins, arrays, ints and bools."""
    if isinstance(obj, dict):
        return bytes([0x80 | len(obj)]) + b"".join(_msgpack(k) + _msgpack(v)
                                                    for k, v in obj.items())
    if isinstance(obj, str):
        data = obj.encode()
        return bytes([0xA0 | len(data)]) + data
    if isinstance(obj, bytes):
        return b"\xc5" + struct.pack(">H", len(obj)) + obj
    if isinstance(obj, bool):
        return b"\xc3" if obj else b"\xc2"
    if isinstance(obj, list):
        return bytes([0x90 | len(obj)]) + b"".join(_msgpack(v) for v in obj)
    assert isinstance(obj, int) and 0 <= obj < 128
    return bytes([obj])


def _flax() -> bytes:
    """What flax.serialization.to_bytes writes for a dense layer's parameters."""
    kernel = np.arange(4, dtype=np.float32).reshape(2, 2)
    array = {"__msgpack_ndarray__": True, "dtype": "float32", "shape": [2, 2],
             "data": kernel.tobytes()}
    return _msgpack({"params": {"dense": {"kernel": array}}})


def _proto_field(number: int, payload: bytes) -> bytes:
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def _sentencepiece() -> bytes:
    """A sentencepiece ModelProto: pieces (piece, score, type), then a trainer spec."""
    out = b""
    for i, piece in enumerate(["<unk>", "<s>", "</s>", "\u2581the", "\u2581a"]):
        kind = 2 if i == 0 else 3 if i < 3 else 1
        entry = _proto_field(1, piece.encode()) + b"\x15" + struct.pack("<f", -float(i))
        out += _proto_field(1, entry + bytes([0x18, kind]))
    return out + _proto_field(2, _proto_field(1, b"train.txt"))


def _onnx_with_external_data(folder: Path) -> tuple[Path, Path]:
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.linspace(-1, 1, 4096, dtype=np.float32)
                                     .reshape(64, 64), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [weight])
    model = folder / "model.onnx"
    onnx.save_model(helper.make_model(graph), model, save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx.data",
                    size_threshold=0)
    return model, folder / "model.onnx.data"


def _repo(folder: Path) -> dict[str, Path]:
    from torch_zip_artifacts import bert

    bert().save_pretrained(folder)
    files = {"tf_model.h5": _hdf5(), "flax_model.msgpack": _flax(),
             "tokenizer.model": _sentencepiece()}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    _onnx_with_external_data(folder)
    return {name: folder / name for name in (*files, "model.onnx.data")}


def test_a_repo_with_non_pickle_formats_passes_naming_each(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    paths = _repo(tmp_path / "repo")
    res = run_cli("scan", "--json", tmp_path / "repo")
    doc = json.loads(res.out)
    assert res.code == 0, (res.out, res.err)
    skipped = {Path(s["path"]).name: s["reason"] for s in doc["skipped"]}
    assert skipped["tf_model.h5"] == "HDF5 file, no pickle"
    assert skipped["flax_model.msgpack"] == "msgpack file, no pickle"
    assert skipped["tokenizer.model"] == "sentencepiece tokenizer model, no pickle"
    assert skipped["model.onnx.data"] == "ONNX external tensor data, no pickle"
    assert {Path(f["path"]).name: f["verdict"] for f in doc["files"]} == {
        "model.safetensors": "safe"}
    formats = {"tf_model.h5": "hdf5", "flax_model.msgpack": "msgpack",
               "tokenizer.model": "sentencepiece", "model.onnx.data": "onnx-data"}
    for name, path in paths.items():  # each given by itself: named, and no check failed
        result = scan_file(path)
        assert (result.verdict, result.format) == ("safe", formats[name]), result
        assert "holds no pickle" in result.reason

    # The same names given to a pickle: judged by what it runs, each in turn.
    sentinel = tmp_path / "SENTINEL"
    for name, path in paths.items():
        good = path.read_bytes()
        path.write_bytes(_payload(sentinel))
        report = scan(tmp_path / "repo")
        (found,) = [r for r in report.results if r.path == os.fspath(path)]
        assert found.verdict == "unsafe" and found.names("dangerous") == ["posix.system"]
        assert not report.ok, name
        path.write_bytes(good)
    assert not sentinel.exists()
    # External data no .onnx beside it names is not taken for it.
    os.remove(tmp_path / "repo" / "model.onnx")
    assert scan_file(paths["model.onnx.data"]).format != "onnx-data"


def test_a_pickle_shaped_as_msgpack_is_walked_not_named(tmp_path: Path) -> None:
    """A polyglot: a msgpack map (0x8c, twelve entries; a string key) to a msgpack reader,
    and to pickle SHORT_BINUNICODE, POP, then a call of os.system. The shape names no
    format: what the unpickler would run does; real Flax bytes are named."""
    flax = tmp_path / "real" / "flax_model.msgpack"
    flax.parent.mkdir()
    flax.write_bytes(_flax())
    assert (scan_file(flax).verdict, scan_file(flax).format) == ("safe", "msgpack")
    live, sentinel = tmp_path / "RAN", tmp_path / "SENTINEL"

    def polyglot(target: Path) -> bytes:
        key = b"kern" + b"e" * 160
        return b"\x8c\xa4" + key + b"0" + _payload(target)

    proof = tmp_path / "proof.msgpack"
    proof.write_bytes(polyglot(live))
    run_plain_loader(proof)
    assert live.exists(), "the payload did not run under pickle.load"
    path = tmp_path / "flax_model.msgpack"
    path.write_bytes(polyglot(sentinel))
    result = scan_file(path)
    assert result.verdict == "unsafe" and result.names("dangerous") == ["posix.system"]
    assert not sentinel.exists()
