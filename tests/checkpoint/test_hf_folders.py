"""Hugging Face folders as checkpoints, built with transformers' own save_pretrained.

Single file, sharded (``max_shard_size``) and ``.bin`` (what ``safe_serialization=False``
wrote before transformers 5) folders, each with ``config.json``, tokenizer files and
``.gitattributes`` beside the weights. Both ways: every layout loads, inspects and
fingerprints to the model's own fingerprint; a flipped bit is caught against the
folder's manifest and located; an extra file gets advice that is not "restore"; clean
folders raise nothing.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch

import torchverity
from torchverity.checkpoint import CheckpointWarning
from torchverity.errors import IntegrityError
from torchverity.manifest import write_manifest
from torchverity.verify import verify_path

transformers = pytest.importorskip("transformers")

GITATTRIBUTES = ("*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
                 "*.bin filter=lfs diff=lfs merge=lfs -text\n")


def tiny_bert() -> torch.nn.Module:
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=37, vocab_size=100,
                                     max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.BertModel(config).eval()


def _save(model: torch.nn.Module, folder: Path, vocab: Path, **kwargs: object) -> Path:
    if kwargs.pop("bin", False):
        # transformers 5 writes safetensors only; a .bin folder is what 4.x wrote with
        # safe_serialization=False: config.json beside torch.save(state_dict).
        model.config.save_pretrained(folder)
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    else:
        model.save_pretrained(folder, **kwargs)
    transformers.BertTokenizer(str(vocab)).save_pretrained(folder)
    (folder / ".gitattributes").write_text(GITATTRIBUTES)
    return folder


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("hf")
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world"]))
    model = tiny_bert()
    return {
        "model": model,
        "fingerprint": torchverity.fingerprint(model.state_dict(), mode="exact").root,
        "single": _save(model, root / "single", vocab),
        "sharded": _save(model, root / "sharded", vocab, max_shard_size="40KB"),
        "bin": _save(model, root / "bin", vocab, bin=True),
    }


def _copy(src: object, tmp_path: Path) -> Path:
    return Path(shutil.copytree(Path(str(src)), tmp_path / "copy"))


def test_layouts_are_what_transformers_writes(hf: dict[str, object]) -> None:
    assert (Path(str(hf["single"])) / "model.safetensors").is_file()
    assert (Path(str(hf["sharded"])) / "model.safetensors.index.json").is_file()
    assert len(list(Path(str(hf["sharded"])).glob("model-*-of-*.safetensors"))) > 1
    assert (Path(str(hf["bin"])) / "pytorch_model.bin").is_file()
    assert (Path(str(hf["single"])) / "tokenizer_config.json").is_file()


@pytest.mark.parametrize("layout", ["single", "sharded", "bin"])
def test_every_layout_loads_inspects_and_fingerprints(hf: dict[str, object],
                                                      layout: str) -> None:
    folder = Path(str(hf[layout]))
    want = hf["fingerprint"]
    assert torchverity.checkpoint.fingerprint_file(folder).root == want
    result = torchverity.inspect(folder)
    assert result.fingerprint == want and len(result.tensors) == len(hf["model"].state_dict())
    fresh = tiny_bert()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)  # no sidecar: warned, tested below
        torchverity.load(folder, model=fresh)
    assert torchverity.fingerprint(fresh.state_dict(), mode="exact").root == want


def test_the_index_given_directly_is_the_sharded_folder(hf: dict[str, object]) -> None:
    index = Path(str(hf["sharded"])) / "model.safetensors.index.json"
    assert torchverity.checkpoint.fingerprint_file(index).root == hf["fingerprint"]
    assert torchverity.inspect(index).format == "sharded"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        state = torchverity.load(index)
    assert set(state) == set(hf["model"].state_dict())


def test_load_uses_the_folder_manifest_both_ways(hf: dict[str, object], tmp_path: Path) -> None:
    folder = _copy(hf["single"], tmp_path)
    write_manifest(folder)
    weights = folder / "model.safetensors"
    _obj, report = torchverity.load(weights, sidecar="require", with_report=True)
    assert report.digest_source == "manifest" and report.verified is False
    assert verify_path(weights).ok and verify_path(weights).record.endswith(".json")
    with open(weights, "r+b") as fh:  # one bit in the last tensor's data
        fh.seek(-3, 2)
        byte = fh.read(1)[0]
        fh.seek(-3, 2)
        fh.write(bytes([byte ^ 0x10]))
    with pytest.raises(IntegrityError, match="its folder's manifest"):
        torchverity.load(weights, sidecar="require")
    checked = verify_path(weights)
    assert [e.status for e in checked.entries] == ["mismatched"]
    sharded = _copy(hf["sharded"], tmp_path / "s")
    write_manifest(sharded)
    _obj, report = torchverity.load(sharded, sidecar="require", with_report=True)
    assert report.digest_source == "manifest" and len(report.shards) > 1


def test_verify_dir_without_manifest_checks_the_sidecars(hf: dict[str, object], tmp_path: Path,
                                                         run_cli) -> None:
    folder = _copy(hf["single"], tmp_path)
    assert run_cli("verify", folder).code == 2  # nothing recorded at all: said so
    assert run_cli("hash", "--write", folder / "model.safetensors").code == 0
    (folder / "config.json").write_text("{}\n")  # no sidecar: not a false alarm
    clean = run_cli("verify", folder)
    assert clean.code == 0 and "1 ok" in clean.out
    with open(folder / "model.safetensors", "r+b") as fh:
        fh.seek(-1, 2)
        fh.write(b"\x7f")
    damaged = run_cli("verify", folder)
    assert damaged.code == 1 and "model.safetensors" in damaged.out


def test_extra_files_get_their_own_advice_and_exclude_skips_them(
        hf: dict[str, object], tmp_path: Path, run_cli) -> None:
    folder = _copy(hf["sharded"], tmp_path)
    write_manifest(folder)
    assert run_cli("verify", folder).code == 0
    (folder / "notes.txt").write_text("local notes\n")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "x.lock").write_text("")
    extra = run_cli("verify", folder)
    assert extra.code == 1 and "extra:" in extra.err and "restore" not in extra.err
    assert run_cli("verify", folder, "--exclude", "notes.txt", "--exclude", ".cache/*").code == 0
    (folder / "config.json").write_text("{}\n")
    changed = run_cli("verify", folder, "--exclude", "notes.txt", "--exclude", ".cache/*")
    assert changed.code == 1 and "mismatched:" in changed.err and "extra:" not in changed.err


def test_exclude_skips_a_folder_by_name_and_names_recorded_files_it_skips(
        hf: dict[str, object], tmp_path: Path, run_cli) -> None:
    import json

    folder = _copy(hf["sharded"], tmp_path)
    write_manifest(folder)
    (folder / "runs" / "logs").mkdir(parents=True)
    (folder / "runs" / "logs" / "events.out").write_text("x\n")
    assert run_cli("verify", folder).code == 1  # the extra files are seen
    for glob in ("runs", "runs/", "logs"):
        res = run_cli("verify", folder, "--exclude", glob)
        assert res.code == 0 and "events.out" not in res.out, (glob, res.out)
    shard = sorted(folder.glob("model-*-of-*.safetensors"))[0]
    shard.unlink()
    res = run_cli("verify", folder, "--exclude", "runs", "--exclude", shard.name)
    assert res.code == 0  # what was asked to be skipped, but never silently
    assert f"not checked, skipped by --exclude: {shard.name}" in res.out, res.out
    doc = json.loads(run_cli("verify", "--json", folder, "--exclude", "runs",
                             "--exclude", shard.name).out)["results"][0]
    assert doc["skipped"] == [shard.name]


def test_a_subfolder_is_verified_against_the_manifest_above_it(
        hf: dict[str, object], tmp_path: Path, run_cli) -> None:
    """A pipeline's root manifest lists ``text_encoder/...``: verifying the subfolder uses
    it, as load and inspect do, and the advice re-records the root."""
    root = tmp_path / "pipeline"
    sub = Path(shutil.copytree(hf["sharded"], root / "text_encoder"))
    (root / "model_index.json").write_text('{"_class_name": "P"}\n')
    write_manifest(root)
    res = run_cli("verify", sub)
    assert res.code == 0 and f"against {root / 'torchverity.manifest.json'}" in res.out, res.err
    (sub / "notes.txt").write_text("local\n")
    (sub / "config.json").write_text("{}\n")
    res = run_cli("verify", sub)
    rows = {tuple(line.split()[:2]) for line in res.out.splitlines()[1:]}
    assert res.code == 1 and ("mismatched", "config.json") in rows, res.out
    assert ("extra", "notes.txt") in rows and "model_index.json" not in res.out
    assert f"torchverity manifest {root}" in res.err and f"manifest {sub}" not in res.err


def test_inspect_says_which_shard_differs_from_its_record_and_what_to_do(
        hf: dict[str, object], tmp_path: Path, run_cli) -> None:
    import json

    folder = _copy(hf["sharded"], tmp_path)
    write_manifest(folder)
    clean = run_cli("inspect", folder)
    assert clean.code == 0 and "damaged" not in clean.err, clean.err
    shard = sorted(folder.glob("model-*-of-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-8] ^= 0x40  # inside the last tensor's data
    shard.write_bytes(bytes(data))
    res = run_cli("inspect", folder)
    assert res.code == 1
    assert f"torchverity: damaged: {shard}: blake3 " in res.err, res.err
    assert "does not match" in res.err and f"torchverity verify {folder}" in res.err
    doc = json.loads(run_cli("inspect", "--json", folder).out)
    assert doc["ok"] is False and len(doc["problems"]) == 1 and shard.name in doc["problems"][0]
    shard.unlink()
    gone = run_cli("inspect", folder)
    assert "(1 missing)" in gone.out and "have none" not in gone.out, gone.out


def test_inspect_names_the_tensor_a_damaged_shard_lost(tmp_path: Path, run_cli) -> None:
    """A sharded save with a meta.json per shard: the damaged tensor is named."""
    import json

    g = torch.Generator().manual_seed(0)
    state = {f"layer.{i}.weight": torch.randn(64, 64, generator=g) for i in range(4)}
    folder = tmp_path / "ckpt"
    torchverity.save(state, folder, shard_bytes=40_000)
    shard = sorted(folder.glob("model-*-of-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-8] ^= 0x40
    shard.write_bytes(bytes(data))
    res = run_cli("inspect", folder)
    damaged = [line for line in res.err.splitlines() if line.startswith("torchverity: damaged:")]
    assert res.code == 1 and len(damaged) == 1, res.err
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    last = max((k for k in header if k != "__metadata__"),
               key=lambda k: header[k]["data_offsets"][1])
    assert damaged[0].endswith(f"damaged tensors: {last}"), damaged


def test_a_renamed_shard_is_told_by_its_digest(hf: dict[str, object], tmp_path: Path,
                                              run_cli) -> None:
    folder = _copy(hf["sharded"], tmp_path)
    write_manifest(folder)
    (folder / "notes.txt").write_text("x" * 10)  # an extra file of another size: not hashed
    shard = sorted(folder.glob("model-*-of-*.safetensors"))[0]
    moved = shard.with_name(shard.stem + ".old.safetensors")
    shard.rename(moved)
    res = run_cli("verify", folder)
    assert res.code == 1
    assert (f"renamed: {moved.name} holds the recorded bytes of the missing {shard.name}; "
            f"if the name is what changed, rename it back: mv {moved} {shard}") in res.err
    assert "missing: copy those files" not in res.err and "extra: files" in res.err  # notes
    shutil.copy(folder / "config.json", moved)  # other bytes of the same name: no rename
    res = run_cli("verify", folder)
    assert "renamed:" not in res.err and "missing: copy those files" in res.err


def test_inspect_takes_the_index_itself(hf: dict[str, object], tmp_path: Path, run_cli) -> None:
    import json

    folder = _copy(hf["sharded"], tmp_path)
    index = folder / "model.safetensors.index.json"
    res = run_cli("inspect", "--json", index)
    assert res.code == 0, res.err
    doc = json.loads(res.out)
    assert doc["fingerprint"] == hf["fingerprint"] and doc["format"] == "sharded"
    assert doc["problems"] == [] and len(doc["shards"]) > 1
    shard = sorted(folder.glob("model-*-of-*.safetensors"))[-1]
    shard.unlink()  # a shard missing: named through the index as through the folder
    for target in (index, folder):
        res = run_cli("inspect", target)
        assert res.code == 1 and shard.name in res.err and "Traceback" not in res.err, res.err


def test_ambiguous_folder_hint_fits_every_command(hf: dict[str, object], tmp_path: Path,
                                                  run_cli) -> None:
    """Two weights files in a folder with spaces and non-ASCII in its name: each command's
    hint names files that exist, quoted for the shell, and no other command."""
    import shlex

    folder = tmp_path / "my models ü"
    shutil.copytree(Path(str(hf["single"])), folder)
    (folder / "model.safetensors").rename(folder / "modèle 1.safetensors")
    torch.save({"w": torch.ones(2)}, folder / "résumé ckpt.pt")
    for command in ("fingerprint", "inspect"):
        res = run_cli(command, folder)
        assert res.code == 2 and "Traceback" not in res.err
        (hint,) = [line for line in res.err.splitlines() if "next:" in line]
        assert "torchverity" not in hint, hint  # not another command's name
        named = [Path(w) for w in shlex.split(hint.split("e.g.", 1)[1]) if w != "or"]
        assert named and all(p.is_file() for p in named), hint
        assert run_cli(command, named[0]).code == 0


@pytest.mark.parametrize("layout", ["safetensors", "bin"])
def test_verify_of_the_index_checks_the_shards_against_the_manifest(
        hf: dict[str, object], tmp_path: Path, run_cli, layout: str) -> None:
    """The index given directly stands for the checkpoint: a shard that no longer matches the
    folder's manifest fails it, and a removed shard is named as missing."""
    import json

    from torch_zip_artifacts import save_bin_shards
    from torchverity.inject import flip_bit

    if layout == "safetensors":
        folder = _copy(hf["sharded"], tmp_path)
        index, pattern = folder / "model.safetensors.index.json", "model-*-of-*.safetensors"
    else:
        folder = tmp_path / "bin-shards"
        save_bin_shards(hf["model"], folder)
        index, pattern = folder / "pytorch_model.bin.index.json", "pytorch_model-*-of-*.bin"
    write_manifest(folder)
    shards = sorted(folder.glob(pattern))
    assert len(shards) > 2
    clean = run_cli("verify", index)
    assert clean.code == 0 and f"OK ({len(shards) + 1} ok)" in clean.out, clean.err
    flip_bit(shards[0], shards[0].stat().st_size - 100, 5)
    shards[-1].unlink()
    bad = run_cli("verify", index)
    assert bad.code == 1 and shards[0].name in bad.out and shards[-1].name in bad.out
    assert "restore those files from a good copy" in bad.err
    got = {e["path"]: e["status"]
           for e in json.loads(run_cli("verify", "--json", index).out)["results"][0]["entries"]}
    assert got == {index.name: "ok", shards[0].name: "mismatched", shards[-1].name: "missing",
                   **{s.name: "ok" for s in shards[1:-1]}}
