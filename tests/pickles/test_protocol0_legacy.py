"""torch.save files written with pickle_protocol=0 or 1, legacy (pre-1.6) layout and zip.

At protocol 0 the pickler writes torch's persistent id tuple as its repr (PERSID),
which torch.load rejects whatever ``weights_only`` says ("saved_id must be a tuple").
Such a file is intact: inspect lists it (exit 0, never "damaged"), fingerprint gives the
fingerprint of the same tensors saved normally, migrate converts it bit for bit, and scan
says in one line per cause why torch cannot read it. Protocol 1 pickles its ids as
tuples: a full torch.load reads it, the weights_only one does not. An id text torch never
writes is refused, and nothing in it is evaluated.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import torchverity
from torchverity.errors import FormatError

# Bit patterns a value-level comparison would blur: -0.0 and a NaN.
_BASE = torch.tensor([1.5, -0.0, float("nan"), 3.25, 4.0, -7.5, 1e-30, 8.0, 9.0, 10.0])


def _tensors() -> dict[str, torch.Tensor]:
    """Views sharing one storage, and dtypes other than float32."""
    return {"a": _BASE, "b": _BASE[2:5], "i": torch.arange(4, dtype=torch.int64) - 2,
            "h": torch.tensor([0.5, -2.0], dtype=torch.float16),
            "bf": torch.tensor([3.0, -0.0], dtype=torch.bfloat16)}


def _save(path: Path, protocol: int, *, legacy: bool = True) -> Path:
    torch.save(_tensors(), path, _use_new_zipfile_serialization=not legacy,
               pickle_protocol=protocol)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("protocol0")
    return {"p0": _save(root / "p0.pt", 0), "p1": _save(root / "p1.pt", 1),
            "zip_p0": _save(root / "zip_p0.pt", 0, legacy=False),
            "normal": _save(root / "normal.pt", 2, legacy=False)}


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _same_bits(got: dict[str, torch.Tensor]) -> None:
    want = _tensors()
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert _bits(got[name]) == _bits(t), name


def test_torch_load_reads_no_protocol_0_file(files: dict[str, Path]) -> None:
    from torchverity.pickles import explain_exception

    for name in ("p0", "zip_p0"):
        with pytest.raises(Exception, match="Weights only load failed"):
            torch.load(files[name], weights_only=True)
        with pytest.raises(AssertionError, match="saved_id must be a tuple, got str") as info:
            torch.load(files[name], weights_only=False)  # our own file: nothing to run
        found = explain_exception(info.value)
        assert found is not None and found.key == "protocol-0-persistent-ids"
        assert found.command.startswith("torchverity migrate")
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(files["p1"], weights_only=True)
    _same_bits(torch.load(files["p1"], weights_only=False))


@pytest.mark.parametrize("name", ["p0", "zip_p0"])
def test_inspect_calls_a_protocol_0_file_intact(files: dict[str, Path], name: str,
                                                run_cli: Callable[..., Any]) -> None:
    path = files[name]
    res = run_cli("inspect", path)
    assert res.code == 0, res
    assert "damaged" not in res.out + res.err and "restore" not in res.err
    assert f"{path}: {'pt-legacy' if name == 'p0' else 'pt'} checkpoint at pickle protocol 0 " \
           "(no torch.load setting reads it)" in res.out
    assert "scan        safe (torch.load cannot read it, with any weights_only setting)" in res.out
    assert f"torchverity: {path}: intact, but torch.load cannot read it" in res.err
    assert f"next: torchverity migrate {path} NEW.safetensors" in res.err
    doc = json.loads(run_cli("inspect", "--json", path).out)
    assert doc["ok"] and sorted(t["name"] for t in doc["tensors"]) == sorted(_tensors())
    assert "pickle protocol 0" in doc["scan"]["plan"]["torch_cannot_read"]


def test_inspect_of_protocol_1_names_the_weights_only_refusal(
        files: dict[str, Path], run_cli: Callable[..., Any]) -> None:
    path = files["p1"]
    res = run_cli("inspect", path)
    assert res.code == 0 and "damaged" not in res.out + res.err, res
    assert "weights_only needs: )" not in res.out  # an empty allowlist would not load it
    assert ("scan        safe (torch.load(weights_only=True) cannot read it, whatever you "
            f"allowlist: torchverity scan {path} says why)") in res.out
    doc = json.loads(run_cli("inspect", "--json", path).out)
    assert doc["scan"]["plan"]["torch_cannot_read"] == ""  # a full torch.load reads it


def test_fingerprint_equals_the_normal_files(files: dict[str, Path],
                                             run_cli: Callable[..., Any]) -> None:
    def root(path: Path) -> str:
        res = run_cli("fingerprint", "--json", path)
        assert res.code == 0, res
        return str(json.loads(res.out)["root"])

    expected = root(files["normal"])
    assert expected == torchverity.fingerprint(_tensors()).root
    for name in ("p0", "zip_p0", "p1"):
        assert root(files[name]) == expected, name
    res = run_cli("diff", files["p0"], files["normal"])
    assert res.code == 0, res


@pytest.mark.parametrize("name", ["p0", "zip_p0", "p1"])
def test_migrate_converts_bit_for_bit(files: dict[str, Path], name: str, tmp_path: Path,
                                      run_cli: Callable[..., Any]) -> None:
    from safetensors.torch import load_file

    out = tmp_path / f"{name}.safetensors"
    res = run_cli("migrate", files[name], out)
    assert res.code == 0, res
    _same_bits(load_file(str(out)))


def test_scan_gives_one_line_per_cause(files: dict[str, Path],
                                       run_cli: Callable[..., Any]) -> None:
    path = files["p0"]
    res = run_cli("scan", path)
    assert res.code == 0 and f"{path}: safe (torch-legacy)" in res.out, res
    assert not re.search(r"opcode \w+ at offset", res.out)  # no line per opcode
    lines = res.out.splitlines()
    assert "  torch.load cannot read this file, with any weights_only setting; the file is " \
           "intact (it reads in full):" in lines
    (persid,) = [line for line in lines if "PERSID" in line]
    assert "pickled as text (pickle protocol 0), which no torch.load reads" in persid
    (grouped,) = [line for line in lines if "protocol 0/1 opcodes" in line]
    assert "LONG, INT" in grouped and "the first at offset 0" in grouped
    assert f"  convert it: torchverity migrate {path} NEW.safetensors" in lines

    res = run_cli("scan", files["p1"])
    assert "  torch.load(weights_only=True) cannot read this file:" in res.out.splitlines()
    assert "any weights_only setting" not in res.out and "PERSID" not in res.out
    assert len([line for line in res.out.splitlines() if "opcodes" in line]) == 1


def test_load_says_trust_cannot_help(files: dict[str, Path]) -> None:
    for name in ("p0", "zip_p0"):
        path = files[name]
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        for trust in (None, digest):
            with pytest.raises(FormatError, match="trust_sha256 cannot help") as info:
                torchverity.load(path, sidecar="ignore", trust_sha256=trust)
            assert f"torchverity migrate {path} NEW.safetensors" in (info.value.hint or "")
    digest = hashlib.sha256(files["p1"].read_bytes()).hexdigest()
    _same_bits(torchverity.load(files["p1"], sidecar="ignore", trust_sha256=digest))


def _write_legacy_view(path: Path, protocol: int) -> None:
    """torch's legacy layout with a storage view, as torch < 1.0 wrote one: the tensor's id
    names root storage '1' (10 floats) and view '2' of 3 elements from offset 2."""
    from torch.serialization import MAGIC_NUMBER, PROTOCOL_VERSION

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, torch.storage.TypedStorage):
                return ("storage", torch.FloatStorage, "1", "cpu", 10, ("2", 2, 3))
            return None

    info = {"protocol_version": PROTOCOL_VERSION, "little_endian": True,
            "type_sizes": {"short": 2, "int": 4, "long": 4}}
    with open(path, "wb") as fh:
        for head in (MAGIC_NUMBER, PROTOCOL_VERSION, info):
            pickle.dump(head, fh, protocol=protocol)
        Pickler(fh, protocol=protocol).dump({"v": torch.zeros(3)})
        pickle.dump(["1"], fh, protocol=protocol)
        fh.write(struct.pack("<q", 10) + _bits(torch.arange(10.0)))


def test_a_storage_view_reads_as_torch_reads_it(tmp_path: Path) -> None:
    from torchverity.pickles._migrate import inert_load

    binary, text = tmp_path / "view_p2.pt", tmp_path / "view_p0.pt"
    _write_legacy_view(binary, 2)
    _write_legacy_view(text, 0)
    assert b"('2', 2, 3))\n" in text.read_bytes()
    want = torch.load(binary, weights_only=False)["v"]  # torch's own reading of views
    assert torch.equal(want, torch.tensor([2.0, 3.0, 4.0]))
    for path in (binary, text):
        got, placeholders = inert_load(path, "torch-legacy")
        assert torch.equal(got["v"], want) and not placeholders, path


# Edits of the one storage id of a protocol-0 file {"w": ...} that torch never writes.
_EVAL = "__import__('os').system('touch {sentinel}')"
_EDITS = {
    "class": lambda pid, s: pid.replace("<class 'torch.FloatStorage'>", "<class 'os.system'>"),
    "extra field": lambda pid, s: pid[:-1] + ", 1)",
    "code": lambda pid, s: pid.replace("'cpu'", _EVAL.format(sentinel=s)),
}


def _edited(src: Path, dst: Path, edit: Callable[[str, Path], str], sentinel: Path) -> Path:
    data = src.read_bytes()
    found = re.search(rb"P(\('storage'[^\n]*)\n", data)
    assert found is not None
    pid = found.group(1).decode()
    dst.write_bytes(data.replace(found.group(1), edit(pid, sentinel).encode()))
    return dst


# A reader that takes the class reprs for strings and evaluates the rest of the id.
_EVAL_LOADER = """
import pickle, re, sys
class Naive(pickle.Unpickler):
    def persistent_load(self, pid):
        return eval(re.sub(r"<class '([\\w.]+)'>", r"'\\1'", pid))
with open(sys.argv[1], "rb") as fh:
    for _ in range(4):
        Naive(fh).load()
"""


@pytest.mark.parametrize("kind", sorted(_EDITS))
def test_an_id_torch_never_writes_is_refused(kind: str, tmp_path: Path,
                                             run_cli: Callable[..., Any]) -> None:
    from torchverity.pickles._migrate import inert_load

    src = tmp_path / "src.pt"
    torch.save({"w": torch.ones(3)}, src, _use_new_zipfile_serialization=False,
               pickle_protocol=0)
    if kind == "code":  # the payload is live: a reader that evaluated the id would run it
        ran = tmp_path / "RAN"
        live = _edited(src, tmp_path / "live.pt", _EDITS[kind], ran)
        subprocess.run([sys.executable, "-c", _EVAL_LOADER, str(live)], timeout=120,
                       capture_output=True, check=False)
        assert ran.exists()
    sentinel = tmp_path / "SENTINEL"
    path = _edited(src, tmp_path / "edited.pt", _EDITS[kind], sentinel)
    with pytest.raises(FormatError, match="persistent id that torch's legacy"):
        inert_load(path, "torch-legacy")
    res = run_cli("scan", path)
    assert res.code == 1 and f"{path}: malformed (torch-legacy)" in res.out, res
    assert "text no torch format writes" in res.out
    res = run_cli("inspect", path)
    assert res.code == 1 and "malformed" in res.out, res
    for command in (("fingerprint", path), ("migrate", path, tmp_path / "out.safetensors")):
        assert run_cli(*command).code == 2, command
    assert not sentinel.exists()


def test_the_grammar_is_exactly_torchs() -> None:
    from torchverity.pickles._text_pids import (
        TextModuleId,
        TextStorageId,
        parse_legacy_pid,
        parse_zip_pid,
    )

    assert parse_legacy_pid("('storage', <class 'torch.BFloat16Storage'>, '94', 'cuda:1', 7, "
                            "('95', 2, 3))") == TextStorageId("bfloat16", "94", "cuda:1", 7,
                                                              ("95", 2, 3))
    assert parse_legacy_pid("('storage', <class 'torch.storage.UntypedStorage'>, '1', 'cpu', "
                            "4, None)") == TextStorageId("uint8", "1", "cpu", 4, None)
    assert parse_legacy_pid("('module', <class 'torch.nn.modules.linear.Linear'>, '/x.py', "
                            "'class Linear:\\n    \\'x\\'')") == TextModuleId(
                                "torch.nn.modules.linear", "Linear")
    assert parse_zip_pid("('storage', <class 'torch.LongStorage'>, '0', 'cpu', 4)") == \
        TextStorageId("int64", "0", "cpu", 4, None)
    refused = [
        "('storage', <class 'torch.FloatStorage'>, '1', 'cpu', 3)",  # the zip shape
        "('storage', <class 'torch.FloatStorage'>, '1', 'cpu', -3, None)",
        "('storage', <class 'torch.FloatStorage'>, '1', 'cpu', 3, None) ",
        "('storage', <class 'torch.nn.Module'>, '1', 'cpu', 3, None)",
        "('storage', <class 'torch.FloatStorage'>, '1', 'cpu', 1" + "0" * 30 + ", None)",
        "('storage', <class 'torch.FloatStorage'>, 1, 'cpu', 3, None)",
        "('module', <class 'mod.Net'>, None, 'a' + 'b')",
        "('module', <class 'Net'>, None, None)",
    ]
    for text in refused:
        with pytest.raises(FormatError):
            parse_legacy_pid(text)
    with pytest.raises(FormatError):
        parse_zip_pid("('storage', <class 'torch.FloatStorage'>, '1', 'cpu', 3, None)")
