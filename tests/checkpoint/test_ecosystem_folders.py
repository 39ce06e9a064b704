"""Folders the ecosystem writes, built with the real libraries: a diffusers pipeline
(``save_pretrained``, safetensors and .bin), a PEFT LoRA adapter and its merged model, and a
folder of ONNX models. Every artifact command gives the right verdict and a next step that fits.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import torchverity
from pickle_corpus import payload_runs
from torch_zip_artifacts import tiny_ldm_pipeline
from torchverity.errors import InputError, StateDictMismatchError

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

_ARTIFACT_COMMANDS = ("scan", "inspect", "fingerprint", "verify")


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipelines")
    return {"safetensors": tiny_ldm_pipeline(root / "ddpm"),
            "bin": tiny_ldm_pipeline(root / "ddpm_bin", safe_serialization=False)}


def _gpt2() -> Any:
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64,
                                     n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def _lora(model: Any) -> Any:
    return peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["c_attn"],
                                                      init_lora_weights=False))


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _lora(_gpt2())
        model.save_pretrained(root / "lora")
        model.merge_and_unload().save_pretrained(root / "merged")
    return {"lora": root / "lora", "merged": root / "merged"}


def _json(run_cli: Callable[..., Any], *args: Any) -> tuple[int, dict[str, Any]]:
    result = run_cli(args[0], "--json", *args[1:])
    assert "Traceback" not in result.out + result.err
    return result.code, json.loads(result.out)


# ------------------------------------------------------------ diffusers pipelines


@pytest.mark.parametrize("layout", ["safetensors", "bin"])
def test_pipeline_root_covers_every_component(pipelines: dict[str, Path], layout: str,
                                              run_cli: Callable[..., Any]) -> None:
    """scan, inspect and fingerprint of a pipeline root cover each component (not 'no
    weights files'); load, which reads one checkpoint, names the components to choose from."""
    root = pipelines[layout]
    code, doc = _json(run_cli, "scan", root)
    assert code == 0
    assert sorted(Path(f["path"]).relative_to(root).parts[0] for f in doc["files"]) == [
        "unet", "vqvae"]
    assert {Path(s["path"]).name for s in doc["skipped"]} == {
        "model_index.json", "scheduler_config.json", "config.json"}
    code, doc = _json(run_cli, "inspect", root)
    assert code == 0 and sorted(doc["components"]) == ["unet", "vqvae"]
    assert all(c["tensors"] and c["fingerprint"] for c in doc["components"].values())
    code, prints = _json(run_cli, "fingerprint", root)
    assert code == 0
    for name, component in prints["components"].items():
        assert component["root"] == _json(run_cli, "fingerprint", root / name)[1]["root"]
        assert component["root"] == doc["components"][name]["fingerprint"]
    with pytest.raises(InputError, match="diffusers pipeline") as caught:
        torchverity.load(root, sidecar="ignore")
    assert "unet, vqvae" in caught.value.message
    assert f"{root / 'unet'}" in (caught.value.hint or "")


@pytest.mark.parametrize("layout", ["safetensors", "bin"])
def test_pipeline_component_is_a_checkpoint(pipelines: dict[str, Path], layout: str,
                                            run_cli: Callable[..., Any]) -> None:
    """The hint's component folder reads as a checkpoint, the same in either format."""
    unet = pipelines[layout] / "unet"
    code, doc = _json(run_cli, "fingerprint", unet)
    assert code == 0 and len(doc["tensors"]) == 114
    code, listed = _json(run_cli, "inspect", unet)
    assert code == 0 and len(listed["tensors"]) == 114
    other = pipelines["bin" if layout == "safetensors" else "safetensors"] / "unet"
    assert _json(run_cli, "fingerprint", other)[1]["root"] == doc["root"]
    assert _json(run_cli, "diff", unet, other)[0] == 0


def test_component_with_a_variant_reads_the_default_file(tmp_path: Path,
                                                         run_cli: Callable[..., Any]) -> None:
    """A component saved plain and as the fp16 variant reads as diffusers' from_pretrained
    reads it without variant=: the default file."""
    root = tiny_ldm_pipeline(tmp_path / "ddpm")
    tiny_ldm_pipeline(root, variant="fp16")
    unet = root / "unet"
    assert (unet / "diffusion_pytorch_model.fp16.safetensors").is_file()
    code, doc = _json(run_cli, "inspect", unet)
    assert code == 0, doc
    default = _json(run_cli, "fingerprint", unet / "diffusion_pytorch_model.safetensors")[1]
    assert doc["fingerprint"] == default["root"]


def test_diff_of_two_pipelines_compares_every_component(
        pipelines: dict[str, Path], adapter: dict[str, Path], tmp_path: Path,
        run_cli: Callable[..., Any]) -> None:
    """A flipped bit anywhere in a pipeline is found and located by its component; the
    same pipeline saved as .bin and as safetensors is equal."""
    assert _json(run_cli, "diff", pipelines["safetensors"], pipelines["bin"])[0] == 0
    bad = shutil.copytree(pipelines["safetensors"], tmp_path / "bad")
    weights = bad / "unet" / "diffusion_pytorch_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x10
    weights.write_bytes(bytes(data))
    code, doc = _json(run_cli, "diff", pipelines["safetensors"], bad)
    unet = len(_json(run_cli, "inspect", bad / "unet")[1]["tensors"])
    vqvae = len(_json(run_cli, "inspect", bad / "vqvae")[1]["tensors"])
    assert code == 1 and doc["counts"]["identical"] == unet + vqvae - 1
    assert [(e["name"].split("/")[0], e["kind"]) for e in doc["entries"]] == [
        ("unet", "bit-flip")]
    weights_file = adapter["merged"] / "model.safetensors"
    code, doc = _json(run_cli, "diff", pipelines["safetensors"], weights_file)
    assert code == 2
    assert doc["hint"].endswith(f"{pipelines['safetensors'] / 'unet'} {weights_file}")


def test_migrate_names_the_nested_component_file(pipelines: dict[str, Path], tmp_path: Path,
                                                 run_cli: Callable[..., Any]) -> None:
    """migrate of a .bin pipeline names each component's file, not 'no checkpoint'."""
    code, doc = _json(run_cli, "migrate", pipelines["bin"], tmp_path / "new.safetensors")
    assert code == 2
    assert doc["hint"] == ("name one checkpoint file in it: unet/diffusion_pytorch_model.bin, "
                           "vqvae/diffusion_pytorch_model.bin")
    one = shutil.copytree(pipelines["bin"], tmp_path / "one", ignore=shutil.ignore_patterns(
        "vqvae"))
    code, doc = _json(run_cli, "migrate", one, tmp_path / "new.safetensors")
    assert code == 2 and doc["hint"] == (
        f"migrate its checkpoint file: torchverity migrate "
        f"{one / 'unet' / 'diffusion_pytorch_model.bin'} {tmp_path / 'new.safetensors'}")


def test_component_file_verifies_against_the_pipeline_manifest(
        pipelines: dict[str, Path], tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    """A manifest at the pipeline root vouches for unet/... when verify or load is given the
    file itself; a flipped bit in it is found both ways."""
    root = shutil.copytree(pipelines["safetensors"], tmp_path / "ddpm")
    assert run_cli("manifest", root).code == 0
    weights = root / "unet" / "diffusion_pytorch_model.safetensors"
    code, doc = _json(run_cli, "verify", weights)
    assert code == 0, doc
    assert doc["results"][0]["record"] == str(root / "torchverity.manifest.json")
    _, report = torchverity.load(weights, with_report=True, sidecar="require")
    assert report.digest_source == "manifest"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x10
    weights.write_bytes(bytes(data))
    code, doc = _json(run_cli, "verify", weights)
    assert code == 1 and doc["results"][0]["entries"][0]["status"] == "mismatched"
    assert _json(run_cli, "verify", root)[0] == 1




class _Evil:
    def __init__(self, sentinel: Path) -> None:
        self.cmd = f"touch {sentinel}"

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return os.system, (self.cmd,)


def test_malicious_component_is_found_from_the_root_and_never_runs(
        pipelines: dict[str, Path], tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    """A pipeline whose unet .bin carries a payload (proven live under torch.load in a
    throwaway process): scan of the root is unsafe and names the file; no command runs it."""
    root = shutil.copytree(pipelines["bin"], tmp_path / "ddpm_bin")
    weights = root / "unet" / "diffusion_pytorch_model.bin"
    sentinel = tmp_path / "SENTINEL"
    state = torch.load(weights, weights_only=True)
    torch.save({**state, "x": _Evil(sentinel)}, weights)  # type: ignore[dict-item]
    assert payload_runs(weights, sentinel)
    code, doc = _json(run_cli, "scan", root)
    assert code == 1
    verdicts = {Path(f["path"]).relative_to(root).as_posix(): f["verdict"] for f in doc["files"]}
    assert verdicts == {"unet/diffusion_pytorch_model.bin": "unsafe",
                        "vqvae/diffusion_pytorch_model.bin": "safe"}
    # Read inertly, the payload a placeholder: inspect flags the file, fingerprint and
    # migrate take its tensors, and diff finds them equal to the clean copy's.
    for args, want in ((("inspect", root / "unet"), 1), (("fingerprint", root / "unet"), 0),
                       (("migrate", weights, tmp_path / "new.safetensors"), 0),
                       (("diff", root / "unet", pipelines["bin"] / "unet"), 0)):
        code, _ = _json(run_cli, *args)
        assert code == want, args
        assert not sentinel.exists(), f"{args[0]}: the payload ran"


@pytest.mark.parametrize("layout", ["safetensors", "bin"])
def test_every_command_on_the_pipeline_speaks_json(pipelines: dict[str, Path], layout: str,
                                                   tmp_path: Path,
                                                   run_cli: Callable[..., Any]) -> None:
    root = shutil.copytree(pipelines[layout], tmp_path / layout)
    for command in _ARTIFACT_COMMANDS:
        code, doc = _json(run_cli, command, root)
        assert code in (0, 2), (command, doc)
        if code == 2:
            assert doc["hint"] and f"torchverity {command} {root}" not in doc["hint"], command
    assert _json(run_cli, "manifest", root)[0] == 0
    code, doc = _json(run_cli, "verify", root)
    assert code == 0 and len(doc["results"][0]["entries"]) == 6


# ------------------------------------------------------------ PEFT adapters


def test_adapter_folder_reads_as_a_checkpoint(adapter: dict[str, Path],
                                              run_cli: Callable[..., Any]) -> None:
    code, doc = _json(run_cli, "inspect", adapter["lora"])
    assert code == 0
    assert {t["name"].rsplit(".", 2)[-2] for t in doc["tensors"]} == {"lora_A", "lora_B"}
    assert len(_json(run_cli, "fingerprint", adapter["lora"])[1]["tensors"]) == 4
    assert _json(run_cli, "scan", adapter["lora"])[0] == 0


def test_adapter_into_a_peft_model_says_how(adapter: dict[str, Path]) -> None:
    """PEFT files leave the adapter name out of their keys: the mismatch error says so and
    gives the way that works, strict or not; strict=False never loads nothing quietly."""
    weights = adapter["lora"] / "adapter_model.safetensors"
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _lora(_gpt2())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for strict in (True, False):
        with pytest.raises(StateDictMismatchError) as caught:
            torchverity.load(weights, model=model, strict=strict, sidecar="ignore")
        assert "adapter name 'default'" in (caught.value.hint or "")
        assert "set_peft_model_state_dict" in (caught.value.hint or "")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    state = torchverity.load(weights, sidecar="ignore")
    assert peft.set_peft_model_state_dict(model, state).unexpected_keys == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = peft.PeftModel.from_pretrained(_gpt2(), adapter["lora"])
    ours, theirs = model.state_dict(), reference.state_dict()
    lora = [k for k in ours if "lora_" in k]
    assert len(lora) == 4 and all(torch.equal(ours[k], theirs[k]) for k in lora)


def test_explain_names_a_peft_adapter_given_to_load_state_dict(
        adapter: dict[str, Path], run_cli: Callable[..., Any]) -> None:
    """torch's own error for the adapter file loaded into the PeftModel: one PEFT block, not
    the general 'prefix or another architecture'."""
    from safetensors.torch import load_file

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _lora(_gpt2())
    with pytest.raises(RuntimeError) as caught:
        model.load_state_dict(load_file(adapter["lora"] / "adapter_model.safetensors"))
    code, doc = _json(run_cli, "explain", str(caught.value))
    assert code == 0
    assert [e["key"] for e in doc["explanations"]] == ["peft-adapter-keys"]
    assert "set_peft_model_state_dict" in doc["explanations"][0]["fix"]


def test_merged_model_loads_into_its_class_with_tied_weights(adapter: dict[str, Path]) -> None:
    """save_pretrained writes GPT-2's tied lm_head.weight once: it is not 'missing'."""
    model = _gpt2()
    _, report = torchverity.load(adapter["merged"], model=model, with_report=True,
                                 sidecar="ignore")
    assert report.missing_keys == () and report.unexpected_keys == ()
    merged = torchverity.load(adapter["merged"], sidecar="ignore")
    assert torch.equal(model.lm_head.weight, merged["transformer.wte.weight"])


def test_adapter_with_a_prefix_strips_it(adapter: dict[str, Path], tmp_path: Path) -> None:
    """The merged weights saved by a DDP-wrapped trainer load with strip_prefix."""
    merged = torchverity.load(adapter["merged"], sidecar="ignore")
    path = tmp_path / "ddp.pt"
    torch.save({f"module.{k}": v for k, v in merged.items()}, path)
    model = _gpt2()
    with pytest.raises(StateDictMismatchError, match="unexpected") as caught:
        torchverity.load(path, model=model, sidecar="ignore")
    assert "strip_prefix='module.'" in (caught.value.hint or "")
    torchverity.load(path, model=model, sidecar="ignore", strip_prefix="module.")
    assert torch.equal(model.transformer.wte.weight, merged["transformer.wte.weight"])


# ------------------------------------------------------------ ONNX folders


def test_scan_of_an_onnx_folder_names_inspect_and_fingerprint(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    pytest.importorskip("onnx")
    folder = tmp_path / "onnx_only"
    folder.mkdir()
    model = folder / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(torch.nn.Linear(3, 2), (torch.ones(1, 3),), str(model), dynamo=False)
    result = run_cli("scan", folder)
    assert result.code == 2 and "Traceback" not in result.err
    step = result.err.split("next: ", 1)[1]
    assert f"torchverity inspect {model}" in step and f"torchverity fingerprint {model}" in step
    assert run_cli("inspect", model).code == 0
    for command in ("inspect", "fingerprint"):
        code, doc = _json(run_cli, command, folder)
        assert code == 2 and doc["hint"] == f"give the ONNX model file instead: {model}"


def test_migrate_of_a_safetensors_folder_says_nothing_to_migrate(
        pipelines: dict[str, Path], adapter: dict[str, Path], tmp_path: Path,
        run_cli: Callable[..., Any]) -> None:
    for folder, weights in ((pipelines["safetensors"], "unet/diffusion_pytorch_model"),
                            (adapter["lora"], "adapter_model"),
                            (adapter["merged"], "model")):
        code, doc = _json(run_cli, "migrate", folder, tmp_path / "new.pt")
        assert code == 2 and "nothing to migrate" in doc["hint"], doc
        assert f"torchverity inspect {folder / weights}.safetensors" in doc["hint"]
