"""Files that real loaders read differently than a magic-byte sniffer would, built by the
loaders' own writers where they exist (torch.save, zipfile, numpy, joblib, tarfile).

Each malicious builder returns the loader that runs its payload (proved in a throwaway
subprocess by the tests); every payload would create its own sentinel file.
"""

from __future__ import annotations

import io
import json
import pickle
import struct
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class LoaderCase:
    name: str
    path: Path
    sentinel: Path
    loader: str  # how the plain loader opens it (see LIVE_SCRIPT)
    verdict: str = "unsafe"
    offender: str = "os.system"


def payload(sentinel: Path) -> bytes:
    """Protocol 0: no PROTO opcode, so a sniffer looking for 0x80 misses it."""
    return b"cos\nsystem\n(S" + repr(f"touch {sentinel}").encode() + b"\ntR."


def _sbb(data: bytes) -> bytes:
    return b"B" + struct.pack("<I", len(data)) + data


class _Evil:
    def __init__(self, sentinel: Path) -> None:
        self.cmd = f"touch {sentinel}"

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return os.system, (self.cmd,)


def _torch_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _rewrite(src: bytes, edit: Callable[[str, bytes], tuple[str, bytes]]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(src)) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            name, data = edit(info.filename, zin.read(info.filename))
            zout.writestr(name, data)
    return out.getvalue()


def _npy_bytes(descr: str, body: bytes, shape: str = "(1,)") -> bytes:
    header = f"{{'descr': {descr}, 'fortran_order': False, 'shape': {shape}, }}"
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + body


# ------------------------------------------------------------------ torch


def tar_checkpoint(path: Path, obj_pickle: bytes, *, storage: bool = False) -> Path:
    """torch's pre-1.0 tar layout: storages, tensors and pickle members."""
    if storage:
        storages = (pickle.dumps(1, 2) + pickle.dumps((0, "cpu", torch.FloatStorage), 2)
                    + struct.pack("<q", 3) + struct.pack("<3f", 1, 2, 3) + pickle.dumps([], 2))
        tensors = (pickle.dumps(1, 2) + pickle.dumps((1, 0, torch.FloatTensor), 2)
                   + struct.pack("<ii", 1, 0) + struct.pack("<qq", 3, 1) + struct.pack("<q", 0))
    else:
        storages, tensors = pickle.dumps(0, 2) + pickle.dumps([], 2), pickle.dumps(0, 2)
    sys_info = pickle.dumps({"protocol_version": 1001, "little_endian": True}, 2)
    with tarfile.open(path, "w:", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (("sys_info", sys_info), ("storages", storages),
                           ("tensors", tensors), ("pickle", obj_pickle)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def tar_object_pickle() -> bytes:
    """The object pickle of a benign tar checkpoint: {"w": <tensor 1>} by persistent id."""

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj: object) -> str | None:
            return "1" if obj == "TENSOR" else None

    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump({"w": "TENSOR"})
    return buf.getvalue()


def upper_data_pkl(path: Path, sentinel: Path) -> Path:
    src = _torch_bytes({"w": torch.ones(2)})
    path.write_bytes(_rewrite(src, lambda n, d: (
        (n.replace("data.pkl", "DATA.PKL"), payload(sentinel)) if n.endswith("data.pkl")
        else (n, d))))
    return path


def straddling_frame(sentinel: Path) -> bytes:
    """A frame whose end splits a string: a stream unpickler reads the payload, loads not."""
    run = payload(sentinel)
    size = 10
    body = b"\x80\x04X" + struct.pack("<I", size) + b"ab"
    data = b"\x95" + struct.pack("<Q", len(body)) + body
    return data + b"f" * (size - 2) + b"C" + bytes([len(run) - 1]) + run


def straddle_zip(path: Path, sentinel: Path) -> Path:
    src = _torch_bytes({"w": torch.ones(2)})
    path.write_bytes(_rewrite(src, lambda n, d: (
        (n, straddling_frame(sentinel)) if n.endswith("data.pkl") else (n, d))))
    return path


def polyglot_safetensors(path: Path, sentinel: Path) -> Path:
    """Valid safetensors whose length prefix starts a pickle that hops into the tensor data."""
    run = payload(sentinel)
    n_skip = 0x7E
    length = 0x55 + 256 * n_skip  # b"U" (SHORT_BINSTRING) then its length byte
    prefix = json.dumps({"t": {"dtype": "U8", "shape": [len(run)],
                               "data_offsets": [0, len(run)]}})[:-1] + ', "__metadata__": {"k": "'
    text = bytearray(prefix.encode().ljust(length, b"a"))
    pos, end = 2 + n_skip - 8, length  # in header coordinates
    assert pos > len(prefix)
    text[-4:] = b'"}} '
    while True:  # hop through the string with printable SHORT_BINSTRING lengths
        rest = end - (pos + 2)
        if 40 <= rest <= 126:
            text[pos : pos + 2] = b"U" + bytes([rest])
            break
        hop = 126 if rest > 166 else 60
        text[pos : pos + 2] = b"U" + bytes([hop])
        pos += 2 + hop
    path.write_bytes(struct.pack("<Q", length) + bytes(text) + run)
    return path


def nested_loader_escape(path: Path, sentinel: Path) -> Path:
    """_load_from_bytes called once on a benign archive, then handed (via the memo) to an
    allowlisted rebuild function that calls it on an archive holding a payload."""
    good = _torch_bytes(torch.ones(2))
    evil = _torch_bytes({"x": _Evil(sentinel)})
    data = (b"\x80\x02ctorch.storage\n_load_from_bytes\nq\x00" + _sbb(good) + b"\x85R0"
            + b"ctorch._tensor\n_rebuild_from_type_v2\n(h\x00ctorch\nTensor\n"
            + _sbb(evil) + b"\x85}tR.")
    path.write_bytes(data)
    return path


def nested_second_call(path: Path, sentinel: Path) -> Path:
    """Two calls of the loader through the memo: a benign archive, then one with a payload."""
    good, evil = _torch_bytes(torch.ones(2)), _torch_bytes({"x": _Evil(sentinel)})
    path.write_bytes(b"\x80\x02ctorch.storage\n_load_from_bytes\nq\x00" + _sbb(good)
                     + b"\x85R0h\x00" + _sbb(evil) + b"\x85R.")
    return path


def nested_obj_call(path: Path, sentinel: Path) -> Path:
    """The loader used as an OBJ constructor (protocol 1): OBJ calls any callable."""
    evil = _torch_bytes({"x": _Evil(sentinel)})
    path.write_bytes(b"\x80\x02(ctorch.storage\n_load_from_bytes\n" + _sbb(evil) + b"o.")
    return path


# ------------------------------------------------------------------ numpy / joblib


def prepended_npz(path: Path, sentinel: Path) -> Path:
    """A torch checkpoint with an npz appended: torch and zipfile read two archives."""
    npz = io.BytesIO()
    with zipfile.ZipFile(npz, "w") as z:
        z.writestr("evil.npy", _npy_bytes("'|O'", payload(sentinel)))
    path.write_bytes(_torch_bytes({"w": torch.ones(2)}) + npz.getvalue())
    return path


def npz_member_by_magic(path: Path, sentinel: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        buf = io.BytesIO()
        np.save(buf, np.arange(3))
        z.writestr("ok.npy", buf.getvalue())
        z.writestr("evil", _npy_bytes("'|O'", payload(sentinel)))
    return path


def npy_object_spelling(path: Path, sentinel: Path, descr: str) -> Path:
    path.write_bytes(_npy_bytes(descr, payload(sentinel)))
    return path


def _shape(dims: tuple[int, ...]) -> bytes:
    return b"(" + b"".join(b"M" + struct.pack("<H", d) for d in dims) + b"t"


def _joblib_wrapper(shape_first: tuple[int, ...], shape_last: tuple[int, ...]) -> bytes:
    """A NumpyArrayWrapper of float64 as joblib < 1.2 wrote it (no alignment padding), its
    'shape' key given twice (a real dict keeps the last)."""
    dtype = (b"cnumpy\ndtype\nU\x02f8\x89\x88\x87R(K\x03U\x01<NNNJ\xff\xff\xff\xffJ\xff\xff"
             b"\xff\xffK\x00tb")
    return (b"\x80\x02cjoblib.numpy_pickle\nNumpyArrayWrapper\n)\x81}(U\x08subclass"
            b"cnumpy\nndarray\nU\x05shape" + _shape(shape_first) + b"U\x05orderU\x01CU\x05dtype"
            + dtype + b"U\nallow_mmap\x89U\x05shape" + _shape(shape_last) + b"ub")


def joblib_duplicate_key(path: Path, sentinel: Path) -> Path:
    """joblib's real dict keeps the last 'shape' (nothing to skip): the payload runs."""
    run = payload(sentinel)
    filler = run[:-1] + b"0" + b"N" * (4096 * 8 - len(run)) + b"."
    path.write_bytes(_joblib_wrapper((4096,), (0,)) + b"0" + filler)
    return path


def joblib_array_bytes_payload(path: Path, sentinel: Path) -> Path:
    """Array bytes inline, as joblib writes them: joblib skips them, pickle.load runs them."""
    run = payload(sentinel)
    data = run + b"\x00" * (-len(run) % 8)
    path.write_bytes(_joblib_wrapper((len(data) // 8,), (len(data) // 8,)) + data + b".")
    return path


def joblib_unknown_code(path: Path) -> Path:
    import joblib

    joblib.dump({"a": np.arange(3.0)}, path)
    data = path.read_bytes()
    path.write_bytes(data.replace(b"\x8c\x02f8", b"\x8c\x02Z8", 1))
    return path


def bz_spelling_pickle(path: Path, sentinel: Path) -> Path:
    """A plain pickle whose first bytes spell joblib's bz2 magic ("BZ")."""
    path.write_bytes(b"BZ\x00\x00\x00" + b"x" * 90 + b"0" + payload(sentinel))
    return path


# ------------------------------------------------------------------ live proof


LIVE_SCRIPT = r"""
import io, json, pickle, sys
import numpy as np, torch
cases = json.loads(sys.argv[1])
def run(loader, path):
    if loader == "torch":
        torch.load(path, weights_only=False)
    elif loader == "pickle_stream":
        pickle.load(io.BytesIO(open(path, "rb").read()))
    elif loader == "pickle":
        with open(path, "rb") as fh:
            pickle.load(fh)
    elif loader == "numpy":
        loaded = np.load(path, allow_pickle=True)
        if hasattr(loaded, "files"):
            [loaded[k] for k in loaded.files]
    elif loader == "joblib":
        import joblib
        joblib.load(path)
for loader, path in cases:
    try:
        run(loader, path)
    except Exception:
        pass  # payloads often break the load after they ran
"""
