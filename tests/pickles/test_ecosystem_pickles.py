"""Pickle-bearing files as people write them: a whole nn.Module of their own class, an
optimizer state_dict alone, a legacy nested .pth, numpy .npy/.npz (with and without object
arrays) and joblib dumps of a fitted sklearn model and of numpy arrays. Each is named for what
it is by every artifact command, with a next step that fits; nothing from a file runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pickle_corpus import payload_runs

joblib = pytest.importorskip("joblib")
sklearn_linear = pytest.importorskip("sklearn.linear_model")

_READERS = ("inspect", "fingerprint")


class UserNet(torch.nn.Module):
    """A user's own module class: unknown to any allowlist."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)


class _EvilNet(torch.nn.Module):
    def __init__(self, sentinel: Path) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)
        self.cmd = f"touch {sentinel}"

    def __reduce__(self) -> tuple[object, tuple[str]]:  # type: ignore[override]
        return os.system, (self.cmd,)


def _json(run_cli: Callable[..., Any], *args: Any) -> tuple[int, dict[str, Any]]:
    result = run_cli(args[0], "--json", *args[1:])
    assert "Traceback" not in result.out + result.err, args
    assert "internal error" not in result.out + result.err, args
    return result.code, json.loads(result.out)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eco_pickles")
    out = {name: root / name for name in (
        "plain.npy", "object.npy", "plain.npz", "object.npz", "sklearn.joblib",
        "arrays.joblib")}
    np.save(out["plain.npy"], np.arange(6.0).reshape(2, 3))
    np.save(out["object.npy"], np.array([{"a": 1}, "x"], dtype=object), allow_pickle=True)
    np.savez(out["plain.npz"], a=np.arange(3), b=np.ones((2, 2), dtype=np.float32))
    np.savez(out["object.npz"], a=np.arange(3), o=np.array([1, "x"], dtype=object))
    x = np.random.RandomState(0).randn(20, 3)
    model = sklearn_linear.LogisticRegression().fit(x, (x[:, 0] > 0).astype(int))
    joblib.dump(model, out["sklearn.joblib"])
    joblib.dump({"a": np.arange(5.0), "b": np.ones((2, 3), dtype=np.int32)},
                out["arrays.joblib"])
    return out


@pytest.mark.parametrize("name,kind", [
    ("plain.npy", "numpy .npy"), ("object.npy", "numpy .npy"),
    ("plain.npz", "numpy .npz"), ("object.npz", "numpy .npz"),
    ("sklearn.joblib", "joblib file"), ("arrays.joblib", "joblib file"),
])
def test_numpy_and_joblib_files_are_named_not_damaged(
        files: dict[str, Path], name: str, kind: str, tmp_path: Path,
        run_cli: Callable[..., Any]) -> None:
    """inspect, fingerprint and diff say what the file is (exit 2, next: scan) instead of an
    internal error or 'damaged: restore from a good copy'; scan judges it; migrate points to
    scan."""
    path = files[name]
    for args in ((*_READERS[:1], path), (_READERS[1], path), ("diff", path, path)):
        code, doc = _json(run_cli, *args)
        assert code == 2, (args, doc)
        assert kind in doc["message"] and "not a PyTorch checkpoint" in doc["message"]
        assert doc["hint"].startswith(f"torchverity scan {path}"), doc
        assert "restore" not in doc["hint"]
    code, doc = _json(run_cli, "scan", path)
    assert doc["files"][0]["verdict"] in ("safe", "needs-allowlist", "needs-review")
    code, doc = _json(run_cli, "migrate", path, tmp_path / "new.safetensors")
    assert code == 2 and doc["hint"].startswith(f"torchverity scan {path}")


def test_sklearn_model_needs_review_with_its_class(files: dict[str, Path],
                                                   run_cli: Callable[..., Any]) -> None:
    code, doc = _json(run_cli, "scan", files["sklearn.joblib"])
    result = doc["files"][0]
    assert code == 1 and result["verdict"] == "needs-review" and result["format"] == "joblib"
    assert "sklearn.linear_model._logistic.LogisticRegression" in result["reason"]


def test_whole_user_module_needs_review_and_is_read_inertly(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    """torch.save(model) of the user's own class: needs review (never safe) with the
    safe_globals plan; inspect, fingerprint and migrate read its tensors without running it."""
    path = tmp_path / "whole.pt"
    net = UserNet()
    torch.save(net, path)
    code, doc = _json(run_cli, "scan", path)
    result = doc["files"][0]
    assert code == 1 and result["verdict"] == "needs-review"
    assert f"{__name__}.UserNet" in result["plan"]["needs"]
    code, listed = _json(run_cli, "inspect", path)
    assert sorted(t["name"] for t in listed["tensors"]) == ["fc.bias", "fc.weight"]
    assert listed["scan"]["verdict"] == "needs-review"
    code, doc = _json(run_cli, "migrate", path, tmp_path / "new.safetensors")
    assert code == 0
    assert torch.equal(torchverity_load(tmp_path / "new.safetensors")["fc.weight"],
                       net.fc.weight)


def torchverity_load(path: Path) -> dict[str, torch.Tensor]:
    import torchverity

    return dict(torchverity.load(path))




def test_malicious_whole_module_is_unsafe_and_never_runs(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    sentinel = tmp_path / "SENTINEL"
    path = tmp_path / "evil_model.pt"
    torch.save(_EvilNet(sentinel), path)
    assert payload_runs(path, sentinel)
    code, doc = _json(run_cli, "scan", path)
    assert code == 1 and doc["files"][0]["verdict"] == "unsafe"
    # Read inertly: the payload stands in for the whole object, a placeholder holding no
    # tensor, so inspect flags it, fingerprint and diff see no entries and migrate has none.
    for args, want in ((("inspect", path), 1), (("fingerprint", path), 0),
                       (("diff", path, path), 0),
                       (("migrate", path, tmp_path / "new.safetensors"), 2)):
        code, _ = _json(run_cli, *args)
        assert code == want, args
        assert not sentinel.exists(), f"{args[0]}: the payload ran"


def test_optimizer_state_dict_and_legacy_nested_pth(tmp_path: Path,
                                                    run_cli: Callable[..., Any]) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    optim = tmp_path / "optim.pt"
    torch.save(opt.state_dict(), optim)
    legacy = tmp_path / "nested.pth"
    torch.save({"model": {"enc": {"w": torch.ones(2, 2)}, "dec": [torch.zeros(3)]},
                "epoch": 2}, legacy, _use_new_zipfile_serialization=False)
    for path, names in ((optim, {"state.0.exp_avg", "state.1.step"}),
                        (legacy, {"model.enc.w", "model.dec.0"})):
        assert _json(run_cli, "scan", path)[1]["files"][0]["verdict"] == "safe"
        code, doc = _json(run_cli, "inspect", path)
        assert code == 0 and names <= {t["name"] for t in doc["tensors"]}
        assert _json(run_cli, "diff", path, path)[0] == 0


@pytest.mark.parametrize("name,key", [("plain.npz", "zip-not-torch"),
                                      ("object.npz", "zip-not-torch"),
                                      ("plain.npy", "numpy-npy")])
def test_explain_names_numpy_files_torch_load_refuses(files: dict[str, Path], name: str,
                                                      key: str,
                                                      run_cli: Callable[..., Any]) -> None:
    with pytest.raises(Exception) as caught:
        torch.load(files[name])
    code, doc = _json(run_cli, "explain", str(caught.value))
    assert code == 0
    assert [e["key"] for e in doc["explanations"]] == [key]


_LIVE_JOBLIB = """
import os, sys, joblib
try:
    joblib.load(sys.argv[1])
except Exception:
    pass
print(os.path.exists(sys.argv[2]))
"""


def test_malicious_joblib_is_unsafe_and_never_runs(tmp_path: Path,
                                                   run_cli: Callable[..., Any]) -> None:
    """A joblib dump of arrays plus a payload (proven live under joblib.load in a throwaway
    process): scan and inspect call it unsafe (exit 1), not merely 'not a checkpoint'."""
    sentinel = tmp_path / "SENTINEL"
    path = tmp_path / "evil.joblib"
    joblib.dump({"a": np.arange(4.0), "x": _EvilNet(sentinel)}, path)
    proof = subprocess.run([sys.executable, "-c", _LIVE_JOBLIB, str(path), str(sentinel)],
                           capture_output=True, text=True, timeout=120, check=True)
    assert proof.stdout.strip() == "True"
    sentinel.unlink()
    assert _json(run_cli, "scan", path)[1]["files"][0]["verdict"] == "unsafe"
    code, doc = _json(run_cli, "inspect", path)
    assert code == 1 and doc["scan"]["verdict"] == "unsafe", doc
    for args in (("fingerprint", path), ("diff", path, path),
                 ("migrate", path, tmp_path / "new.safetensors")):
        assert _json(run_cli, *args)[0] in (1, 2), args
    assert not sentinel.exists()
