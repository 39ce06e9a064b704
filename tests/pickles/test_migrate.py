"""Migration of legacy checkpoints, with real torch files and a sentinel for payloads."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import pickle_corpus
from torchverity.errors import FormatError, IntegrityError, UnsafeFileError, UsageError
from torchverity.pickles._migrate import Inert, inert_load, migrate


def _training_state() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=3e-4, betas=(0.8, 0.99))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def _loads_weights_only(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, weights_only=True)  # type: ignore[no-any-return]


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_whole_objects_become_a_clean_state_dict(tmp_path: Path, suffix: str) -> None:
    model, opt, sched = _training_state()
    src = tmp_path / "legacy.pt"
    torch.save({"model": model, "optimizer": opt, "scheduler": sched, "epoch": 12,
                "args": argparse.Namespace(lr=3e-4, depth=3, name="run1"),
                "best": np.float64(0.25), "hist": np.arange(4.0),
                "config": pickle_corpus.UserConfig()}, src)
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(src, weights_only=True)
    result = migrate(src, tmp_path / f"clean{suffix}")
    assert result.mode == "inert" and result.verified
    assert "torch.nn.modules.linear.Linear" in result.placeholders
    out = _loads_weights_only(Path(result.target))  # plain torch/safetensors, weights only
    expected = {f"model.{k}": v for k, v in model.state_dict().items()}
    for name, tensor in expected.items():
        assert torch.equal(out[name], tensor), name
    first = next(iter(model.parameters()))
    assert torch.equal(out["optimizer.state.model.0.weight.exp_avg"], opt.state[first]["exp_avg"])
    assert torch.equal(out["hist"], torch.arange(4.0, dtype=torch.float64))
    meta = json.loads(Path(result.meta_path or "").read_text())["user"]["content"]
    assert meta["epoch"] == 12 and meta["best"] == 0.25
    assert meta["args"] == {"$class": "argparse.Namespace", "lr": 3e-4, "depth": 3,
                            "name": "run1"}
    assert meta["optimizer"]["defaults"]["betas"] == [0.8, 0.99]
    assert meta["optimizer"]["param_groups"][0]["params"][0] == {"$tensor": "model.0.weight"}
    assert meta["scheduler"]["step_size"] == 5 and meta["scheduler"]["gamma"] == 0.5
    assert meta["config"]["layers"] == [4, 4]
    assert Path(result.sidecar or "").read_text().startswith(result.digest)


def test_output_loads_into_the_model_with_torchverity(tmp_path: Path) -> None:
    import torchverity

    model, _, _ = _training_state()
    src = tmp_path / "whole.pt"
    torch.save(model, src)
    result = migrate(src, tmp_path / "model.safetensors")
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 2))
    torchverity.load(result.target, model=fresh, sidecar="require")
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_legacy_format_and_protocol_4(tmp_path: Path) -> None:
    model, _, _ = _training_state()
    legacy = tmp_path / "old.pt"
    torch.save({"net": model}, legacy, _use_new_zipfile_serialization=False)
    p4 = tmp_path / "p4.pt"
    torch.save({"sd": model.state_dict(), "step": 3}, p4, pickle_protocol=4)
    for src in (legacy, p4):
        result = migrate(src, tmp_path / f"{src.stem}.safetensors")
        out = _loads_weights_only(Path(result.target))
        prefix = "net" if src is legacy else "sd"
        assert set(out) == {f"{prefix}.{k}" for k in model.state_dict()}
        assert torch.equal(out[f"{prefix}.0.weight"], model[0].weight)


def test_shared_and_view_tensors_are_written_compactly(tmp_path: Path) -> None:
    base = torch.arange(12.0)
    src = tmp_path / "views.pt"
    torch.save({"a": base, "view": base[2:6], "tied": base}, src)
    result = migrate(src, tmp_path / "views.safetensors")
    out = _loads_weights_only(Path(result.target))
    assert torch.equal(out["view"], base[2:6]) and set(out) == {"a", "view"}
    meta = json.loads(Path(result.meta_path or "").read_text())["user"]["content"]
    assert meta["tied"] == {"$tensor": "a"}


def test_malicious_files_are_migrated_without_running(tmp_path: Path) -> None:
    sentinel = tmp_path / "SENTINEL"
    cases = {c.name: c for c in pickle_corpus.malicious(tmp_path / "bad", sentinel)}
    for name in ("torch_zip_reduce", "torch_legacy"):
        result = migrate(cases[name].path, tmp_path / f"{name}.pt")
        assert result.scan_verdict == "unsafe" and "posix.system" in result.dangerous
        out = _loads_weights_only(Path(result.target))
        assert list(out) == ["w"] and torch.equal(out["w"], torch.ones(3))
    for name in ("global_os_system", "pkgutil_resolve_name"):  # a payload and nothing else
        with pytest.raises(FormatError, match="no tensors found"):
            migrate(cases[name].path, tmp_path / f"{name}.safetensors")
    with pytest.raises(FormatError):
        migrate(cases["memo_expansion_bomb"].path, tmp_path / "x.safetensors")
    assert not sentinel.exists()


def test_inert_unpickler_runs_nothing_even_when_forced(tmp_path: Path) -> None:
    """Bypass the refusal: the inert unpickler itself turns payloads into placeholders."""
    sentinel = tmp_path / "SENTINEL"
    cases = {c.name: c for c in pickle_corpus.malicious(tmp_path / "bad", sentinel)}
    evil, placeholders = inert_load(cases["torch_zip_reduce"].path, "torch-zip")
    assert "posix.system" in placeholders and isinstance(evil["x"], Inert)
    assert evil["x"]._tv_args == (f"touch {sentinel}",) and torch.equal(evil["w"], torch.ones(3))
    for name in ("builtins_exec", "getattr_import", "functools_partial", "dotted_name", "obj",
                 "inst", "nested_loads", "subprocess_check_call"):
        obj, _ = inert_load(cases[name].path, "pickle")
        assert isinstance(obj, Inert) or obj is not None
    assert not sentinel.exists()


def test_trust_sha256_is_checked_when_given(tmp_path: Path) -> None:
    import hashlib

    sentinel = tmp_path / "SENTINEL"
    evil = next(c for c in pickle_corpus.malicious(tmp_path / "bad", sentinel)
                if c.name == "torch_zip_reduce").path
    with pytest.raises(IntegrityError, match="not the trusted"):
        migrate(evil, tmp_path / "o.safetensors", trust_sha256="0" * 64)
    assert not (tmp_path / "o.safetensors").exists() and not sentinel.exists()
    digest = hashlib.sha256(evil.read_bytes()).hexdigest()
    result = migrate(evil, tmp_path / "o.safetensors", trust_sha256=digest)
    assert result.mode == "inert" and "posix.system" in result.placeholders
    assert not sentinel.exists()


def test_damaged_tensor_data_is_caught(tmp_path: Path) -> None:
    src = tmp_path / "damaged.pt"
    model, _, _ = _training_state()
    torch.save({"m": model}, src)
    data = bytearray(src.read_bytes())
    pos = data.find(b"damaged/data/0") + 200
    data[pos] ^= 0x01  # a single bit flip inside a storage: torch.load would not notice
    src.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="damaged"):
        migrate(src, tmp_path / "out.safetensors")


def test_usage_errors(tmp_path: Path) -> None:
    npy = tmp_path / "a.npy"
    np.save(npy, np.arange(3))
    with pytest.raises(UsageError, match="not migrated"):
        migrate(npy, tmp_path / "a.safetensors")
    src = tmp_path / "s.pt"
    torch.save({"w": torch.ones(1)}, src)
    with pytest.raises(UsageError, match="different target"):
        migrate(src, src)
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps({"w": torch.ones(2), "n": 1}))
    assert migrate(plain, tmp_path / "plain.safetensors").tensors == 1


def test_cli(tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    src = pickle_corpus.user_class_checkpoint(tmp_path / "user.pt")
    res = run_cli("migrate", str(src), str(tmp_path / "user.safetensors"))
    assert res.code == 0, res.err
    assert "read back bit for bit (inert unpickling)" in res.out and "UserConfig" in res.out
    res = run_cli("migrate", "--json", str(src), str(tmp_path / "user2.pt"))
    doc = json.loads(res.out)
    assert doc["ok"] and doc["result"]["tensors"] == 2 and doc["result"]["mode"] == "inert"
    sentinel = tmp_path / "SENTINEL"
    evil = next(c for c in pickle_corpus.malicious(tmp_path / "bad", sentinel)
                if c.name == "torch_zip_reduce").path
    res = run_cli("migrate", str(evil), str(tmp_path / "evil.safetensors"))
    assert res.code == 0 and "posix.system" in res.err and "never ran" in res.err, res.err
    assert not sentinel.exists()


_SCRIPTED_SETSTATE = '''
import torch
from typing import Tuple


class Stateful(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.arange(3.0)

    @torch.jit.export
    def __getstate__(self) -> Tuple[torch.Tensor, bool]:
        return (self.w, self.training)

    @torch.jit.export
    def __setstate__(self, state: Tuple[torch.Tensor, bool]) -> None:
        print("SETSTATE-RAN")
        self.w = state[0]
        self.training = state[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w
'''


def _scripted_archive(tmp_path: Path) -> bytes:
    """torch.jit.save of a module whose scripted __setstate__ prints a marker on load."""
    import importlib.util
    import io
    import sys

    source = tmp_path / "stateful_mod.py"
    source.write_text(_SCRIPTED_SETSTATE)  # TorchScript compiles from a real source file
    spec = importlib.util.spec_from_file_location("stateful_mod", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["stateful_mod"] = module
    spec.loader.exec_module(module)
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(module.Stateful()), buf)
    return buf.getvalue()


def test_torchscript_is_never_run_by_migrate(tmp_path: Path, capfd: Any) -> None:
    import subprocess
    import sys

    archive = _scripted_archive(tmp_path)
    top = tmp_path / "scripted.pt"
    top.write_bytes(archive)
    nested = tmp_path / "nested_script.pkl"  # pickle.dumps-style: torch.load of the bytes
    nested.write_bytes(b"\x80\x02ctorch.storage\n_load_from_bytes\nB"
                       + len(archive).to_bytes(4, "little") + archive + b"\x85R.")
    live = subprocess.run(
        [sys.executable, "-c", "import pickle,sys; pickle.load(open(sys.argv[1],'rb'))",
         str(nested)], capture_output=True, text=True, timeout=120)
    assert "SETSTATE-RAN" in live.stdout  # the plain loader does run the scripted code
    capfd.readouterr()
    unsafe = migrate(nested, tmp_path / "n.safetensors")  # no trust needed: nothing runs
    plain = migrate(top, tmp_path / "top.safetensors")
    assert "SETSTATE-RAN" not in capfd.readouterr().out
    assert unsafe.scan_verdict == "unsafe" and unsafe.dangerous
    for result in (unsafe, plain):
        assert result.mode == "inert" and "__torch__.stateful_mod.Stateful" in result.placeholders
        out = _loads_weights_only(Path(result.target))
        assert [torch.equal(t, torch.arange(3.0)) for t in out.values()] == [True]


def test_inert_reader_never_calls_torch_load(tmp_path: Path, monkeypatch: Any) -> None:
    """Every format migrate reads goes through the inert reader, with torch.load tripped."""
    model, _, _ = _training_state()
    files = {"zip": tmp_path / "z.pt", "legacy": tmp_path / "l.pt"}
    torch.save({"m": model}, files["zip"])
    torch.save({"m": model}, files["legacy"], _use_new_zipfile_serialization=False)
    plain = tmp_path / "p.pkl"
    plain.write_bytes(pickle.dumps({"t": torch.ones(2)}))

    def tripwire(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch.load / torch.jit.load called on the migrate path")

    for name in ("load",):
        monkeypatch.setattr(torch, name, tripwire)
        monkeypatch.setattr(torch.serialization, name, tripwire)
        monkeypatch.setattr(torch.jit, name, tripwire)
    for fmt, path in (("torch-zip", files["zip"]), ("torch-legacy", files["legacy"]),
                      ("pickle", plain)):
        obj, _ = inert_load(path, fmt)
        assert obj is not None
    monkeypatch.undo()
    zipped, _ = inert_load(files["zip"], "torch-zip")
    legacy, _ = inert_load(files["legacy"], "torch-legacy")
    for key, value in model.state_dict().items():
        assert torch.equal(zipped["m"]._tv_state["_modules"][key.split(".")[0]]
                           ._tv_state["_parameters" if "running" not in key and
                                      "num_batches" not in key else "_buffers"]
                           [key.split(".", 1)[1]], value), key
        assert torch.equal(legacy["m"]._tv_state["_modules"][key.split(".")[0]]
                           ._tv_state["_parameters" if "running" not in key and
                                      "num_batches" not in key else "_buffers"]
                           [key.split(".", 1)[1]], value), key


def test_sparse_nested_and_structured_values_migrate(tmp_path: Path) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    structured = np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")])
    structured["a"] = [1, 2, 3]
    dense = torch.eye(3)
    src = tmp_path / "odd.pt"
    torch.save({"coo": dense.to_sparse(), "csr": dense.to_sparse_csr(),
                "nt": torch.nested.nested_tensor([torch.ones(2), torch.zeros(3)]),
                "st": structured}, src)
    result = migrate(src, tmp_path / "odd.safetensors")
    out = _loads_weights_only(Path(result.target))
    meta = json.loads(Path(result.meta_path or "").read_text())["user"]["content"]
    coo = meta["coo"]["$sparse_coo"]
    rebuilt = torch.sparse_coo_tensor(out[coo["indices"]["$tensor"]],
                                      out[coo["values"]["$tensor"]], coo["size"])
    assert torch.equal(rebuilt.to_dense(), dense)
    csr = meta["csr"]["$sparse_csr"]
    assert torch.equal(torch.sparse_csr_tensor(
        out[csr["crow"]["$tensor"]], out[csr["col"]["$tensor"]], out[csr["values"]["$tensor"]],
        csr["size"]).to_dense(), dense)
    assert [out[n].tolist() for n in meta["nt"]["$nested"]] == [[1.0, 1.0], [0.0, 0.0, 0.0]]
    assert out[meta["st"]["$structured"]["a"]["$ndarray"]].tolist() == [1, 2, 3]
    quantized = tmp_path / "q.pt"
    torch.save({"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)}, quantized)
    with pytest.raises(UsageError, match="not migrated"):
        migrate(quantized, tmp_path / "q.safetensors")


def test_a_folder_source_names_its_checkpoint_file(tmp_path: Path,
                                                   run_cli: Callable[..., Any]) -> None:
    """A folder given where migrate wants a file: not 'no such file', and the next command
    names the folder's one checkpoint file, quoted for the shell."""
    folder = tmp_path / "my run ü"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    torch.save(torch.nn.Linear(2, 2).state_dict(), folder / "pytorch_model.bin")
    out = tmp_path / "out.safetensors"
    res = run_cli("migrate", folder, out)
    assert res.code == 2 and "no such file" not in res.err and "is a folder" in res.err
    hint = f"torchverity migrate '{folder}/pytorch_model.bin' {out}"
    assert hint in res.err, res.err
    assert run_cli("migrate", f"{folder}/pytorch_model.bin", out).code == 0
    (tmp_path / "none").mkdir()
    res = run_cli("migrate", tmp_path / "none", tmp_path / "o2.safetensors")
    assert res.code == 2 and "holds no torch checkpoint" in res.err


def test_a_refused_malformed_file_gets_a_step_that_helps(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    whole = tmp_path / "whole.pt"
    torch.save({"w": torch.ones(64)}, whole)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(whole.read_bytes()[:300])  # the save or copy stopped part way
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    pointer = tmp_path / "pytorch_model.bin"
    pointer.write_text("version https://git-lfs.github.com/spec/v1\n"
                       "oid sha256:" + "0" * 64 + "\nsize 1234\n")
    restore = "restore the file from a good copy or download it again"
    for src, step in ((cut, restore), (empty, restore), (pointer, "git lfs pull")):
        res = run_cli("migrate", src, tmp_path / "new.safetensors")
        assert res.code == 2, res.err
        assert "cannot be migrated" in res.err and f"next: {step}" in res.err, res.err
        assert "torchverity scan" not in res.err
        scanned = run_cli("scan", src)
        assert f"next: {step}" in scanned.out, scanned.out
        if step == restore:
            assert f"torchverity verify {src} tells a good copy" in res.err, res.err


def test_torchscript_load_refusal_points_to_the_inert_route(tmp_path: Path) -> None:
    import subprocess
    import sys

    import torchverity

    archive = tmp_path / "scripted.pt"
    archive.write_bytes(_scripted_archive(tmp_path))
    with pytest.raises(UnsafeFileError) as refused:
        torchverity.load(archive, sidecar="ignore")
    hint = refused.value.hint or ""
    command = f"torchverity migrate {archive} {archive}.safetensors"
    assert command in hint and "torch.jit.load runs the archive's code" in hint, hint
    assert "pass trust_sha256" not in hint
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    live = subprocess.run(
        [sys.executable, "-c", "import sys, torch; torch.jit.load(sys.argv[1])", str(archive)],
        capture_output=True, text=True, timeout=120, env=env)
    assert "SETSTATE-RAN" in live.stdout, live.stderr  # torch.jit.load does run its code
    done = subprocess.run([sys.executable, "-m", *command.split()], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0 and "SETSTATE-RAN" not in done.stdout + done.stderr, done.stderr
    loaded = torchverity.load(f"{archive}.safetensors")
    assert [torch.equal(t, torch.arange(3.0)) for t in loaded.values()] == [True]


def test_nested_takes_a_saved_state_dict_as_the_model(tmp_path: Path,
                                                      run_cli: Callable[..., Any]) -> None:
    """A file that is a state_dict (scalars beside it or not) is the model part whole; tied
    weights keep both keys."""
    linear = torch.nn.Linear(2, 2)
    plain = tmp_path / "sd.pt"
    torch.save(linear.state_dict(), plain)
    res = run_cli("migrate", plain, tmp_path / "osd.pt", "--nested")
    assert res.code == 0, res.err
    out = torch.load(tmp_path / "osd.pt", weights_only=True)
    assert out.keys() == {"model"}
    fresh = torch.nn.Linear(2, 2)
    fresh.load_state_dict(out["model"])
    assert torch.equal(fresh.weight, linear.weight) and torch.equal(fresh.bias, linear.bias)

    shared = torch.arange(4.0)
    mixed = tmp_path / "mixed.pt"
    torch.save({"w": shared, "tied": shared, "epoch": 1}, mixed)
    result = migrate(mixed, tmp_path / "omixed.pt", nested=True)
    out = torch.load(tmp_path / "omixed.pt", weights_only=True)
    assert out["model"].keys() == {"w", "tied"} and torch.equal(out["model"]["tied"], shared)
    meta = json.loads(Path(result.meta_path or "").read_text())["user"]
    assert meta["content"]["epoch"] == 1 and meta["locations"] == {"w": ["model", "w"]}
    assert result.skipped == ()

    # Under a model key too: the tied weight keeps both keys.
    keyed = tmp_path / "keyed.pt"
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    torch.save({"model": {"w": shared, "tied": shared}, "optimizer": opt.state_dict()}, keyed)
    migrate(keyed, tmp_path / "okeyed.pt", nested=True)
    out = torch.load(tmp_path / "okeyed.pt", weights_only=True)
    assert out["model"].keys() == {"w", "tied"} and torch.equal(out["model"]["tied"], shared)


def test_nested_refusal_steps_are_commands_that_work(tmp_path: Path,
                                                     run_cli: Callable[..., Any]) -> None:
    flat = tmp_path / "flat.pt"
    torch.save({"w": torch.ones(2), "b": torch.zeros(3), "epoch": 1}, flat)
    res = run_cli("migrate", flat, tmp_path / "o.safetensors", "--nested")
    assert res.code == 2
    step = res.err.split("next: ", 1)[1].strip()
    assert step.startswith("torchverity migrate ")
    assert run_cli(*shlex.split(step)[1:]).code == 0
    # The .pt name the step would pick is the source itself: it names another file.
    res = run_cli("migrate", flat, tmp_path / "flat.safetensors", "--nested")
    step = res.err.split("next: ", 1)[1].strip()
    assert str(flat) not in shlex.split(step)[3:] and run_cli(*shlex.split(step)[1:]).code == 0
    deep = tmp_path / "deep.pt"  # tensors only inside other objects: no model part
    torch.save({"runs": [{"w": torch.ones(1)}]}, deep)
    res = run_cli("migrate", deep, tmp_path / "deep_out.pt", "--nested")
    assert res.code == 2 and "no model state dict" in res.err
    step = res.err.split("next: ", 1)[1].strip()
    assert run_cli(*shlex.split(step.split(": ", 1)[1])[1:]).code == 0


@pytest.mark.parametrize("name", ["x.npz", "x.txt", "noext", "x.ckpt", "x.SAFETENSORS"])
def test_only_safetensors_and_torch_targets_are_written(
        tmp_path: Path, run_cli: Callable[..., Any], name: str) -> None:
    src = tmp_path / "s.pt"
    torch.save({"w": torch.ones(2)}, src)
    res = run_cli("migrate", src, tmp_path / name)
    assert res.code == 2 and ".safetensors, .pt or .pth" in res.err, res.err
    assert not list(tmp_path.glob(f"{name}*"))
    step = res.err.split("next: ", 1)[1].strip()
    assert run_cli(*shlex.split(step)[1:]).code == 0
    assert migrate(src, tmp_path / "ok.pth").tensors == 1


def test_a_malformed_trusted_sha256_is_bad_usage(tmp_path: Path,
                                                 run_cli: Callable[..., Any]) -> None:
    import torchverity

    src = tmp_path / "s.pt"
    torch.save({"w": torch.ones(2)}, src)
    for bad in ("00", "g" * 64, "0" * 63):
        res = run_cli("migrate", src, tmp_path / "o.safetensors", "--trust-sha256", bad)
        assert res.code == 2 and "64 hex digits" in res.err, res.err
        assert f"torchverity hash --algo sha256 {src}" in res.err
        assert "--trust-sha256" not in res.err.split("next:")[1]
        with pytest.raises(UsageError, match="64 hex digits"):
            torchverity.load(src, trust_sha256=bad)
    assert not (tmp_path / "o.safetensors").exists()
    res = run_cli("migrate", src, tmp_path / "o.safetensors", "--trust-sha256", "A" * 64)
    assert res.code == 1 and "not the trusted" in res.err
