"""ONNX models as weight files: their initializers listed and fingerprinted (extra ``onnx``).

Read with ``onnx.load(load_external_data=False)``: protobuf parsing runs nothing
from the file. Initializers become the fingerprint's entries by name, so the
fingerprint covers every weight the exported graph holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchverity.errors import FormatError, require_extra


def is_onnx(path: Path) -> bool:
    """An ``.onnx`` name and a protobuf ModelProto start (field 1, ir_version, a varint)."""
    if path.suffix.lower() != ".onnx" or not path.is_file():
        return False
    with open(path, "rb") as fh:
        return fh.read(1) == b"\x08"


def onnx_initializers(path: Path) -> dict[str, Any]:
    """Every initializer of the graph (and its subgraphs' top level) as a CPU tensor."""
    onnx = require_extra("onnx", extra="onnx", feature=f"reading {path.name}")
    import torch
    from onnx import numpy_helper

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise FormatError(f"{path}: not a readable ONNX model: {exc}", path=path,
                          hint="re-export the model (torch.onnx.export) or restore the file "
                               "from a verified copy") from None
    tensors = {}
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            raise FormatError(f"{path}: initializer '{init.name}' is stored in an external "
                              "data file", path=path,
                              hint="keep the .onnx.data file beside it; fingerprint the "
                                   "folder's files with torchverity manifest")
        tensors[init.name] = torch.from_numpy(numpy_helper.to_array(init).copy())
    return tensors
