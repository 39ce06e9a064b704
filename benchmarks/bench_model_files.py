"""What checking a model folder's files costs a load: the folder against its weights alone.

A MiniLM-sized BertModel saved with ``save_pretrained`` (86 MiB of safetensors, its
config.json and generation_config.json) and a BERT tokenizer of 30522 tokens (its
tokenizer.json, as large as bert-base's), recorded with ``torchverity manifest``. The
same weights and manifest in a folder of their own are the baseline: ``torchverity.load``
of both verifies the weights against the manifest; the model folder's load also hashes
the files beside them. Rounds alternate the two loads; the ratio is the median of the
per-round ratios. ``serve`` checks the files once more before building the model, so its
start pays the check alone twice.

    python benchmarks/bench_model_files.py [--quick] [--repeat 9]
"""

from __future__ import annotations

import argparse
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
    runs: dict[str, Callable[[], object]] = {
        "alone": lambda: torchverity.load(alone, sidecar="require"),
        "folder": lambda: torchverity.load(folder, sidecar="require"),
        "check": lambda: check_model_files(resolve(folder)),
    }
    rounds = []
    for i in range(args.repeat):
        order = list(runs) if i % 2 == 0 else list(runs)[::-1]
        rounds.append({name: timed(runs[name]) for name in order})
    base, whole, check = (statistics.median(r[k] for r in rounds) for k in runs)
    ratio = statistics.median(r["folder"] / r["alone"] for r in rounds)
    beside = sorted(p.name for p in folder.iterdir() if p.name not in (
        "model.safetensors", "torchverity.manifest.json"))
    sizes = sum((folder / n).stat().st_size for n in beside)
    mib = (folder / "model.safetensors").stat().st_size / 2**20
    body = (f"Weights: {mib:.0f} MiB of safetensors; beside them {', '.join(beside)} "
            f"({sizes / 2**10:.0f} KiB). Medians of {args.repeat} alternating rounds, page "
            "cache warm.\n\n" + table(("load", "median s", "vs the weights alone"), [
                ("torchverity.load(weights-only folder) (baseline)", f"{base:.4f}", "1.00x"),
                ("torchverity.load(model folder): the files beside checked too",
                 f"{whole:.4f}", f"{ratio:.3f}x"),
                ("the check of the files beside alone", f"{check:.4f}", f"{check / base:.3f}x"),
            ]))
    command = "python benchmarks/bench_model_files.py" + (" --quick" if args.quick else "")
    print(write_results("model-files", "Model folders: checking the files beside the weights",
                        command, body))


if __name__ == "__main__":
    main()
