"""Globals judged by how they are called, standard-library enums, and nested loaders.

``type(None)`` and ``typing.List[int]`` are calls (``builtins.type``, ``_operator.getitem``)
that build type hints: data. The same globals used any other way (``type`` with three
arguments creates a class, ``getitem`` on anything but a type hint runs that object's code)
keep their module's class, and so do loaders named as globals: ``torch.load`` in a pickle
loads another pickle, proved live here in a throwaway process.
"""

from __future__ import annotations

import http
import os
import pickle
import re
import subprocess
import sys
import typing
from pathlib import Path

import numpy as np
import torch

from torchverity.pickles import scan_file
from torchverity.pickles._classes import BENIGN, DANGEROUS, classify
from torchverity.pickles._values import GlobalRef


def _scan_bytes(path: Path, data: bytes) -> tuple[str, dict[str, tuple[str, str]]]:
    """The verdict, and each global's (class, reason)."""
    path.write_bytes(data)
    result = scan_file(path)
    return result.verdict, {g.name: (g.category, g.reason) for g in result.globals}


def test_calls_that_build_type_hints_are_data(tmp_path: Path) -> None:
    hints = {"opt": typing.Optional[int], "none": type(None),  # noqa: UP045
             "lst": typing.List[int], "tup": typing.Tuple[int, ...]}  # noqa: UP006
    for protocol in (2, 4, 5):
        verdict, found = _scan_bytes(tmp_path / f"hints{protocol}.pkl",
                                     pickle.dumps(hints, protocol))
        assert verdict == "needs-allowlist", (protocol, found)
        getitem, type_ = found["_operator.getitem"], found[
            "__builtin__.type" if protocol < 3 else "builtins.type"]
        assert getitem == (BENIGN, "subscripts a type hint (typing.List[int]): typing data")
        assert type_[0] == BENIGN and type_[1].startswith("type of a value"), type_
        assert {c for c, _ in found.values()} <= {BENIGN, "torch"}, found
    for member in (http.HTTPStatus.OK, re.IGNORECASE | re.MULTILINE):
        verdict, found = _scan_bytes(tmp_path / "enum.pkl", pickle.dumps(member, 2))
        assert verdict == "needs-allowlist", found
        name = f"{type(member).__module__}.{type(member).__name__}"
        assert found[name] == (BENIGN, "standard library enum (a member is its class called "
                                       "with its value)"), found


def test_the_same_globals_used_otherwise_keep_their_class(tmp_path: Path) -> None:
    cases = {
        # type(name, bases, dict): class creation runs metaclass and __init_subclass__ code
        "class_creation": (b"\x80\x02c__builtin__\ntype\n(X\x01\x00\x00\x00Xcbuiltins\n"
                           b"object\n\x85}tR.", "__builtin__.type", "creates classes"),
        # type(None) is data, but the same memoized type is also handed on as a value
        "type_escapes": (b"\x80\x02c__builtin__\ntype\nq\x00N\x85R]q\x01h\x00a\x86.",
                         "__builtin__.type", "creates classes"),
        # getitem on something other than a type hint runs that object's __getitem__
        "getitem_on_an_object": (b"\x80\x02c_operator\ngetitem\ncargparse\nNamespace\n"
                                 b"X\x01\x00\x00\x00a\x86R.", "_operator.getitem",
                                 "attribute access and calls"),
        # the enums of http are data; its clients are not
        "http_client": (b"\x80\x02chttp.client\nHTTPConnection\nX\x07\x00\x00\x00example"
                        b"\x85R.", "http.client.HTTPConnection", "network access"),
    }
    for name, (data, offender, why) in cases.items():
        verdict, found = _scan_bytes(tmp_path / f"{name}.pkl", data)
        assert verdict == "unsafe", (name, found)
        assert found[offender][0] == DANGEROUS and why in found[offender][1], (name, found)


_LIVE = """
import pickle, sys
try:
    with open(sys.argv[1], "rb") as fh:
        pickle.load(fh)
except Exception:
    pass
"""


def _torch_load_payload(root: Path, sentinel: Path) -> Path:
    """A pickle that calls torch.load on a checkpoint holding a payload; a pickle_module
    argument makes torch.load default to weights_only=False."""
    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return os.system, (f"touch {sentinel}",)

    inner = root / "inner.pt"
    torch.save({"x": Evil()}, inner)
    outer = root / "outer.pkl"
    outer.write_bytes(b"ctorch\nload\n(S'" + str(inner).encode()
                      + b"'\nNctorch.serialization\npickle\ntR.")
    return outer


def test_loaders_named_as_globals_are_dangerous(tmp_path: Path) -> None:
    live = tmp_path / "live"
    live.mkdir()
    ran = live / "RAN"
    subprocess.run([sys.executable, "-c", _LIVE, str(_torch_load_payload(live, ran))],
                   check=True, timeout=120, capture_output=True)
    assert ran.exists(), "torch.load in a pickle did not load the inner payload"

    checked = tmp_path / "checked"
    checked.mkdir()
    sentinel = checked / "RAN"
    result = scan_file(_torch_load_payload(checked, sentinel))
    assert result.verdict == "unsafe"
    (hit,) = [g for g in result.globals if g.name == "torch.load"]
    assert hit.category == DANGEROUS and "torch.load unpickles what it reads" in hit.reason
    loaders = ("torch.load", "torch.jit.load", "torch.utils.model_zoo.load_url",
               "torch._weights_only_unpickler.load", "pickle.load", "pickle.loads",
               "_pickle.loads", "numpy.load", "numpy.loadtxt", "numpy.lib._npyio_impl.load",
               "joblib.load", "dill.loads", "cloudpickle.loads", "marshal.loads",
               "pandas.read_pickle", "yaml.unsafe_load", "jsonpickle.decode",
               "lightning.fabric.utilities.cloud_io._load")
    for name in loaders:
        module, _, attr = name.rpartition(".")
        assert classify(GlobalRef(module, attr, 0, "GLOBAL"))[0] == DANGEROUS, name
    # The nested archive pickle.dumps(tensor) embeds stays benign: its bytes are scanned.
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps({"w": torch.ones(3), "a": np.arange(2)}))
    assert scan_file(plain).verdict == "needs-allowlist"
    assert not sentinel.exists()
