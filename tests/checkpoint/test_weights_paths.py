"""Weights that are not what their name says, given to every path that loads weights into a
model: torchverity.load and the --weights option of golden and batch. Each is named as what
it is (a Git LFS pointer, an HTML page, a numpy or joblib file, a PEFT adapter) before any
question of its recorded digest, with exit 2 and a next step that fits.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import joblib
import numpy as np
import pytest
import torch

import torchverity
from torchverity.errors import FormatError, StateDictMismatchError

MODEL_SOURCE = '''
import torch

class Lin(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.l(x)

def build():
    return Lin()

def build_batch(state=None):
    model = Lin()
    if state is not None:
        model.load_state_dict(state)

    def fn(item):
        return model(torch.ones(4)).detach()
    fn.model = model
    return fn
'''


class Lin(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = torch.nn.Linear(4, 2)


@pytest.fixture(scope="module")
def bad_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One file of each kind that is not a PyTorch checkpoint, none with a recorded digest."""
    root = tmp_path_factory.mktemp("weights")
    (root / "lfs").mkdir()
    (root / "lfs" / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "a" * 64 + "\nsize 1234\n")
    (root / "html").mkdir()
    (root / "html" / "model.safetensors").write_text(
        "<!DOCTYPE html><html><body>Access denied</body></html>")
    np.savez(root / "w.npz", a=np.ones(3))
    joblib.dump({"w": np.ones(3)}, root / "w.joblib")
    joblib.dump({"w": np.ones(3)}, root / "wz.joblib", compress=3)
    joblib.dump({"w": np.ones(3)}, root / "wg.joblib", compress=("gzip", 3))
    return {"lfs": root / "lfs", "html": root / "html" / "model.safetensors",
            "npz": root / "w.npz", "joblib": root / "w.joblib", "zlib": root / "wz.joblib",
            "gzip": root / "wg.joblib"}


_NAMED = {"lfs": "a Git LFS pointer file", "html": "an HTML page",
          "npz": "a numpy .npz archive", "joblib": "a joblib file (joblib.dump)",
          "zlib": "a zlib-compressed joblib file", "gzip": "a gzip-compressed joblib file"}


@pytest.mark.parametrize("kind", list(_NAMED))
@pytest.mark.parametrize("sidecar", ["warn", "require"])
def test_load_names_what_the_file_is_before_its_record(bad_weights: dict[str, Path],
                                                       kind: str, sidecar: str) -> None:
    """Not 'no sidecar: record the digest with hash --write' (that would vouch for a pointer
    or a web page), not 'refused by the weights_only loader', not 'not a checkpoint'."""
    with pytest.raises(FormatError) as caught:
        torchverity.load(bad_weights[kind], model=Lin(), sidecar=sidecar)  # type: ignore[arg-type]
    assert _NAMED[kind] in caught.value.message
    assert "hash --write" not in (caught.value.hint or "")
    if kind in ("joblib", "zlib", "gzip"):
        assert (caught.value.hint or "").startswith("torchverity scan ")


@pytest.mark.parametrize("kind", ["zlib", "gzip"])
def test_inspect_names_a_compressed_joblib_file(bad_weights: dict[str, Path], kind: str,
                                                run_cli: Callable[..., Any]) -> None:
    """With the next step the uncompressed one gets (scan reads both)."""
    result = run_cli("inspect", bad_weights[kind])
    plain = run_cli("inspect", bad_weights["joblib"])
    assert result.code == plain.code == 2
    assert _NAMED[kind] in result.err and "starts with" not in result.err
    assert result.err.split("next: ")[1].replace(str(bad_weights[kind]), "X") == \
        plain.err.split("next: ")[1].replace(str(bad_weights["joblib"]), "X")
    assert run_cli("scan", bad_weights[kind]).code == 0


@pytest.fixture
def model_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "tvweights_model.py").write_text(MODEL_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "tvweights_model"


@pytest.mark.parametrize("kind", ["lfs", "joblib", "zlib"])
def test_golden_and_batch_weights_name_the_file(bad_weights: dict[str, Path], kind: str,
                                                model_module: str, tmp_path: Path,
                                                run_cli: Callable[..., Any]) -> None:
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "a.txt").write_text("1")
    runs = {
        "golden": ("golden", "record", "--model", f"{model_module}:build", "--weights",
                   bad_weights[kind], "--golden", tmp_path / "g.json", "--shape", "1,4"),
        "batch": ("batch", "run", "--inputs", inputs, "--model", f"{model_module}:build_batch",
                  "--weights", bad_weights[kind], "--out", tmp_path / "out"),
    }
    for args in runs.values():
        result = run_cli(*args)
        assert result.code == 2, result.err
        assert _NAMED[kind] in result.err and "Traceback" not in result.err
        assert "hash --write" not in result.err
        doc = json.loads(run_cli(*args[:2], "--json", *args[2:]).out)
        assert _NAMED[kind] in json.dumps(doc)
    assert not (tmp_path / "g.json").exists()


def test_nothing_fits_does_not_suggest_no_strict(tmp_path: Path) -> None:
    """strict=False refuses a checkpoint none of whose keys the model has, so the hint for
    that case must not send the user there."""
    path = tmp_path / "other.pt"
    torch.save({"encoder.weight": torch.ones(2, 4)}, path)
    for strict in (True, False):
        with pytest.raises(StateDictMismatchError) as caught:
            torchverity.load(path, model=Lin(), sidecar="ignore", strict=strict)
        assert "none of the checkpoint's keys" in caught.value.message
        assert "strict=False" not in (caught.value.hint or "")
        assert f"torchverity inspect {path}" in (caught.value.hint or "")


def test_peft_adapter_given_to_its_base_model_is_named(tmp_path: Path) -> None:
    """A PEFT adapter folder loaded into the base model it was made for: the error names
    the adapter and how peft puts it on the base model, with strict=True and strict=False."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()

    def base() -> Any:
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft.get_peft_model(base(), peft.LoraConfig(r=2, target_modules=["c_attn"])) \
            .save_pretrained(tmp_path / "lora")
    for strict in (True, False):
        with pytest.raises(StateDictMismatchError) as caught:
            torchverity.load(tmp_path / "lora", model=base(), sidecar="ignore", strict=strict)
        hint = caught.value.hint or ""
        assert "PEFT adapter" in hint and "PeftModel.from_pretrained" in hint
        assert "strict=False" not in hint


def test_a_sharded_folder_with_no_records_is_told_to_record_them_all(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    """A sidecar for the index alone would be refused shard by shard: the folder's manifest
    records every shard at once, and then the folder loads."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))
    folder = tmp_path / "sharded"
    model.save_pretrained(folder, max_shard_size="4KB")
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    with pytest.raises(torchverity.errors.IntegrityError) as caught:
        torchverity.load(folder, model=model, sidecar="require")
    assert caught.value.hint is not None
    assert caught.value.hint.endswith(f"torchverity manifest {folder}")
    assert run_cli("manifest", folder).code == 0
    torchverity.load(folder, model=model, sidecar="require")


def test_golden_says_when_the_model_cannot_take_the_inputs(
        model_module: str, tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    """A model raising on --shape inputs (or returning objects, such as a KV cache) is bad
    input, exit 2 with what to give instead, not an internal error; the load's own warnings
    are this command's warnings, not Python's."""
    weights = tmp_path / "lin.pt"
    torch.save(Lin().state_dict(), weights)
    result = run_cli("golden", "record", "--model", f"{model_module}:build", "--weights",
                     weights, "--golden", tmp_path / "g.json", "--shape", "1,5")
    assert result.code == 2, result.err
    assert "Lin raised RuntimeError on the inputs float32[1, 5]" in result.err
    assert "internal error" not in result.err and "--inputs FILE" in result.err
    assert f"warning: {weights}: no sidecar" in result.err
    assert "CheckpointWarning" not in result.err


def test_golden_names_an_output_it_cannot_record() -> None:
    from torchverity.errors import InputError
    from torchverity.golden._run import output_leaves

    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))
    with torch.no_grad():
        outputs = model(torch.tensor([[1, 2, 3]]))
    with pytest.raises(InputError, match="DynamicCache") as caught:
        output_leaves(outputs)
    assert "use_cache=False" in (caught.value.hint or "")
    model.config.use_cache = False
    with torch.no_grad():
        assert [n for n, _ in output_leaves(model(torch.tensor([[1, 2, 3]])))] == ["logits"]


def test_a_head_checkpoint_into_its_base_model_names_the_prefix_and_strict(
        tmp_path: Path) -> None:
    """Some unexpected keys are a prefix plus a missing key, others are a head's: nothing
    fits as saved, and stripping the prefix with strict=False is what loads it."""
    path = tmp_path / "head.pt"
    torch.save({"bert.l.weight": torch.ones(2, 4), "bert.l.bias": torch.ones(2),
                "cls.w": torch.ones(3)}, path)
    with pytest.raises(StateDictMismatchError) as caught:
        torchverity.load(path, model=Lin(), sidecar="ignore")
    hint = caught.value.hint or ""
    assert "2 of the 3 unexpected keys are 'bert.' + a missing key" in hint
    assert "--strip-prefix bert." in hint and "strict=False" in hint
    model = Lin()
    with pytest.warns(torchverity.checkpoint.CheckpointWarning, match="cls.w"):
        torchverity.load(path, model=model, sidecar="ignore", strict=False, strip_prefix="bert.")
    assert torch.equal(model.l.weight, torch.ones(2, 4))


def test_a_shard_that_is_a_pointer_is_named_before_the_records(
        tmp_path: Path, model_module: str, run_cli: Callable[..., Any]) -> None:
    """A sharded folder cloned without git-lfs: one shard is a pointer. That is said first,
    not 'record every shard with torchverity manifest' (which would vouch for the pointer)."""
    from safetensors.torch import save_file

    folder = tmp_path / "sharded"
    folder.mkdir()
    save_file({"l.weight": torch.ones(2, 4)}, folder / "model-00001-of-00002.safetensors")
    (folder / "model-00002-of-00002.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "c" * 64 + "\nsize 40\n")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "l.weight": "model-00001-of-00002.safetensors",
        "l.bias": "model-00002-of-00002.safetensors"}}))
    pointer = folder / "model-00002-of-00002.safetensors"
    for sidecar in ("warn", "require"):
        with pytest.raises(FormatError, match="a Git LFS pointer file") as caught:
            torchverity.load(folder, model=Lin(), sidecar=sidecar)  # type: ignore[arg-type]
        assert caught.value.path == str(pointer)
    for args in (("serve", "--model", f"{model_module}:build", "--input-spec", "x:float32:-1,4",
                  "--check"),
                 ("golden", "record", "--model", f"{model_module}:build", "--golden",
                  tmp_path / "g.json", "--shape", "1,4")):
        result = run_cli(*args, "--weights", folder)
        assert result.code == 2, result.err
        assert f"{pointer}: a Git LFS pointer file" in result.err
        assert "torchverity manifest" not in result.err
