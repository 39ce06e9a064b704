"""A distributed checkpoint's data file (``__0_0.distcp``) is torch.save archives one after
another, one per item; its reader torch.loads each from its offset, non-tensor items with
weights_only=False. The scan walks every archive's pickle: a clean checkpoint is safe, a
payload in one item is named with the archive that holds it."""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from pickle_corpus import Touch
from torchverity.pickles import scan_file

_DCP_LOAD = """
import sys, warnings
import torch.distributed.checkpoint as dcp
warnings.simplefilter("ignore")
state = {"extra": None}
try:
    dcp.load(state, checkpoint_id=sys.argv[1])
except Exception:
    pass
"""


def _save(folder: Path, extra: Any) -> Path:
    model = torch.nn.Linear(4, 3)
    with warnings.catch_warnings():  # one process, no process group: torch warns
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "step": 5, "extra": extra},
                 checkpoint_id=folder)
    return folder / "__0_0.distcp"


def test_each_archive_of_a_data_file_is_walked(tmp_path: Path,
                                               run_cli: Callable[..., Any]) -> None:
    clean = _save(tmp_path / "clean", {"lr": 0.1, "betas": [0.9, 0.99]})
    result = scan_file(clean)
    assert result.verdict == "safe" and result.format == "torch-zip-stack", result.reason
    assert run_cli("scan", tmp_path / "clean").code == 0

    live = tmp_path / "live-ran"
    folder = _save(tmp_path / "live", Touch(live)).parent
    subprocess.run([sys.executable, "-c", _DCP_LOAD, str(folder)], check=True, timeout=120,
                   capture_output=True)
    assert live.exists(), "the payload did not run under dcp.load"

    sentinel = tmp_path / "SENTINEL"
    evil = _save(tmp_path / "evil", Touch(sentinel))
    result = scan_file(evil)
    assert result.verdict == "unsafe", result.reason
    hits = [g for g in result.globals if g.name in ("os.system", "posix.system")]
    assert hits and hits[0].entry.startswith("archive at byte "), hits
    assert hits[0].entry.endswith("/data.pkl")
    assert run_cli("scan", tmp_path / "evil").code == 1
    assert not sentinel.exists()


def test_bytes_between_archives_are_not_a_stack(tmp_path: Path) -> None:
    """Only whole archives back to back read as a stack; anything else stays malformed."""
    data = _save(tmp_path / "dcp", {"lr": 0.1})
    raw = data.read_bytes()
    cut = raw.rfind(b"PK\x03\x04", 0, len(raw) - 1)  # the last archive's first member
    data.write_bytes(raw[:cut] + b"\x00" * 16 + raw[cut:])
    assert scan_file(data).verdict == "malformed"
    single = tmp_path / "single.pt"
    torch.save({"w": torch.ones(2)}, single)
    assert scan_file(single).format == "torch-zip"  # one archive: read as before
