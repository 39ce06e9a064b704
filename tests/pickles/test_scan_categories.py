"""Globals that start processes are dangerous wherever they live (uuid's command helper,
_posixsubprocess); os's struct records (a saved os.stat() result) are data. A safetensors
file whose tensor data was cut short is malformed to scan, as to verify."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from torchverity.pickles import scan_file
from torchverity.pickles._classes import BENIGN, DANGEROUS, classify
from torchverity.pickles._values import GlobalRef

_LIVE = """
import pickle, sys
try:
    pickle.load(open(sys.argv[1], "rb"))
except Exception:
    pass
"""


def _uuid_payload(sentinel: Path) -> bytes:
    # uuid._get_command_stdout(command, *args) looks the command up on PATH and runs it.
    return (b"cuuid\n_get_command_stdout\n(S'touch'\nS" + repr(str(sentinel)).encode()
            + b"\ntR.")


def test_process_starting_globals_are_dangerous(tmp_path: Path) -> None:
    assert shutil.which("touch")
    live = tmp_path / "live.pkl"
    ran = tmp_path / "RAN"
    live.write_bytes(_uuid_payload(ran))
    subprocess.run([sys.executable, "-c", _LIVE, str(live)], check=True, timeout=120,
                   capture_output=True)
    for _ in range(50):  # the command runs in a child of the loader
        if ran.exists():
            break
        time.sleep(0.1)
    assert ran.exists(), "uuid._get_command_stdout did not run the command"

    sentinel = tmp_path / "SENTINEL"
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(_uuid_payload(sentinel))
    result = scan_file(evil)
    assert result.verdict == "unsafe", result
    (hit,) = result.globals
    assert (hit.name, hit.category, hit.offset) == ("uuid._get_command_stdout", DANGEROUS, 0)
    assert "runs commands" in hit.reason
    for name in ("_posixsubprocess.fork_exec", "_winapi.CreateProcess", "uuid._popen",
                 "uuid.getnode", "uuid._ifconfig_getnode"):
        module, _, attr = name.rpartition(".")
        category, reason = classify(GlobalRef(module, attr, 0, "GLOBAL"))
        assert category == DANGEROUS and "runs commands" in reason, name
    # uuid's values stay data.
    ids = tmp_path / "ids.pkl"
    ids.write_bytes(pickle.dumps({"run": __import__("uuid").UUID(int=5)}, protocol=2))
    assert scan_file(ids).verdict == "needs-allowlist"
    assert not sentinel.exists()


def test_os_struct_records_are_data_and_the_rest_of_os_is_not(tmp_path: Path) -> None:
    path = tmp_path / "stats.pt"
    torch.save({"w": torch.ones(2), "stat": os.stat(tmp_path), "when": time.gmtime(0)}, path)
    result = scan_file(path)
    assert result.verdict == "needs-allowlist", result
    assert {g.name: g.category for g in result.globals if g.category != "torch"} == {
        "os.stat_result": BENIGN, "time.struct_time": BENIGN}
    for name in ("os.system", "os.popen", "os.open", "os.stat", "os.execv", "time.sleep"):
        module, _, attr = name.rpartition(".")
        category = classify(GlobalRef(module, attr, 0, "GLOBAL"))[0]
        assert category == (DANGEROUS if module == "os" else "unknown"), name


def test_needs_review_names_functions_too(tmp_path: Path) -> None:
    path = tmp_path / "fn.pkl"
    path.write_bytes(b"\x80\x02cmylib.helpers\nmake_thing\n)R.")
    result = scan_file(path)
    assert result.verdict == "needs-review"
    assert result.reason.startswith("code of these classes or functions would run on load: "
                                    "mylib.helpers.make_thing")


def test_a_safetensors_file_cut_inside_its_data_is_malformed(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(64), "b": torch.zeros(64)}, path)
    whole = path.read_bytes()
    clean = run_cli("scan", path)
    assert clean.code == 0 and "safe (safetensors)" in clean.out, clean.out
    path.write_bytes(whole[:-100])
    res = run_cli("scan", path)
    assert res.code == 1, (res.out, res.err)
    assert "malformed (safetensors): safetensors data cut short: the header names 512 " \
           "bytes of tensor data and the file holds 412 after it" in res.out, res.out
    assert "download it again" in res.out and f"torchverity scan {path}" not in res.out
    folder = run_cli("scan", tmp_path)
    assert folder.code == 1 and "data cut short" in folder.out
