"""Text saved where weights belong (a JSON or XML error from the server, a plain message)
is a broken download to scan and verify alike, the shards an index names included; a
protocol-0 pickle, which is text too, stays a pickle judged by what it runs. A sharded
checkpoint's index that sends a loader out of its folder is reported, not skipped."""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pickle_corpus import Touch, run_plain_loader
from torchverity.pickles._scan import scan, scan_file

JSON_ERROR = b'{"error":"Access to model is restricted. You must be authenticated."}'
S3_ERROR = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
            b"<Message>Access Denied</Message></Error>\n")
BOM_HTML = b"\xef\xbb\xbf<!DOCTYPE html><html><body>Sign in</body></html>"


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    from torch_zip_artifacts import bert

    folder = tmp_path / "sharded"
    bert().save_pretrained(folder, max_shard_size="40KB")
    return folder


def _last_shard(folder: Path) -> Path:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder / sorted(set(index["weight_map"].values()))[-1]


def test_an_error_page_saved_as_a_shard_fails_scan_and_verify(
        sharded: Path, run_cli: Callable[..., Any]) -> None:
    clean = run_cli("scan", sharded)
    assert clean.code == 0, clean.err  # the intact folder: no false alarm
    shard = _last_shard(sharded)
    shard.write_bytes(JSON_ERROR)
    res = run_cli("scan", "--json", sharded)
    assert res.code == 1, (res.out, res.err)
    doc = json.loads(res.out)
    files = {Path(f["path"]).name: f for f in doc["files"]}
    found = files[shard.name]
    assert (found["verdict"], found["format"]) == ("malformed", "text")
    assert found["reason"].startswith('a text file (JSON: \'{"error":"Access to model is '
                                      "restricted."), found["reason"]
    assert shard.name not in {Path(s["path"]).name for s in doc["skipped"]}
    human = run_cli("scan", sharded)
    assert "next: download the file again" in human.out
    index = run_cli("scan", sharded / "model.safetensors.index.json")
    assert index.code == 1 and f"{shard.name}: malformed" in index.out
    assert f"torchverity scan {sharded}" not in index.out + index.err
    verify = run_cli("verify", "--json", sharded)
    assert verify.code == 1, (verify.out, verify.err)
    assert json.loads(verify.out)["results"][0]["broken_downloads"] == [shard.name]
    assert "a text file (JSON" in run_cli("verify", sharded).err


@pytest.mark.parametrize("name,data,words", [
    ("pytorch_model.bin", S3_ERROR, "a text file (XML: '<?xml"),
    ("model.pt", b"Not Found\n", "a text file (plain text: 'Not Found')"),  # 'N': an opcode
    ("model.ckpt", b"Internal Server Error", "a text file (plain text: 'Internal"),
    ("model.safetensors", BOM_HTML, "HTML page"),
])
def test_text_under_a_weights_name_is_named_by_scan_and_verify(
        tmp_path: Path, run_cli: Callable[..., Any], name: str, data: bytes,
        words: str) -> None:
    path = tmp_path / name
    path.write_bytes(data)
    result = scan_file(path)
    assert result.verdict == "malformed" and words in result.reason, result
    assert "unknown opcode" not in result.reason
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    report = scan(tmp_path)
    assert [r.path for r in report.results] == [os.fspath(path)] and not report.ok
    assert [s.path for s in report.skipped] == [os.fspath(tmp_path / "config.json")]
    verify = run_cli("verify", tmp_path)
    assert verify.code == 1 and words.split(" (")[0] in verify.err, verify.err


def test_a_shard_the_index_names_is_weights_whatever_its_name(
        sharded: Path, run_cli: Callable[..., Any]) -> None:
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = _last_shard(sharded)
    renamed = sharded / "part-b"
    shard.rename(renamed)
    index["weight_map"] = {k: ("part-b" if v == shard.name else v)
                           for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    assert run_cli("scan", sharded).code == 0  # the real shard under that name passes
    renamed.write_bytes(JSON_ERROR)
    res = run_cli("scan", "--json", sharded)
    files = {Path(f["path"]).name: f for f in json.loads(res.out)["files"]}
    assert res.code == 1 and files["part-b"]["verdict"] == "malformed", res.out
    direct = run_cli("scan", "--json", index_path)
    files = {Path(f["path"]).name: f for f in json.loads(direct.out)["files"]}
    assert direct.code == 1 and files["part-b"]["format"] == "text", direct.out


def test_text_and_protocol_0_pickles_under_weights_names_are_told_apart(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    live = tmp_path / "live.bin"
    ran = tmp_path / "RAN"
    live.write_bytes(pickle.dumps({"w": [1.0], "x": Touch(ran)}, protocol=0))
    assert live.read_bytes().isascii()  # text, to any sniffer
    run_plain_loader(live)
    assert ran.exists(), "the payload did not run under pickle.load"
    folder = tmp_path / "repo"
    folder.mkdir()
    sentinel = tmp_path / "SENTINEL"
    evil = folder / "pytorch_model.bin"
    evil.write_bytes(pickle.dumps({"w": [1.0], "x": Touch(sentinel)}, protocol=0))
    result = scan_file(evil)
    assert result.verdict == "unsafe" and result.names("dangerous") == ["posix.system"]
    res = run_cli("scan", folder)
    assert res.code == 1 and f"{evil}: unsafe" in res.out, res.out
    verify = run_cli("verify", folder)
    assert "text file" not in verify.err  # not called a download: it is a pickle
    plain = folder / "training_args.bin"
    plain.write_bytes(pickle.dumps({"lr": 0.1, "steps": 10}, protocol=0))
    assert scan_file(plain).verdict == "safe" and scan_file(plain).format == "pickle"
    assert "training_args.bin" not in run_cli("verify", folder).err
    # Beside them, text that starts like opcodes ('N' NONE, 'o' OBJ...) is a download.
    page = folder / "model.pt"
    page.write_bytes(b"Not Found")
    assert scan_file(page).verdict == "malformed" and scan_file(page).format == "text"
    assert "a text file (plain text: 'Not Found')" in run_cli("verify", folder).err
    assert not sentinel.exists()


@pytest.mark.parametrize("entry", ["../outside.bin", "/etc/hostname"])
def test_an_index_sending_the_loader_out_of_its_folder_is_reported(
        sharded: Path, run_cli: Callable[..., Any], entry: str) -> None:
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = sorted(index["weight_map"])[0]
    index["weight_map"][first] = entry
    index_path.write_text(json.dumps(index))
    res = run_cli("scan", "--json", sharded)
    assert res.code == 1, (res.out, res.err)
    files = {Path(f["path"]).name: f for f in json.loads(res.out)["files"]}
    found = files[index_path.name]
    assert (found["verdict"], found["format"]) == ("malformed", "index")
    assert repr(entry) in found["reason"] and "no loader should follow" in found["reason"]
    direct = run_cli("scan", index_path)
    assert direct.code == 1 and repr(entry) in direct.out
    assert "do not load this checkpoint" in direct.out
    assert f"torchverity scan {index_path}" not in direct.out + direct.err
