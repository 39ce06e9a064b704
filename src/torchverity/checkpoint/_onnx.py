"""ONNX models as weight files: their initializers listed and fingerprinted (extra ``onnx``).

Read with ``onnx.load(load_external_data=False)``: protobuf parsing runs nothing
from the file. Initializers become the fingerprint's entries by name, so the
fingerprint covers every weight the exported graph holds. Listing and fingerprinting
need no torch (numpy arrays hashed as torch would hash the same tensors); torch is
imported only for initializers of a dtype numpy does not share with torch (bfloat16).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchverity.errors import FormatError, require_extra

if TYPE_CHECKING:
    from torchverity.checkpoint._fp_record import Fingerprint

# numpy dtypes whose name, element size and bytes are torch's too
_SHARED_DTYPES = frozenset({"bool", "uint8", "int8", "int16", "int32", "int64", "float16",
                            "float32", "float64", "complex64", "complex128"})


def is_onnx(path: Path) -> bool:
    """An ``.onnx`` name and a protobuf ModelProto start (field 1, ir_version, a varint)."""
    if path.suffix.lower() != ".onnx" or not path.is_file():
        return False
    with open(path, "rb") as fh:
        return fh.read(1) == b"\x08"


def onnx_initializers(path: Path) -> dict[str, Any]:
    """Every initializer of the graph (and its subgraphs' top level) as a CPU tensor."""
    import torch

    return {name: torch.from_numpy(array.copy()) for name, array in _arrays(path).items()}


def onnx_arrays(path: Path) -> dict[str, Any] | None:
    """The initializers as little-endian numpy arrays, without torch; None when one has a
    dtype numpy does not share with torch (then :func:`onnx_initializers` reads them)."""
    arrays = _arrays(path)
    if any(a.dtype.name not in _SHARED_DTYPES for a in arrays.values()):
        return None
    return {n: a.astype(a.dtype.newbyteorder("<"), copy=False) for n, a in arrays.items()}


def _arrays(path: Path) -> dict[str, Any]:
    onnx = require_extra("onnx", extra="onnx", feature=f"reading {path.name}")
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
        tensors[init.name] = numpy_helper.to_array(init)
    return tensors


Row = tuple[str, str, tuple[int, ...], int]


def onnx_contents(path: Path, algo: str) -> tuple[list[Row], Fingerprint] | None:
    """``([(name, dtype, shape, nbytes)], fingerprint)`` of the initializers, without torch;
    None where :func:`onnx_arrays` is."""
    from torchverity.checkpoint._fp_record import TensorDigest, from_entries, plain_tensor_hasher

    arrays = onnx_arrays(path)
    if arrays is None:
        return None
    rows, entries = [], []
    for name, array in arrays.items():
        # The array's own bytes, viewed, not copied (onnx_arrays made them little-endian).
        shape, data = tuple(int(n) for n in array.shape), _byte_view(array)
        hasher = plain_tensor_hasher(name, array.dtype.name, shape, data.nbytes, algo)
        hasher.update(data)
        rows.append((name, array.dtype.name, shape, data.nbytes))
        entries.append(TensorDigest(name, array.dtype.name, shape, hasher.hexdigest()))
    return rows, from_entries(algo, entries)


def _byte_view(array: Any) -> memoryview:
    import numpy as np

    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data
