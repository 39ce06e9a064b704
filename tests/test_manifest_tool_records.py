"""A model folder cloned with git: its manifest leaves out ``.git``, which git rewrites on
every command, so ``git status`` or ``git gc`` raise no alarm while an edited model file
is still named; a manifest that does list such files still has them verified."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from torchverity.digest import digest_file
from torchverity.manifest import Manifest, ManifestEntry, read_manifest

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")

GIT = ["git", "-c", "user.email=maintainer@example.com", "-c", "user.name=maintainer"]


@pytest.fixture()
def clone(tmp_path: Path) -> Path:
    """``git clone`` of a model repository, as from the hub."""
    origin = tmp_path / "origin"
    origin.mkdir()
    save_file({"w": torch.arange(8.0)}, origin / "model.safetensors")
    (origin / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (origin / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    subprocess.run([*GIT, "init", "-q", str(origin)], check=True)
    subprocess.run([*GIT, "-C", str(origin), "add", "."], check=True)
    subprocess.run([*GIT, "-C", str(origin), "commit", "-qm", "model"], check=True)
    subprocess.run([*GIT, "clone", "-q", str(origin), str(tmp_path / "model")], check=True)
    return tmp_path / "model"


def test_the_manifest_of_a_clone_leaves_out_git_and_git_commands_raise_no_alarm(
        clone: Path, run_cli: Callable[..., Any]) -> None:
    made = run_cli("manifest", str(clone), "--json")
    assert made.code == 0, made.err
    data = json.loads(made.out)
    assert (data["files"], data["left_out"]) == (3, [".git"])
    listed = [e["path"] for e in json.loads((clone / "torchverity.manifest.json").read_text())
              ["files"]]
    assert listed == [".gitattributes", "config.json", "model.safetensors"]
    for command in (["status"], ["gc", "-q"], ["fetch", "-q"], ["branch", "other"]):
        subprocess.run([*GIT, "-C", str(clone), *command], check=True, capture_output=True)
    done = run_cli("verify", str(clone), "--json")
    assert done.code == 0, done.out
    counts = json.loads(done.out)["results"][0]["counts"]
    assert counts == {"ok": 3, "mismatched": 0, "missing": 0, "extra": 0}
    config = clone / "config.json"
    config.write_text(config.read_text().replace("bert", "gpt2"))
    done = run_cli("verify", str(clone), "--json")
    assert done.code == 1
    entries = json.loads(done.out)["results"][0]["entries"]
    assert [(e["path"], e["status"]) for e in entries if e["status"] != "ok"] == [
        ("config.json", "mismatched")]


def test_a_manifest_that_lists_git_files_still_has_them_verified(
        clone: Path, run_cli: Callable[..., Any]) -> None:
    assert run_cli("manifest", str(clone), "--json").code == 0
    record = clone / "torchverity.manifest.json"
    written = read_manifest(record)
    head = clone / ".git" / "HEAD"
    entry = ManifestEntry(".git/HEAD", head.stat().st_size,
                          digest_file(head, written.algo).hexdigest)
    entries = sorted((entry, *written.entries), key=lambda e: e.path.encode())
    record.write_text(json.dumps(Manifest(written.algo, tuple(entries)).to_dict()))
    done = run_cli("verify", str(clone), "--json")
    assert done.code == 0, done.out + done.err
    head.write_text("ref: refs/heads/other\n")
    done = run_cli("verify", str(clone), "--json")
    assert done.code == 1
    assert ".git/HEAD" in done.out
