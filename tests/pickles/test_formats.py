"""Real model files people have, built by the libraries that write them, named what they are.

A transformers ``save_pretrained`` folder with ``.gitattributes`` and tokenizer files,
torchverity's own sidecars, an ONNX export, a TorchScript archive, a Lightning Trainer
checkpoint with omegaconf hyper-parameters, and the two broken downloads (a Git LFS
pointer and an HTML page under weight names).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from torchverity.pickles import scan, scan_file
from torchverity.pickles._classes import BENIGN, DANGEROUS

_GITATTRIBUTES = "*.bin filter=lfs diff=lfs merge=lfs -text\n*.safetensors filter=lfs diff=lfs " \
                 "merge=lfs -text\n*.onnx filter=lfs diff=lfs merge=lfs -text\n"
_LFS = ("version https://git-lfs.github.com/spec/v1\noid sha256:"
        "4d7a2146b3fbd5b3c6d8d2c4bb5e0b4e6d0e6d2a5c2e1f0a9b8c7d6e5f4a3b2c1\nsize 437985387\n")
_HTML = "<!DOCTYPE html>\n<html><head><title>Sign in</title></head><body>Access denied</body>"


def _hf_folder(root: Path) -> Path:
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder = root / "bert"
    cfg = BertConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=16, max_position_embeddings=16)
    BertModel(cfg).save_pretrained(folder)
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]))
    BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(folder)
    (folder / ".gitattributes").write_text(_GITATTRIBUTES)
    # the .bin layout older transformers wrote: a torch.save'd state dict
    (folder / "bin").mkdir()
    torch.save(BertModel(cfg).state_dict(), folder / "bin" / "pytorch_model.bin")
    import torchverity

    torchverity.save({"w": torch.ones(2)}, folder / "extra.pt", algo="xxh128")
    torch.onnx.export(torch.nn.Linear(3, 2), (torch.ones(1, 3),), str(folder / "head.onnx"),
                      dynamo=False)
    return folder


def _lightning_ckpt(root: Path) -> tuple[Path, torch.nn.Module]:
    import omegaconf

    from torch_zip_artifacts import lightning_checkpoint, lightning_net

    cfg = omegaconf.OmegaConf.create({"model": {"width": 4, "acts": ["relu", "gelu"]},
                                      "lr": 0.01, "note": None})
    net = lightning_net(cfg)
    return lightning_checkpoint(net, root / "run.ckpt", 2), net


class _Scripted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3, stride=2)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("formats")
    warnings.filterwarnings("ignore")
    ckpt, net = _lightning_ckpt(root)
    broken = root / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_text(_LFS)
    (broken / "pytorch_model.bin").write_text(_HTML)
    (broken / "tokenizer.json").write_text(_LFS)
    script = root / "scripted.pt"
    torch.jit.save(torch.jit.script(_Scripted()), script)
    return {"hf": _hf_folder(root), "ckpt": ckpt, "net": net, "broken": broken,
            "script": script, "root": root}


def test_hf_folder_scan_skips_text_and_names_what_it_skipped(
    files: dict[str, Any], run_cli: Callable[..., Any]
) -> None:
    report = scan(files["hf"])
    judged = sorted(Path(r.path).name for r in report.results)
    assert judged == ["extra.pt", "model.safetensors", "pytorch_model.bin"], judged
    assert report.ok, [(r.path, r.verdict, r.reason) for r in report.results]
    skipped = {Path(s.path).name: s.reason for s in report.skipped}
    for name in (".gitattributes", "tokenizer.json", "config.json", "extra.pt.xxh128",
                 "tokenizer_config.json"):
        assert skipped[name] == "text file, no pickle", (name, skipped)
    assert skipped["head.onnx"] == "ONNX model, no pickle"
    res = run_cli("scan", str(files["hf"]))
    assert res.code == 0 and "malformed" not in res.out
    assert ".gitattributes: skipped (text file, no pickle)" in res.out


def test_broken_downloads_are_named(files: dict[str, Any], run_cli: Callable[..., Any]) -> None:
    report = scan(files["broken"])
    got = {Path(r.path).name: (r.verdict, r.format) for r in report.results}
    assert got == {"model.safetensors": ("malformed", "git-lfs-pointer"),
                   "pytorch_model.bin": ("malformed", "html")}
    assert [Path(s.path).name for s in report.skipped] == ["tokenizer.json"]
    res = run_cli("scan", str(files["broken"] / "model.safetensors"))
    assert res.code == 1 and "Git LFS pointer" in res.out and "next: git lfs pull" in res.out
    res = run_cli("scan", str(files["broken"] / "pytorch_model.bin"))
    assert "HTML page" in res.out and "next: download the file again" in res.out


def test_onnx_and_torchscript_are_named(files: dict[str, Any], run_cli: Callable[..., Any]) -> None:
    onnx = scan_file(files["hf"] / "head.onnx")
    assert (onnx.verdict, onnx.format) == ("safe", "onnx")
    res = run_cli("scan", str(files["hf"] / "head.onnx"))
    assert "next: torchverity inspect" in res.out
    ts = scan_file(files["script"])
    assert (ts.verdict, ts.format) == ("needs-review", "torchscript"), ts.reason
    assert not [g for g in ts.globals if g.category == DANGEROUS]
    tags = {g.category for g in ts.globals if g.name.startswith("torch.jit._pickle.")}
    assert tags == {BENIGN}
    assert "TorchScript archive" in ts.reason and ts.plan is None
    res = run_cli("scan", str(files["script"]))
    assert res.code == 1 and "next: do not torch.jit.load it" in res.out
    assert "torchverity migrate" in res.out


def test_lightning_omegaconf_checkpoint_is_benign_data(files: dict[str, Any]) -> None:
    result = scan_file(files["ckpt"])
    assert result.verdict == "needs-allowlist", result.reason
    omega = {g.name: g.reason for g in result.globals if g.module.startswith("omegaconf")}
    assert {"omegaconf.dictconfig.DictConfig", "omegaconf.listconfig.ListConfig",
            "omegaconf.nodes.AnyNode"} <= set(omega)
    assert all(g.category == BENIGN for g in result.globals if g.module.startswith("omegaconf"))
    assert all("omegaconf" in reason for reason in omega.values())
    any_ = [g for g in result.globals if g.name == "typing.Any"]
    assert any_ and any_[0].category == BENIGN
    assert result.plan is not None and result.plan.loadable
    namespace: dict[str, Any] = {}
    exec(result.plan.code.replace(repr(str(files["ckpt"])), repr(str(files["ckpt"]))),
         namespace)  # our own generated advice, on our own file
    assert set(namespace["obj"]["state_dict"]) == {"layer.weight", "layer.bias"}


def test_lightning_hyper_parameters_migrate_to_plain_json(
    files: dict[str, Any], tmp_path: Path
) -> None:
    from torchverity.pickles import migrate

    result = migrate(files["ckpt"], tmp_path / "run.safetensors")
    text = Path(result.meta_path or "").read_text()
    for leftover in ("_content", "$cycle", "torchverity.migrate.inert", "_metadata"):
        assert leftover not in text, leftover
    content = json.loads(text)["user"]["content"]
    assert content["hyper_parameters"] == {"model": {"width": 4, "acts": ["relu", "gelu"]},
                                           "lr": 0.01, "note": None}


def test_nested_output_loads_into_the_optimizer(
    files: dict[str, Any], tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    import torchverity

    res = run_cli("migrate", "--nested", str(files["ckpt"]), str(tmp_path / "nested.pt"))
    assert res.code == 0 and "read back bit for bit (inert unpickling)" in res.out, res.err
    out = torchverity.load(tmp_path / "nested.pt", sidecar="require")
    model = torch.nn.Linear(2, 1)
    model.load_state_dict({k.removeprefix("layer."): v for k, v in out["model"].items()})
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    opt.load_state_dict(out["optimizer"])
    reference = torch.load(files["ckpt"], weights_only=False)["optimizer_states"][0]
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], reference["state"][0]["exp_avg"])
    assert torch.equal(out["model"]["layer.weight"], files["net"].layer.weight.detach())


def test_inspect_and_fingerprint_read_tensors_inertly(files: dict[str, Any]) -> None:
    """weights_only refuses omegaconf classes and TorchScript: the tensors are listed anyway,
    read by the inert reader, and fingerprinted."""
    import torchverity
    from torchverity.checkpoint import fingerprint_file

    ckpt = torchverity.inspect(files["ckpt"])
    names = {row.name for row in ckpt.tensors}
    assert {"state_dict.layer.weight", "state_dict.layer.bias"} <= names, ckpt.not_loaded
    assert ckpt.scan is not None and ckpt.scan.verdict == "needs-allowlist"
    fingerprint = fingerprint_file(files["ckpt"])
    real = torch.load(files["ckpt"], weights_only=False)  # our own file
    expected = torchverity.fingerprint({"state_dict": real["state_dict"],
                                        "optimizer_states": real["optimizer_states"]})
    # Read inertly, the file's tensors are covered (its plain values stay in inspect's view).
    tensors = {n: d for n, d in expected.tensors.items()
               if d.dtype not in ("bool", "float", "int", "str", "none")}
    assert fingerprint.tensors == tensors and len(tensors) == 8
    scripted = torchverity.inspect(files["script"])
    assert {row.name for row in scripted.tensors} == {"conv.weight", "conv.bias"}
    assert len(fingerprint_file(files["script"]).entries) == 2


def test_empty_files_and_broken_safetensors_headers_are_named(
    tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    from safetensors.torch import save_file

    real = tmp_path / "real.safetensors"
    save_file({"w": torch.ones(4, 4)}, str(real))
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "zero.safetensors").write_bytes(b"\x00" * 8)  # header length 0
    (tmp_path / "cut.safetensors").write_bytes(real.read_bytes()[:40])  # a partial copy
    (tmp_path / "__init__.py").write_bytes(b"")
    expect = {"empty.pt": ("empty", "empty file (0 bytes)"),
              "zero.safetensors": ("safetensors", "header length is 0"),
              "cut.safetensors": ("safetensors", "runs past the end of the file")}
    for name, (fmt, words) in expect.items():
        result = scan_file(tmp_path / name)
        assert (result.verdict, result.format) == ("malformed", fmt), result
        assert words in result.reason and "pickle" not in result.reason, result.reason
        res = run_cli("scan", tmp_path / name)
        assert res.code == 1 and "next: restore the file" in res.out, res.out
    report = scan(tmp_path)
    assert {Path(s.path).name: s.reason for s in report.skipped} == {"__init__.py": "empty file"}
    assert scan_file(real).verdict == "safe"
