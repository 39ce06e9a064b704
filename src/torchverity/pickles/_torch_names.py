"""The torch names a plain ``torch.save`` state dict pickles, known without importing torch.

Each name in ``MODELED`` is in torch's weights_only allowlist (a test checks it against
the installed torch), so the scanner answers for them without asking torch, and the
inert zip listing (:mod:`torchverity.pickles._listing`) builds stand-ins for exactly them.
"""

from __future__ import annotations

# torch's dtype name -> bytes per element, for every dtype a zip checkpoint can name.
ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4,
    "int64": 8, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
}
# The typed storage classes torch.save names (others go through UntypedStorage + dtype).
STORAGES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
}
# The callables and classes a state dict's pickle calls, besides storages and dtypes.
CALLABLES = (
    "collections.OrderedDict", "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_tensor_v3", "torch._utils._rebuild_parameter", "torch.Size",
    "torch.device", "torch.storage.UntypedStorage",
)
MODELED = frozenset((*CALLABLES, *(f"torch.{n}" for n in (*STORAGES, *ITEMSIZE))))
