"""Manifests and verification: every fault caught and located, clean trees pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from torchverity.digest import digest_file, write_sidecar
from torchverity.errors import FormatError, InputError
from torchverity.inject import flip_bit, truncate
from torchverity.manifest import (
    MANIFEST_NAME,
    SHA256SUM_NAME,
    Manifest,
    build_manifest,
    check_relative_path,
    read_manifest,
    write_manifest,
)
from torchverity.verify import verify_directory, verify_file, verify_path


def make_tree(root: Path) -> Path:
    (root / "ckpt" / "shards").mkdir(parents=True)
    (root / "ckpt" / "model.pt").write_bytes(os.urandom(300_000))
    (root / "ckpt" / "config.json").write_text('{"lr": 0.1}')
    (root / "ckpt" / "shards" / "a.bin").write_bytes(b"\x00" * 5000)
    (root / "ckpt" / "shards" / "ü nicode name.bin").write_bytes(b"\x00x")
    (root / "ckpt" / "empty").write_bytes(b"")
    return root / "ckpt"


def statuses(result) -> dict[str, str]:
    return {e.path: e.status for e in result.entries}


@pytest.mark.parametrize("algo", ["sha256", "blake3"])
def test_clean_tree_verifies_with_zero_alarms(tmp_path: Path, algo: str) -> None:
    tree = make_tree(tmp_path)
    manifest = write_manifest(tree, algo)
    assert [e.path for e in manifest.entries] == sorted(
        (e.path for e in manifest.entries), key=str.encode
    )
    assert MANIFEST_NAME not in {e.path for e in manifest.entries}
    for _ in range(3):
        result = verify_directory(tree)
        assert result.ok and result.counts == {"ok": 5, "mismatched": 0, "missing": 0, "extra": 0}


def test_manifest_is_deterministic_and_round_trips(tmp_path: Path) -> None:
    tree = make_tree(tmp_path)
    first = write_manifest(tree)
    text = (tree / MANIFEST_NAME).read_text()
    second = write_manifest(tree)
    assert (tree / MANIFEST_NAME).read_text() == text
    assert first.root == second.root == read_manifest(tree).root
    assert read_manifest(tree) == Manifest(first.algo, first.entries)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_bit_flip_at_first_middle_last_byte_is_located(tmp_path: Path, where: str) -> None:
    tree = make_tree(tmp_path)
    write_manifest(tree)
    size = (tree / "model.pt").stat().st_size
    offset = {"first": 0, "middle": size // 2, "last": size - 1}[where]
    flip_bit(tree / "model.pt", offset, 3)
    result = verify_directory(tree)
    assert not result.ok
    assert [(e.path, e.status) for e in result.problems] == [("model.pt", "mismatched")]
    problem = result.problems[0]
    assert (
        problem.expected != problem.actual
        and problem.actual == digest_file(tree / "model.pt").hexdigest
    )


def test_truncation_and_appended_byte_are_caught(tmp_path: Path) -> None:
    tree = make_tree(tmp_path)
    write_manifest(tree)
    truncate(tree / "model.pt", 1)
    with open(tree / "config.json", "ab") as fh:
        fh.write(b"\n")
    result = verify_directory(tree)
    assert {e.path for e in result.problems} == {"model.pt", "config.json"}
    sizes = {e.path: (e.expected_size, e.actual_size) for e in result.problems}
    assert sizes["model.pt"] == (300_000, 299_999)


def test_added_and_removed_files_show_as_extra_and_missing(tmp_path: Path) -> None:
    tree = make_tree(tmp_path)
    write_manifest(tree)
    (tree / "shards" / "a.bin").unlink()
    (tree / "shards" / "new.bin").write_bytes(b"new")
    got = statuses(verify_directory(tree))
    assert got["shards/a.bin"] == "missing" and got["shards/new.bin"] == "extra"
    assert sum(s == "ok" for s in got.values()) == 4


def test_sha256sum_format_is_bagit_and_coreutils_compatible(tmp_path: Path) -> None:
    tree = make_tree(tmp_path)
    write_manifest(tree, fmt="sha256sum")
    check = subprocess.run(
        ["sha256sum", "-c", SHA256SUM_NAME], cwd=tree, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert verify_path(tree).ok
    flip_bit(tree / "config.json", 0, 0)
    assert [e.path for e in verify_path(tree).problems] == ["config.json"]


def test_symlinks_are_skipped_and_never_followed(tmp_path: Path) -> None:
    tree = make_tree(tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    (tree / "link.txt").symlink_to(outside)
    (tree / "linkdir").symlink_to(tmp_path, target_is_directory=True)
    manifest = write_manifest(tree)
    assert set(manifest.skipped) == {"link.txt", "linkdir"}
    assert "link.txt" not in {e.path for e in manifest.entries}
    assert verify_directory(tree).ok


def _edit_manifest(tree: Path, mutate) -> None:
    path = tree / MANIFEST_NAME
    data = json.loads(path.read_text())
    mutate(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["files"][0].update(path="../x"), "escapes the folder"),
        (lambda d: d["files"][0].update(path="/etc/passwd"), "escapes the folder"),
        (lambda d: d["files"][0].update(path="a/./b"), "escapes the folder"),
        (lambda d: d["files"][0].update(digest="ab" * 10), "is not 64 lowercase hex digits"),
        (lambda d: d.update(algorithm="md5"), "unknown algorithm 'md5'"),
        (lambda d: d["files"][0].update(size=d["files"][0]["size"] + 1), "'root' does not match"),
        (lambda d: d.update(version=99), "unsupported version 99"),
        (lambda d: d["files"].append(dict(d["files"][0])), "is listed twice"),
    ],
    ids=["dotdot", "absolute", "dot", "hex-length", "algo", "root", "version", "duplicate"],
)
def test_hand_edited_manifest_is_rejected(tmp_path: Path, mutate, message: str) -> None:
    tree = make_tree(tmp_path)
    write_manifest(tree)
    _edit_manifest(tree, mutate)
    with pytest.raises(FormatError) as info:
        verify_directory(tree)
    assert message in info.value.message
    assert f"torchverity manifest {tree}" in str(info.value)


@pytest.mark.parametrize("path", ["", "/a", "a//b", "a/", "./a", "a/./b", "..", "a/../b",
                                  "a/..", "a\\b", "C:/x", "c:x", "a\x00b"])
def test_every_path_that_could_leave_the_folder_is_refused(path: str) -> None:
    with pytest.raises(FormatError, match="escapes the folder"):
        check_relative_path(Path("m.json"), path)


@pytest.mark.parametrize("path", ["a", "a/b", ".git/HEAD", "a/.b", "...", "a/..b", "ü x.bin"])
def test_plain_relative_paths_are_accepted_as_they_are(path: str) -> None:
    assert check_relative_path(Path("m.json"), path) == path


def test_manifest_path_through_symlink_out_of_folder_is_rejected(tmp_path: Path) -> None:
    tree = make_tree(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "a.bin").write_bytes(b"\x00" * 5000)
    write_manifest(tree)
    for f in (tree / "shards").iterdir():
        f.unlink()
    (tree / "shards").rmdir()
    (tree / "shards").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(FormatError, match="goes through a symlink that leads out of the folder"):
        verify_directory(tree)


def test_bad_json_and_missing_records(tmp_path: Path) -> None:
    tree = make_tree(tmp_path)
    (tree / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(FormatError, match="not JSON"):
        verify_directory(tree)
    (tree / MANIFEST_NAME).unlink()
    with pytest.raises(InputError, match="no manifest") as info:
        verify_directory(tree)
    assert f"torchverity manifest {tree}" in str(info.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="no regular files"):
        build_manifest(empty)
    with pytest.raises(InputError, match="no sidecar") as side:
        verify_file(tree / "model.pt")
    assert f"torchverity hash --write {tree / 'model.pt'}" in str(side.value)


def test_file_against_sidecar_both_ways(tmp_path: Path) -> None:
    tree = make_tree(tmp_path)
    target = tree / "model.pt"
    write_sidecar(target, digest_file(target, "blake3"))
    assert verify_file(target).ok and verify_file(target).algo == "blake3"
    flip_bit(target, 12345, 7)
    result = verify_file(target)
    assert [(e.path, e.status) for e in result.entries] == [("model.pt", "mismatched")]
    target.unlink()
    assert verify_file(target).entries[0].status == "missing"


def test_sha256sum_manifest_percent_encodes_bagit_specials(tmp_path: Path) -> None:
    tree = tmp_path / "bag"
    tree.mkdir()
    odd = "50% off\nline two\r.bin"
    (tree / odd).write_bytes(b"odd")
    (tree / "plain.bin").write_bytes(b"plain")
    write_manifest(tree, fmt="sha256sum")
    text = (tree / SHA256SUM_NAME).read_text()
    assert "50%25 off%0Aline two%0D.bin" in text and len(text.splitlines()) == 2
    assert {e.path for e in read_manifest(tree).entries} == {odd, "plain.bin"}
    assert verify_path(tree).ok
    (tree / odd).write_bytes(b"odd!")
    assert [e.path for e in verify_path(tree).problems] == [odd]


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_verify_names_the_damaged_tensor_of_a_saved_checkpoint(
    tmp_path: Path, suffix: str, run_cli
) -> None:
    import torch

    import torchverity
    from torchverity._tensors import byte_view

    state = {"a.weight": torch.randn(64, 64), "b.bias": torch.randn(64)}
    path = tmp_path / f"model{suffix}"
    torchverity.save(state, path)
    write_manifest(tmp_path)
    assert verify_file(path).ok and verify_directory(tmp_path).ok
    assert run_cli("verify", path).code == 0
    needle = bytes(byte_view(state["b.bias"])[:16].numpy())
    flip_bit(path, path.read_bytes().index(needle) + 3, 6)
    result = verify_file(path)
    assert [(e.status, e.tensors) for e in result.entries] == [("mismatched", ("b.bias",))]
    assert [(e.path, e.tensors) for e in verify_directory(tmp_path).problems] == [
        (path.name, ("b.bias",))]
    shown = run_cli("verify", path)
    assert shown.code == 1
    assert f"model{suffix}: damaged tensors (from its meta.json): b.bias" in shown.out


def test_inject_output_naming_the_input_damages_it_in_place(tmp_path: Path) -> None:
    path = tmp_path / "w.bin"
    path.write_bytes(b"\x00" * 64)
    flip_bit(path, 10, 1, output=path)
    assert path.read_bytes()[10] == 2 and len(path.read_bytes()) == 64


def test_records_written_after_the_manifest_are_not_foreign_extras(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    import shutil

    import torch
    from safetensors.torch import save_file

    import torchverity

    folder = tmp_path / "my models ü"
    folder.mkdir()
    save_file({"w": torch.ones(4)}, folder / "modèle 1.safetensors")
    torchverity.save({"w": torch.ones(3)}, folder / "résumé ckpt.pt")  # + sidecar, meta.json
    held = tmp_path / "held"
    held.mkdir()
    for name in ("résumé ckpt.pt.blake3", "résumé ckpt.pt.meta.json"):
        shutil.move(folder / name, held / name)
    write_manifest(folder)  # lists the two weights files only
    for name in ("résumé ckpt.pt.blake3", "résumé ckpt.pt.meta.json"):
        shutil.move(held / name, folder / name)
    assert run_cli("hash", "--write", folder / "modèle 1.safetensors").code == 0
    result = verify_directory(folder)
    assert result.ok and statuses(result) == {"modèle 1.safetensors": "ok",
                                              "résumé ckpt.pt": "ok"}
    assert result.unlisted_records == ("modèle 1.safetensors.blake3",
                                       "résumé ckpt.pt.blake3", "résumé ckpt.pt.meta.json")
    assert result.to_dict()["unlisted_records"] == list(result.unlisted_records)
    res = run_cli("verify", folder)
    assert res.code == 0 and "OK (2 ok)" in res.out, (res.out, res.err)
    assert "not counted (torchverity's own records of listed files)" in res.out

    # A foreign weights file still fails the folder, and so do its sidecar and a file
    # that only borrows a record's name.
    torch.save({"w": torch.zeros(2)}, folder / "extra.pt")
    write_sidecar(folder / "extra.pt", digest_file(folder / "extra.pt"))
    torch.save({"w": torch.zeros(2)}, folder / "modèle 1.safetensors.xxh128")
    got = statuses(verify_directory(folder))
    assert got == {"extra.pt": "extra", "extra.pt.blake3": "extra",
                   "modèle 1.safetensors": "ok", "modèle 1.safetensors.xxh128": "extra",
                   "résumé ckpt.pt": "ok"}
    res = subprocess.run([sys.executable, "-m", "torchverity", "verify", str(folder)],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert res.returncode == 1 and "extra.pt" in res.stdout, res.stdout
    assert f"torchverity manifest '{folder}'" in res.stderr, res.stderr


def test_a_folder_verified_by_sidecars_names_the_files_none_covers(
        recorded_bert: Path, tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    """A BERT folder whose weights alone have a sidecar: OK for the weights, and config.json,
    the tokenizer files and .gitattributes are named as not checked, with the manifest that
    would cover them."""
    import shutil

    folder = Path(shutil.copytree(recorded_bert, tmp_path / "bert"))
    (folder / MANIFEST_NAME).unlink()
    assert run_cli("hash", "--write", folder / "model.safetensors").code == 0
    shown = run_cli("verify", folder)
    assert shown.code == 0 and "OK (1 ok)" in shown.out, shown.err
    assert "not checked, no record covers them:" in shown.out
    assert "config.json" in shown.out and "tokenizer.json" in shown.out
    assert f"record the folder from a trusted copy: torchverity manifest {folder}" in shown.err
    doc = json.loads(run_cli("verify", "--json", folder).out)["results"][0]
    assert doc["ok"] is True and [e["path"] for e in doc["entries"]] == ["model.safetensors"]
    expected = {p.name for p in folder.iterdir()} - {"model.safetensors",
                                                      "model.safetensors.blake3"}
    assert set(doc["unrecorded"]) == expected and "tokenizer_config.json" in expected


def test_a_checkpoint_deleted_beside_its_sidecar_is_missing(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    """No manifest: a sidecar (and meta.json) whose checkpoint is gone stands for a file that
    should be there, so the folder fails rather than verifying what is left."""
    import torch

    import torchverity

    folder = tmp_path / "ckpts"
    folder.mkdir()
    torchverity.save({"w": torch.ones(3)}, folder / "step1.pt")
    torchverity.save({"w": torch.ones(4)}, folder / "step2.pt")
    (folder / "step2.pt").unlink()
    doc = json.loads(run_cli("verify", "--json", folder).out)["results"][0]
    assert statuses(verify_directory(folder)) == {"step1.pt": "ok", "step2.pt": "missing"}
    assert doc["ok"] is False and "unrecorded" not in doc
    shown = run_cli("verify", folder)
    assert shown.code == 1 and "missing  step2.pt" in shown.out, shown.out


def test_a_shard_deleted_with_its_sidecar_is_missing_from_the_recorded_index(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    """No manifest, a sharded save: a shard removed together with its sidecar and meta.json
    leaves no record of its own, but the intact index still names it."""
    import torch

    import torchverity

    folder = tmp_path / "sharded"
    g = torch.Generator().manual_seed(0)
    torchverity.save({f"layer.{i}.weight": torch.randn(64, 64, generator=g) for i in range(6)},
                     folder, shard_bytes=40_000)
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) >= 3
    assert run_cli("verify", folder).code == 0  # clean: no false alarm
    gone = shards[1]
    for path in folder.glob(f"{gone}*"):
        path.unlink()
    shown = run_cli("verify", folder)
    assert shown.code == 1 and f"missing  {gone}" in shown.out, shown.out
    assert f"against {len(shards)} per-file sidecar(s)" in shown.out
    doc = json.loads(run_cli("verify", "--json", folder).out)["results"][0]
    assert doc["ok"] is False and doc["counts"]["missing"] == 1


def test_a_file_its_folders_manifest_does_not_list_says_so(
        recorded_bert: Path, tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    import shutil

    folder = Path(shutil.copytree(recorded_bert, tmp_path / "bert"))
    added = folder / "added_tokens.json"  # a file written after the manifest
    added.write_text('{"[NEW]": 7}\n')
    shown = run_cli("verify", added)
    assert shown.code == 2
    assert f"the manifest {folder / MANIFEST_NAME} does not list it" in shown.err
    assert f"torchverity verify {folder};" in shown.err  # what the manifest does list, first
    assert f"torchverity hash --write {added}" in shown.err
    assert "added_tokens.json.xxh128" in shown.err


def test_the_no_sidecar_error_and_hash_help_name_every_sidecar(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x00" * 64)
    shown = run_cli("verify", path)
    assert shown.code == 2
    assert "(weights.bin.sha256, weights.bin.blake3 or weights.bin.xxh128)" in shown.err
    helped = subprocess.run([sys.executable, "-m", "torchverity", "hash", "--help"],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    words = " ".join(helped.stdout.split())
    assert helped.returncode == 0 and "FILE.xxh128" in words and "FILE.blake3" in words


def test_an_index_stands_for_its_sharded_checkpoint(tmp_path: Path,
                                                     run_cli: Callable[..., Any]) -> None:
    """A folder torchverity.save sharded (a sidecar per shard and for the index): verify of
    the index checks every shard; a damaged shard fails it, a removed one is missing."""
    import torch

    import torchverity

    torch.manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(64, 64) for i in range(4)}
    folder = tmp_path / "export"
    torchverity.save(state, folder, shard_bytes=16_384)
    index = folder / "model.safetensors.index.json"
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) == 4
    result = verify_file(index)
    assert result.ok and statuses(result) == {p.name: "ok" for p in (index, *shards)}
    assert result.record == "5 sidecar(s)"
    flip_bit(shards[1], shards[1].stat().st_size - 10, 2)
    shards[3].unlink()
    shown = run_cli("verify", index)
    assert shown.code == 1, shown.err
    assert "3 ok, 1 mismatched, 1 missing" in shown.out and shards[1].name in shown.out
    got = {e["path"]: e["status"]
           for e in json.loads(run_cli("verify", "--json", index).out)["results"][0]["entries"]}
    assert got[shards[1].name] == "mismatched" and got[shards[3].name] == "missing"
    (folder / f"{shards[2].name}.blake3").unlink()  # a shard nothing records any more
    unrecorded = run_cli("verify", index)
    assert unrecorded.code == 2 and "have no record to check them against" in unrecorded.err
    assert shards[2].name in unrecorded.err
    assert f"torchverity manifest {folder}" in unrecorded.err


def test_a_missing_path_gets_a_next_step_for_verify_and_hash(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    tree = make_tree(tmp_path / "tree")
    write_manifest(tree)
    listed = tree / "model.pt"
    listed.unlink()
    r = run_cli("verify", listed)
    assert r.code == 2 and "no such file or directory" in r.err
    assert f"next: check the path; ls {tree} lists what is there" in r.err
    assert f"torchverity verify {tree} checks every file the manifest lists" in r.err
    for command in ("verify", "hash"):
        r = run_cli(command, tree / "never-listed.bin")
        assert r.code == 2 and f"ls {tree} lists what is there" in r.err
        assert "manifest" not in r.err  # the manifest does not list it: no folder check named
        r = run_cli(command, tmp_path / "nowhere" / "x.pt")
        assert r.code == 2
        assert f"there is no folder {tmp_path / 'nowhere'}; ls {tmp_path}" in r.err
    (tmp_path / "dangling.pt").symlink_to(tmp_path / "gone.pt")
    for command in ("verify", "hash"):
        r = run_cli(command, tmp_path / "dangling.pt")
        assert r.code == 2 and f"link to {tmp_path / 'gone.pt'}, which does not exist" in r.err
