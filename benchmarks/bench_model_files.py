"""What checking a model folder's files costs a load: the folder against its weights alone.

A MiniLM-sized BertModel saved with ``save_pretrained`` (86 MiB of safetensors, its
config.json and generation_config.json) and a BERT tokenizer of 30522 tokens (its
tokenizer.json, as large as bert-base's), recorded with ``torchverity manifest``. The
same weights and manifest in a folder of their own are the baseline: ``torchverity.load``
of both verifies the weights against the manifest; the model folder's load also hashes
the files beside them. Rounds alternate the loads; the ratio is the median of the
per-round ratios. ``serve`` checks the files once more before building the model, so its
start pays the check alone twice.

The same model laid out as sentence-transformers-all-MiniLM-L6-v2 is on the hub, cloned
with git: modules.json, sentence_bert_config.json, config_sentence_transformers.json,
1_Pooling/config.json, 2_Normalize/, onnx/ and openvino/ exports, and a ``.git`` of
5000 objects; checked against its manifest and, with no manifest, as a hub cache
snapshot (huggingface_hub's own layout: links into blobs named by content). A last
folder adds 2000 small files in a subfolder, all listed in its manifest: each is hashed.

    python benchmarks/bench_model_files.py [--quick] [--repeat 9]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import transformers

sys.path.insert(0, str(Path(__file__).parent))
import torchverity
from _common import WORK, table, write_results
from torchverity.checkpoint._folders import resolve
from torchverity.checkpoint._model_files import check_model_files
from torchverity.manifest import write_manifest


def sentence_layout(folder: Path, dest: Path, git_objects: int) -> Path:
    """``folder``'s model as all-MiniLM-L6-v2's repository holds it, cloned with git."""
    shutil.copytree(folder, dest, ignore=shutil.ignore_patterns("torchverity.manifest.json"))
    (dest / "generation_config.json").unlink()
    modules = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    (dest / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{k}"}
        for i, (p, k) in enumerate(modules)], indent=2))
    (dest / "sentence_bert_config.json").write_text('{"max_seq_length": 256}')
    (dest / "config_sentence_transformers.json").write_text(
        '{"__version__": {"sentence_transformers": "5.1.0"}, "prompts": {}}')
    (dest / "README.md").write_text("# all-MiniLM-L6-v2\n")
    (dest / "1_Pooling").mkdir()
    (dest / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    (dest / "2_Normalize").mkdir()
    (dest / "onnx").mkdir()
    for name in ("model.onnx", "model_O1.onnx", "model_O2.onnx", "model_qint8_avx512.onnx"):
        (dest / "onnx" / name).write_bytes(b"\0" * 4096)
    (dest / "openvino").mkdir()
    (dest / "openvino" / "openvino_model.xml").write_text("<net/>")
    (dest / "openvino" / "openvino_model.bin").write_bytes(b"\0" * 4096)
    for i in range(git_objects):
        sub = dest / ".git" / "objects" / f"{i % 256:02x}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"{i:038x}").write_bytes(b"x" * 100)
    return dest


def hub_snapshot(folder: Path, cache: Path, commit: str) -> Path:
    """``folder``'s files (but .git) in a hub cache, as ``hf_hub_download`` stores them."""
    from huggingface_hub.file_download import _create_symlink, _get_pointer_path, repo_folder_name

    storage = cache / repo_folder_name(repo_id="org/minilm", repo_type="model")
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and ".git" not in p.parts):
        rel = path.relative_to(folder).as_posix()
        data = path.read_bytes()
        name = (hashlib.sha256(data).hexdigest() if rel.endswith((".safetensors", ".onnx"))
                else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest())
        blob = storage / "blobs" / name
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        pointer = Path(_get_pointer_path(str(storage), commit, rel))
        pointer.parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(pointer), new_blob=True)
    return storage / "snapshots" / commit


def many_files(folder: Path, dest: Path, count: int) -> Path:
    shutil.copytree(folder, dest, ignore=shutil.ignore_patterns(".git"))
    (dest / "extra").mkdir()
    for i in range(count):
        (dest / "extra" / f"item{i}.json").write_text(f'{{"i": {i}}}')
    return dest


def build(root: Path, quick: bool) -> tuple[Path, Path]:
    transformers.logging.set_verbosity_error()
    folder, alone = root / "minilm", root / "weights-only"
    layers, hidden = (2, 64) if quick else (6, 384)
    config = transformers.BertConfig(num_hidden_layers=layers, hidden_size=hidden,
                                     num_attention_heads=12 if hidden % 12 == 0 else 8,
                                     intermediate_size=4 * hidden)
    transformers.BertModel(config).save_pretrained(folder)
    transformers.GenerationConfig(max_new_tokens=16).save_pretrained(folder)
    vocab = root / "vocab.txt"
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab.write_text("\n".join(specials + [f"tok{i}" for i in range(30522 - len(specials))]))
    transformers.BertTokenizer(str(vocab)).save_pretrained(folder)
    alone.mkdir()
    shutil.copy(folder / "model.safetensors", alone)
    for path in (folder, alone):
        write_manifest(path)
    return folder, alone


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    root = WORK / "model-files"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    folder, alone = build(root, args.quick)
    st = sentence_layout(folder, root / "st", 500 if args.quick else 5000)
    snapshot = hub_snapshot(st, root / "hub", "0" * 40)
    many = many_files(st, root / "many", 200 if args.quick else 2000)
    for path in (st, many):
        write_manifest(path)
    runs: dict[str, Callable[[], object]] = {
        "alone": lambda: torchverity.load(alone, sidecar="require"),
        "folder": lambda: torchverity.load(folder, sidecar="require"),
        "check": lambda: check_model_files(resolve(folder)),
        "st": lambda: torchverity.load(st, sidecar="require"),
        "st check": lambda: check_model_files(resolve(st)),
        "hub": lambda: torchverity.load(snapshot, sidecar="require"),
        "hub check": lambda: check_model_files(resolve(snapshot)),
        "many check": lambda: check_model_files(resolve(many)),
    }
    rounds = []
    for i in range(args.repeat):
        order = list(runs) if i % 2 == 0 else list(runs)[::-1]
        rounds.append({name: timed(runs[name]) for name in order})
    med = {k: statistics.median(r[k] for r in rounds) for k in runs}
    ratio = {k: statistics.median(r[k] / r["alone"] for r in rounds) for k in runs}
    beside = sorted(p.name for p in folder.iterdir() if p.name not in (
        "model.safetensors", "torchverity.manifest.json"))
    sizes = sum((folder / n).stat().st_size for n in beside)
    mib = (folder / "model.safetensors").stat().st_size / 2**20
    entries = sum(len(f) + len(d) for _p, d, f in os.walk(st))
    checked = {k: len(check_model_files(resolve(p)).checked)  # type: ignore[union-attr]
               for k, p in (("st", st), ("hub", snapshot), ("many", many))}
    rows = [
        ("torchverity.load(weights-only folder) (baseline)", "alone", ""),
        ("torchverity.load(model folder): the files beside checked too", "folder", ""),
        ("the check of the files beside alone", "check", ""),
        ("torchverity.load(sentence-transformers folder, manifest)", "st", ""),
        ("its check alone", "st check", f"{checked['st']} of {entries} files and folders"),
        ("torchverity.load(the same as a hub cache snapshot)", "hub", ""),
        ("its check alone, against the blob names", "hub check", f"{checked['hub']}"),
        ("the check of a folder with 2000 more listed files", "many check",
         f"{checked['many']}"),
    ]
    body = (f"Weights: {mib:.0f} MiB of safetensors; beside them {', '.join(beside)} "
            f"({sizes / 2**10:.0f} KiB). Medians of {args.repeat} alternating rounds, page "
            "cache warm. The sentence-transformers folder is a git clone: its manifest "
            "leaves the .git folder out (as torchverity manifest leaves version control's "
            "folders out) and the walk never enters it; the hub snapshot, with no manifest, "
            "costs its 8 small files.\n\n" + table(("load", "median s", "vs the weights alone",
                                        "files hashed"), [
                (label, f"{med[key]:.4f}", "1.00x" if key == "alone" else f"{ratio[key]:.3f}x",
                 note) for label, key, note in rows]))
    command = "python benchmarks/bench_model_files.py" + (" --quick" if args.quick else "")
    print(write_results("model-files", "Model folders: checking the files beside the weights",
                        command, body))


if __name__ == "__main__":
    main()
