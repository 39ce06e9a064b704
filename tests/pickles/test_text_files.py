"""Text or pickle is decided by what every unpickler does with the bytes, not their first one.

Text whose first byte is an opcode letter (``c`` GLOBAL, ``i`` INST: Lightning's
``hparams.yaml`` starting ``cfg:``, a remote-code ``modeling_*.py`` starting ``import``)
makes every unpickler fail before it calls anything: it is text, skipped in folders.
A protocol-0 pickle is printable text too: each one here is proved live in a throwaway
process (its plain loader creates its sentinel, or prints the Zen of Python) and stays a
pickle to scan, inspect, fingerprint and load. Nothing runs under torchverity.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import torchverity
from torch_zip_artifacts import lightning_net
from torchverity.errors import FormatError, UnsafeFileError
from torchverity.pickles import scan, scan_file
from torchverity.pickles._classes import DANGEROUS

# Every plain reader of a file's bytes: _pickle, pickle.py (what joblib subclasses), joblib.
_LIVE = r"""
import json, pickle, sys
import joblib
for path in json.loads(sys.argv[1]):
    for load in (pickle.load, lambda fh: pickle._Unpickler(fh).load(), joblib.load):
        sys.modules.pop("this", None)
        try:
            with open(path, "rb") as fh:
                load(fh)
        except Exception:
            pass
"""
_ZEN = "Beautiful is better than ugly."


def _run_plainly(paths: list[Path], cwd: Path) -> str:
    """Load each file with every plain reader in one throwaway process; its stdout."""
    proc = subprocess.run([sys.executable, "-c", _LIVE, json.dumps([str(p) for p in paths])],
                          capture_output=True, text=True, timeout=120, check=True, cwd=cwd,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return proc.stdout


def _lightning_run(root: Path) -> Path:
    """A real Trainer run with omegaconf hyper-parameters: lightning_logs/version_0 holds the
    hparams.yaml the logger writes (``cfg:`` first) and the ModelCheckpoint file."""
    import lightning as L
    from omegaconf import OmegaConf

    net = lightning_net({"cfg": OmegaConf.create({"lr": 0.001, "layers": [4, 4]})})
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)),
                                       batch_size=2)
    trainer = L.Trainer(max_steps=1, default_root_dir=str(root), enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.fit(net, data)
    return root / "lightning_logs" / "version_0"


_MODELING = '''import math

import torch
from transformers import PretrainedConfig, PreTrainedModel


class TinyConfig(PretrainedConfig):
    model_type = "tiny-remote"

    def __init__(self, width: int = 4, **kwargs):
        self.width = width
        super().__init__(**kwargs)


class TinyModel(PreTrainedModel):
    config_class = TinyConfig

    def __init__(self, config):
        super().__init__(config)
        self.proj = torch.nn.Linear(config.width, config.width)
        self.scale = math.sqrt(config.width)
        self.post_init()

    def forward(self, x):
        return self.proj(x) / self.scale
'''


def _remote_code_folder(root: Path) -> Path:
    """save_pretrained of a model registered for the auto classes: transformers copies the
    module that defines it (``import math`` first) next to the weights."""
    pytest.importorskip("transformers")
    source = root / "src"
    source.mkdir()
    (source / "modeling_tiny_remote.py").write_text(_MODELING)
    sys.path.insert(0, str(source))
    try:
        import modeling_tiny_remote as m
    finally:
        sys.path.remove(str(source))
    m.TinyConfig.register_for_auto_class()
    m.TinyModel.register_for_auto_class("AutoModel")
    m.TinyModel(m.TinyConfig()).save_pretrained(root / "remote")
    return root / "remote"


# Text that every unpickler fails on before it calls anything, each starting with an opcode.
_TEXTS = {
    ".gitignore": "checkpoints/\nlightning_logs/\n*.ckpt\n",
    "requirements.txt": "certifi==2024.2.2\ntorch>=2.0\nnumpy\n",
    "train.yaml": "callbacks:\n  - early_stopping\ntrainer:\n  max_epochs: 3\n",
    "CHANGELOG.md": "changes in 0.3\n==============\n\n- import fixes\n",
    "INSTALL.md": "install with pip:\n\n    pip install tiny\n",
    "words": "cat\ndog",  # GLOBAL would import a module `at` (none acts on import) and fail
    "notes.md": "PyTorch notes\n\nsee below\n",  # a persistent id: no first pickle has one
    "xsettings.yaml": "x: 1\ny: 2\n",  # "x" is zlib's magic to joblib: decompression fails
    "templates.txt": "template{\n  name: x\n}\n",  # "{" at offset 8, as a safetensors header
    "paths.txt": "c:/data\nlogs\n(tR",  # REDUCE after a global no module provides: never run
    "VALUES.txt": "Values live in C:\\users\\me\n",  # UNICODE: its bad \u escape ends it
}


@pytest.fixture(scope="module")
def text_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("texts")
    _lightning_run(root)
    _remote_code_folder(root)
    for name, text in _TEXTS.items():
        (root / name).write_text(text)
    return root


def test_real_text_files_starting_with_opcode_letters_are_text(
        text_tree: Path, run_cli: Callable[..., Any]) -> None:
    hparams = text_tree / "lightning_logs" / "version_0" / "hparams.yaml"
    modeling = text_tree / "remote" / "modeling_tiny_remote.py"
    assert hparams.read_text().startswith("cfg:\n  lr: 0.001")
    assert modeling.read_text().startswith("import math")
    assert "auto_map" in json.loads((text_tree / "remote" / "config.json").read_text())
    texts = [hparams, modeling, *(text_tree / n for n in _TEXTS)]
    for path in texts:
        result = scan_file(path)
        assert (result.verdict, result.format, result.globals, result.problems) == (
            "safe", "text", (), ()), (path.name, result.reason, result.problems)
        res = run_cli("scan", path)
        assert res.code == 0 and ": safe (text): text file" in res.out, (path.name, res.out)
    report = scan(text_tree)
    judged = {Path(r.path).name: r.verdict for r in report.results}
    assert judged == {"epoch=0-step=1.ckpt": "needs-allowlist", "model.safetensors": "safe"}
    skipped = {Path(s.path).name: s.reason for s in report.skipped}
    assert all(skipped[p.name] == "text file, no pickle" for p in texts), skipped
    assert report.ok
    res = run_cli("scan", text_tree)
    assert res.code == 0, res.out
    assert f"{hparams}: skipped (text file, no pickle)" in res.out
    # ... and no checkpoint to the readers, which know a pickle as the scan does.
    for path in (hparams, text_tree / "words"):
        with pytest.raises(FormatError, match="not a checkpoint"):
            torchverity.load(path, sidecar="ignore")
        for command in ("inspect", "fingerprint"):
            res = run_cli(command, path)
            assert res.code == 2 and "not a checkpoint" in res.err, (command, res.err)


def _payloads(root: Path) -> dict[str, tuple[bytes, Path]]:
    """Printable pickles, each with the sentinel its payload creates."""
    def call(sentinel: Path) -> bytes:
        return b"cos\nsystem\n(S'touch " + str(sentinel).encode() + b"'\ntR"

    out: dict[str, tuple[bytes, Path]] = {}
    for name, make in {
        "notes.txt": lambda s: call(s) + b".",
        "no_stop.txt": call,  # REDUCE runs before the end of the file stops the load
        "model_card.md": lambda s: b"S'model card: fine-tuned on mnist'\n0" + call(s) + b".",
        "inst.txt": lambda s: b"(S'touch " + str(s).encode() + b"'\nios\nsystem\n.",
        # Walks that a stricter reader than CPython's would give up on at once:
        "hex.txt": lambda s: b"I0x10\n0" + call(s) + b".",  # int(text, 0) takes 0x10
        "windows.txt": lambda s: b"S'C:\\users\\me'\n0" + call(s) + b".",  # \u kept as is
        "build.txt": lambda s: b"S'a'\nNb" + call(s) + b".",  # BUILD of None on a str
    }.items():
        sentinel = root / f"RAN-{name}"
        out[name] = (make(sentinel), sentinel)
    return out


def _printable(root: Path) -> dict[str, tuple[Path, Path | None]]:
    """name -> (file, sentinel its payload creates; None: it imports ``this``, which prints)."""
    root.mkdir()
    files: dict[str, tuple[Path, Path | None]] = {}
    for name, (data, sentinel) in _payloads(root).items():
        (root / name).write_bytes(data)
        files[name] = (root / name, sentinel)
    # pickle.py imports the module of a GLOBAL whose name line the end of the file cuts.
    for name, data in (("zen.txt", b"cthis\nzen\n"), ("zen_cut.txt", b"cthis\n")):
        (root / name).write_bytes(data)
        files[name] = (root / name, None)
    return files


def test_printable_pickles_are_pickles_to_every_command(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    live = _printable(tmp_path / "live")
    _run_plainly([p for p, s in live.values() if s is not None], tmp_path)
    dead = [n for n, (_, s) in live.items() if s is not None and not s.exists()]
    assert not dead, f"payloads that did not run under a plain loader: {dead}"
    for name in ("zen.txt", "zen_cut.txt"):
        assert _ZEN in _run_plainly([live[name][0]], tmp_path), name

    files = _printable(tmp_path / "checked")
    for name, (path, _) in files.items():
        result = scan_file(path)
        assert result.verdict == "unsafe", (name, result.reason)
        offender = "this." if name.startswith("zen") else "os.system"
        hits = [g for g in result.globals if g.name.startswith(offender)
                and g.category == DANGEROUS]
        assert hits, (name, [(g.name, g.category) for g in result.globals])
        if name.startswith("zen"):
            assert "importing this prints the Zen of Python" in hits[0].reason
    report = scan(tmp_path / "checked")
    assert not report.skipped and {r.verdict for r in report.results} == {"unsafe"}
    notes = files["notes.txt"][0]
    res = run_cli("inspect", "--json", notes)
    assert res.code == 1 and json.loads(res.out)["scan"]["verdict"] == "unsafe", res.out
    res = run_cli("fingerprint", notes)  # read inertly: fingerprinted, the verdict warned
    assert res.code == 0 and "the scan found it unsafe" in res.err, res.err
    with pytest.raises(UnsafeFileError):
        torchverity.load(notes, sidecar="ignore")
    assert not [n for n, (_, s) in files.items() if s is not None and s.exists()]


def test_a_protocol_0_pickle_of_plain_data_is_read_as_one(tmp_path: Path,
                                                          run_cli: Callable[..., Any]) -> None:
    """inspect reads it inertly and names it a plain pickle; load says torch.load cannot read
    it (not 'not a checkpoint', nor 'protocol 4'). A protocol-0 legacy torch file is one:
    no torch.load reads its text persistent ids, trusted or not, and the refusal says so."""
    path = tmp_path / "settings.pkl"
    path.write_bytes(pickle.dumps({"lr": 0.1, "layers": [4, 4]}, protocol=0))
    assert scan_file(path).verdict == "safe"
    res = run_cli("inspect", path)
    assert res.code == 0 and "plain pickle (pickle.dump" in res.out and "0 tensors" in res.out, res
    with pytest.raises(FormatError, match=r"a plain pickle \(pickle.dump\), not a torch.save"):
        torchverity.load(path, sidecar="ignore")
    legacy = tmp_path / "legacy0.pt"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False,
               pickle_protocol=0)
    res = run_cli("inspect", "--json", legacy)
    assert json.loads(res.out)["format"] == "pt-legacy", res
    with pytest.raises(FormatError, match=r"trust_sha256 cannot help either: .*pickled as "
                                          r"text \(pickle protocol 0\)"):
        torchverity.load(legacy, sidecar="ignore")
