"""A plain pickle is named as one, apart from torch's legacy format, by every command.

torch.save's pre-1.6 format opens with a pickled magic number (then the protocol
version and sys info pickles); ``pickle.dump`` writes no such thing, and torch.load
fails on it ("Invalid magic number"), whatever it holds. inspect, fingerprint, diff and
scan read either inertly; load refuses a plain pickle saying what it is.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import torchverity
from pickle_corpus import Touch, run_plain_loader
from torchverity._formats import file_format
from torchverity.errors import FormatError, UnsafeFileError
from torchverity.pickles import scan_file
from torchverity.pickles._file_format import checkpoint_format


def _files(root: Path) -> dict[str, tuple[Path, str, int]]:
    """name -> (path, the format it is, its tensor count)."""
    made: dict[str, tuple[Any, str, int]] = {
        "dict_p2.pkl": (lambda p: p.write_bytes(pickle.dumps({"a": 1}, 2)), "pickle", 0),
        "dict_p4.pkl": (lambda p: p.write_bytes(pickle.dumps({"a": 1}, 4)), "pickle", 0),
        "dict_p0.pkl": (lambda p: p.write_bytes(pickle.dumps({"a": 1}, 0)), "pickle", 0),
        "arrays.pkl": (lambda p: p.write_bytes(pickle.dumps({"a": np.arange(3),
                                                            "b": np.ones(2)})), "pickle", 2),
        "tensors.pkl": (lambda p: p.write_bytes(pickle.dumps({"w": torch.ones(3)})),
                        "pickle", 1),
        "legacy.pt": (lambda p: torch.save({"w": torch.ones(3)}, p,
                                           _use_new_zipfile_serialization=False),
                      "pt-legacy", 1),
        "legacy_p4.pt": (lambda p: torch.save({"w": torch.ones(3)}, p, pickle_protocol=4,
                                              _use_new_zipfile_serialization=False),
                         "pt-legacy", 1),
    }
    out = {}
    for name, (write, fmt, count) in made.items():
        write(root / name)
        out[name] = (root / name, fmt, count)
    return out


def test_plain_pickles_and_legacy_files_are_told_apart(tmp_path: Path,
                                                       run_cli: Callable[..., Any]) -> None:
    for name, (path, fmt, count) in _files(tmp_path).items():
        assert checkpoint_format(path) == fmt, name
        if not name.endswith("p0.pkl"):  # protocol 0 has no PROTO: only the walk knows it
            assert file_format(path) == fmt, name
        # What torch.load makes of our own benign files, in this process.
        if fmt == "pickle":
            with pytest.raises(Exception, match="Invalid magic number"):
                torch.load(path, weights_only=False)
        else:
            assert torch.equal(torch.load(path, weights_only=False)["w"], torch.ones(3))
        assert scan_file(path).format == ("torch-legacy" if fmt == "pt-legacy" else "pickle")
        res = run_cli("inspect", "--json", path)
        assert res.code == 0, (name, res)
        shown = json.loads(res.out)
        assert shown["format"] == fmt and len(shown["tensors"]) == count, (name, shown)
        res = run_cli("inspect", path)
        kind = "plain pickle (pickle.dump, not torch.save" if fmt == "pickle" else "pt-legacy"
        assert f"{path}: {kind}" in res.out, (name, res.out)
        res = run_cli("fingerprint", "--json", path)
        assert res.code == 0 and len(json.loads(res.out)["tensors"]) == count, (name, res)
    res = run_cli("diff", tmp_path / "tensors.pkl", tmp_path / "legacy.pt")
    assert res.code == 0, res


def test_load_says_what_a_plain_pickle_is(tmp_path: Path) -> None:
    files = _files(tmp_path)
    for name in ("dict_p2.pkl", "dict_p4.pkl", "arrays.pkl", "tensors.pkl"):
        path = files[name][0]
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        for trust in (None, digest):  # a full load fails on it as well
            with pytest.raises(FormatError, match=r"a plain pickle \(pickle.dump\), not a "
                                                  r"torch.save checkpoint") as info:
                torchverity.load(path, sidecar="ignore", trust_sha256=trust)
            assert f"torchverity inspect {path}" in (info.value.hint or ""), name
    for name in ("legacy.pt", "legacy_p4.pt"):
        path = files[name][0]
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        loaded = torchverity.load(path, sidecar="ignore", trust_sha256=digest)
        assert torch.equal(loaded["w"], torch.ones(3)), name
    assert torch.equal(torchverity.load(files["legacy.pt"][0], sidecar="ignore")["w"],
                       torch.ones(3))

    # A plain pickle that runs a command is refused as unsafe, trusted or not.
    live = tmp_path / "live"
    live.mkdir()
    ran = live / "RAN"
    (live / "evil.pkl").write_bytes(pickle.dumps({"w": torch.ones(2), "x": Touch(ran)}))
    run_plain_loader(live / "evil.pkl")
    assert ran.exists(), "the payload did not run under pickle.load"
    checked = tmp_path / "checked"
    checked.mkdir()
    sentinel = checked / "RAN"
    evil = checked / "evil.pkl"
    evil.write_bytes(pickle.dumps({"w": torch.ones(2), "x": Touch(sentinel)}))
    digest = hashlib.sha256(evil.read_bytes()).hexdigest()
    for trust in (None, digest):
        with pytest.raises(UnsafeFileError, match=r"posix\.system"):
            torchverity.load(evil, sidecar="ignore", trust_sha256=trust)
    assert not sentinel.exists()
