"""Loading into a model the way PyTorch users do: strict=False reported, prefixes stripped,
keys mapped, non-persistent buffers accepted, through load, serve, golden and batch.

The checkpoints are real: transformers' BertModel / BertForMaskedLM save_pretrained files
(and one carrying ``embeddings.position_ids``, as older hub uploads do), a DDP-style
``module.`` state_dict. Both ways: mismatches raise with the right diagnosis; fitted loads
give the model exactly the file's tensors and report what was left out.
"""

from __future__ import annotations

import json
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import torchverity
from torchverity.checkpoint import CheckpointWarning
from torchverity.checkpoint._key_map import parse_key_map
from torchverity.errors import StateDictMismatchError, UsageError
from torchverity.manifest import write_manifest

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

CONFIG = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=37,
              vocab_size=100, max_position_embeddings=64)
MODELS = textwrap.dedent(
    f"""
    import torch
    import transformers

    def bert():
        torch.manual_seed(1)
        return transformers.BertModel(transformers.BertConfig(**{CONFIG!r})).eval()

    def net():
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))

    def build(state):
        model = net()
        model.load_state_dict(state)
        return lambda item: model(torch.ones(4)).detach()
    """
)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fit")
    (root / "tv_fit_models.py").write_text(MODELS)
    config = transformers.BertConfig(**CONFIG)
    torch.manual_seed(0)
    base = transformers.BertModel(config).eval()
    hub = root / "hub"
    base.save_pretrained(hub)
    # Older hub uploads still hold the non-persistent position_ids buffer.
    state = safetensors_torch.load_file(hub / "model.safetensors")
    state["embeddings.position_ids"] = torch.arange(64).unsqueeze(0)
    safetensors_torch.save_file(state, hub / "model.safetensors", metadata={"format": "pt"})
    write_manifest(hub)
    mlm = root / "mlm"
    transformers.BertForMaskedLM(config).save_pretrained(mlm)
    torch.manual_seed(2)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    ddp = root / "ddp.pt"
    torchverity.save({f"module.{k}": v for k, v in net.state_dict().items()}, ddp)
    torch.save(torch.randint(0, 100, (2, 8)), root / "ids.pt")
    return {"root": root, "hub": hub, "mlm": mlm, "ddp": ddp, "base_fp": Path(
        torchverity.fingerprint(base.state_dict(), mode="exact").root)}


def net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def _bert() -> torch.nn.Module:
    return transformers.BertModel(transformers.BertConfig(**CONFIG)).eval()


def test_hub_file_with_a_non_persistent_buffer_loads_strictly(files: dict[str, Path]) -> None:
    model = _bert()
    with pytest.warns(CheckpointWarning, match="no meta.json"):
        _obj, report = torchverity.load(files["hub"] / "model.safetensors", model=model,
                                        with_report=True)
    assert report.digest_source == "manifest"
    assert report.ignored_keys == ("embeddings.position_ids",)
    assert report.missing_keys == report.unexpected_keys == ()
    assert torchverity.fingerprint(model.state_dict(), mode="exact").root == files["base_fp"].name


def test_prefix_diagnosis_and_strip(files: dict[str, Path]) -> None:
    with pytest.raises(StateDictMismatchError) as caught:
        torchverity.load(files["ddp"], model=net())
    assert "every unexpected key is 'module.' + a missing key" in (caught.value.hint or "")
    assert "--strip-prefix module." in (caught.value.hint or "")
    model = net()
    _obj, report = torchverity.load(files["ddp"], model=model, strip_prefix="module.",
                                    with_report=True)
    assert report.verified and report.missing_keys == report.unexpected_keys == ()
    mapped = net()
    torchverity.load(files["ddp"], model=mapped, key_map={"module.0.": "0.", "module.2.": "2."})
    assert torch.equal(mapped.state_dict()["2.bias"], model.state_dict()["2.bias"])


def test_head_checkpoint_into_base_model_loudly(files: dict[str, Path]) -> None:
    weights = files["mlm"] / "model.safetensors"
    with pytest.raises(StateDictMismatchError) as caught:
        torchverity.load(weights, model=_bert(), sidecar="ignore")
    assert "strict=False" in (caught.value.hint or "")  # cls.* is not a prefix problem
    model = _bert()
    with pytest.warns(CheckpointWarning, match="strict=False: .* not in the model"):
        _obj, report = torchverity.load(weights, model=model, sidecar="ignore", strict=False,
                                        strip_prefix="bert.", with_report=True)
    assert report.unexpected_keys and all(k.startswith("cls.") for k in report.unexpected_keys)
    assert report.missing_keys and all(k.startswith("pooler.") for k in report.missing_keys)
    loaded = safetensors_torch.load_file(weights)
    assert torch.equal(model.state_dict()["embeddings.word_embeddings.weight"],
                       loaded["bert.embeddings.word_embeddings.weight"])


def test_golden_and_serve_the_unmodified_hub_folder(files: dict[str, Path], run_cli,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("fastapi")
    monkeypatch.syspath_prepend(str(files["root"]))
    golden = files["root"] / "golden.json"
    common = ("--model", "tv_fit_models:bert", "--weights", files["hub"], "--golden", golden)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        recorded = run_cli("golden", "record", *common, "--inputs", files["root"] / "ids.pt")
        assert recorded.code == 0, recorded.err
        assert run_cli("golden", "check", *common).code == 0
        served = run_cli("serve", "--check", "--json", "--model", "tv_fit_models:bert",
                         "--weights", files["hub"], "--input-spec", "input_ids:int64:-1,8",
                         "--golden", golden)
    assert served.code == 0, served.err
    assert '"verified_by": "manifest"' in served.out


def test_batch_weights_with_a_prefix(files: dict[str, Path], run_cli, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(files["root"]))
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "a.txt").write_text("a")
    args = ("batch", "run", "--inputs", inputs, "--model", "tv_fit_models:build",
            "--weights", files["ddp"], "--out")
    assert run_cli(*args, tmp_path / "bad").code != 0  # module. keys do not fit build()
    done = run_cli(*args, tmp_path / "ok", "--strip-prefix", "module.")
    assert done.code == 0, done.err


@pytest.mark.parametrize("wrappers,prefix", [("dp-compile", "module._orig_mod."),
                                             ("compile-dp", "_orig_mod.module.")])
def test_stacked_wrapper_prefixes_are_named_and_stripped(tmp_path: Path, wrappers: str,
                                                         prefix: str) -> None:
    """DataParallel (module., as DDP) around torch.compile (_orig_mod.), and the other way
    round: the error names the stack as the one option to pass, and the stack strips."""
    inner = net()
    wrapped = (torch.nn.DataParallel(torch.compile(inner)) if wrappers == "dp-compile"
               else torch.compile(torch.nn.DataParallel(inner)))
    path = tmp_path / "wrapped.pt"
    torchverity.save(wrapped.state_dict(), path)
    with pytest.raises(StateDictMismatchError) as caught:
        torchverity.load(path, model=net())
    hint = caught.value.hint or ""
    assert f"every unexpected key is '{prefix}' + a missing key" in hint
    assert f"strip_prefix='{prefix}'" in hint and f"--strip-prefix {prefix})" in hint
    for strip in (prefix, ["module.", "_orig_mod."]):
        model = net()
        _obj, report = torchverity.load(path, model=model, strip_prefix=strip,
                                        with_report=True)
        assert report.missing_keys == report.unexpected_keys == ()
        assert torch.equal(model.state_dict()["2.weight"], inner.state_dict()["2.weight"])


@pytest.mark.parametrize("wrap,inner", [("compile", "_orig_mod"), ("dp", "module")])
def test_a_plain_checkpoint_into_a_wrapped_model_names_the_wrapper(
        tmp_path: Path, wrap: str, inner: str) -> None:
    """The mirror case: the model is wrapped (torch.compile, DataParallel), the checkpoint is
    not. The hint says so and both ways it names load."""
    plain = net()
    path = tmp_path / "plain.pt"
    torchverity.save(plain.state_dict(), path)
    wrapped = torch.compile(net()) if wrap == "compile" else torch.nn.DataParallel(net())
    with pytest.raises(StateDictMismatchError) as caught:
        torchverity.load(path, model=wrapped)
    hint = caught.value.hint or ""
    assert f"every missing key is '{inner}.' + an unexpected key" in hint, hint
    assert f"(model.{inner})" in hint and f"--key-map ={inner}." in hint
    torchverity.load(path, model=getattr(wrapped, inner))  # into the model it wraps
    mapped = torch.compile(net()) if wrap == "compile" else torch.nn.DataParallel(net())
    torchverity.load(path, model=mapped, key_map=parse_key_map([f"={inner}."]))  # or add it
    assert torch.equal(getattr(mapped, inner).state_dict()["2.weight"],
                       plain.state_dict()["2.weight"])


def test_renames_that_break_a_fitting_checkpoint_or_match_nothing_are_said(
        files: dict[str, Path], tmp_path: Path) -> None:
    model = net()
    path = tmp_path / "plain.pt"
    torchverity.save({f"model.{k}": v for k, v in net().state_dict().items()}, path)

    class Wrapper(torch.nn.Module):  # its own keys start with 'model.', as the file's do
        def __init__(self) -> None:
            super().__init__()
            self.model = net()

    with pytest.raises(StateDictMismatchError) as caught:
        torchverity.load(path, model=Wrapper(), strip_prefix="model.")
    assert "the strip_prefix or key_map given renamed them away" in (caught.value.hint or "")
    with pytest.warns(CheckpointWarning, match=r"strip_prefix 'zzz\.' matched no checkpoint key"):
        torchverity.load(path, model=Wrapper(), strip_prefix="zzz.")
    with pytest.raises(UsageError, match=r"would leave every key starting with '\.'") as dotless:
        torchverity.load(files["ddp"], model=model, strip_prefix="module")
    assert "strip_prefix='module.' (CLI: --strip-prefix module.)" in (dotless.value.hint or "")
    for bad in ({"strip_prefix": 5}, {"key_map": ["fc."]}):
        with pytest.raises(UsageError):
            torchverity.load(files["ddp"], model=model, **bad)


def test_no_strict_names_the_prefix_half_the_keys_carry(tmp_path: Path) -> None:
    state = net().state_dict()
    half = {(f"module.{k}" if k.endswith("bias") else k): v for k, v in state.items()}
    path = tmp_path / "half.pt"
    torchverity.save(half, path)
    with pytest.warns(CheckpointWarning) as warned:
        torchverity.load(path, model=net(), strict=False)
    assert any("every unexpected key is 'module.' + a missing key" in str(w.message)
               for w in warned), [str(w.message) for w in warned]
    clean = tmp_path / "clean.pt"
    torchverity.save(state, clean)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torchverity.load(clean, model=net(), strict=False)  # no false alarm


def test_a_dtype_alone_is_named_with_the_cast(tmp_path: Path) -> None:
    path = tmp_path / "half.pt"
    torchverity.save(net().half().state_dict(), path)
    with pytest.raises(StateDictMismatchError) as caught:
        torchverity.load(path, model=net())
    hint = caught.value.hint or ""
    assert "only dtypes differ (the checkpoint holds float16 where the model has float32)" in hint
    assert "model.to(torch.float16)" in hint


def test_a_prefix_is_stripped_once_leaving_the_models_own(tmp_path: Path) -> None:
    """A LightningModule holding a LlamaForCausalLM as self.model saves 'model.model.layers...'
    and 'model.lm_head.weight': stripping 'model.' once fits the Llama model, whose own keys
    start with 'model.' too."""
    import lightning

    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=16)

    class LitLM(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = transformers.LlamaForCausalLM(config)

    lit = LitLM()
    path = tmp_path / "lit.pt"
    torchverity.save(lit.state_dict(), path)
    llama = transformers.LlamaForCausalLM(config)
    with pytest.raises(StateDictMismatchError) as caught:
        torchverity.load(path, model=llama)
    assert "--strip-prefix model.)" in (caught.value.hint or "")
    _obj, report = torchverity.load(path, model=llama, strip_prefix="model.", with_report=True)
    assert report.missing_keys == report.unexpected_keys == ()
    assert torchverity.fingerprint(llama.state_dict()).root == \
        torchverity.fingerprint(lit.model.state_dict()).root


def test_batch_names_a_state_its_factory_refuses_as_load_does(
        files: dict[str, Path], run_cli, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """build(state) calls load_state_dict itself: its RuntimeError becomes the mismatch error
    load gives, with the prefix to strip, not an internal error."""
    from torchverity.batch import run_model_batch

    monkeypatch.syspath_prepend(str(files["root"]))
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "a.txt").write_text("a")
    bad = run_cli("batch", "run", "--inputs", inputs, "--model", "tv_fit_models:build",
                  "--weights", files["ddp"], "--out", tmp_path / "bad")
    assert bad.code == 1, bad.err
    assert "internal error" not in bad.err and "RuntimeError" not in bad.err
    assert f"{files['ddp']}: checkpoint does not fit Sequential" in bad.err
    assert "--strip-prefix module.)" in bad.err
    with pytest.raises(StateDictMismatchError) as caught:
        run_model_batch(inputs, "tv_fit_models:build", tmp_path / "api", weights=files["ddp"])
    assert caught.value.unexpected == ["module.0.bias", "module.0.weight", "module.2.bias",
                                       "module.2.weight"]


def test_no_strict_keys_are_in_the_json_of_golden_and_serve(
        files: dict[str, Path], run_cli, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("fastapi")
    monkeypatch.syspath_prepend(str(files["root"]))
    weights = files["mlm"] / "model.safetensors"
    write_manifest(files["mlm"])
    golden = files["root"] / "mlm.golden.json"
    fit = ("--weights", weights, "--no-strict", "--strip-prefix", "bert.")
    common = ("--model", "tv_fit_models:bert", *fit, "--golden", golden)
    assert run_cli("golden", "record", *common, "--inputs", files["root"] / "ids.pt").code == 0
    checked = run_cli("golden", "check", "--json", *common)
    assert checked.code == 0, checked.err
    loaded = json.loads(checked.out)["weights"]
    assert loaded["missing_keys"] and all(k.startswith("pooler.") for k in loaded["missing_keys"])
    assert loaded["unexpected_keys"] and all(k.startswith("cls.")
                                             for k in loaded["unexpected_keys"])
    assert any("strict=False" in w for w in loaded["warnings"])
    served = run_cli("serve", "--check", "--json", "--model", "tv_fit_models:bert", *fit,
                     "--input-spec", "input_ids:int64:-1,8")
    assert served.code == 0, served.err
    warned = json.loads(served.out)["warnings"]
    assert any("--no-strict" in w and "missing key(s)" in w and "pooler." in w for w in warned)
    assert any("unexpected key(s)" in w and "cls." in w for w in warned)
