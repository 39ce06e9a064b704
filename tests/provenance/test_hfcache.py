"""Hugging Face hub caches and local_dir downloads, verified offline against their names."""

from __future__ import annotations

import json
import os
import shutil
import threading
import warnings
from pathlib import Path

import pytest
from provenance_helpers import (
    flip_bit,
    git_blob_sha1,
    hf_model_folder,
    hub_cache_from_folder,
    local_dir_from_folder,
)

from torchverity.provenance import (
    hub_blob_check,
    verify_hub_cache,
    verify_hub_path,
    verify_hub_repo,
    verify_local_dir,
)

REPO = "org/tiny-gpt2"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
COMMIT2 = "fedcba9876543210fedcba9876543210fedcba98"
SHARD = "model-00001-of-00003.safetensors"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_model_folder(tmp_path_factory.mktemp("hf") / "tiny", shard="60KB")


@pytest.fixture
def hf_home(pristine: Path, tmp_path: Path) -> Path:
    home = tmp_path / "hf_home"
    hub_cache_from_folder(home / "hub", REPO, COMMIT, pristine)
    return home


def _repo(home: Path) -> Path:
    return home / "hub" / "models--org--tiny-gpt2"


def _blob_of(home: Path, name: str, commit: str = COMMIT) -> Path:
    link = _repo(home) / "snapshots" / commit / name
    return link.parent / os.readlink(link)


def test_cache_is_the_one_huggingface_hub_reads(hf_home: Path) -> None:
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    info = scan_cache_dir(hf_home / "hub")
    assert not info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO and [r.commit_hash for r in repo.revisions] == [COMMIT]
    path = try_to_load_from_cache(REPO, SHARD, cache_dir=hf_home / "hub")
    assert isinstance(path, str) and Path(path).is_symlink()


def test_clean_cache_verifies_with_no_alarm(hf_home: Path, run_cli) -> None:
    for target in (hf_home, hf_home / "hub", _repo(hf_home),
                   _repo(hf_home) / "snapshots" / COMMIT):
        result = verify_hub_path(target)
        assert result.ok, result.problems
        algos = {e.path: e.algo for e in result.entries}
        assert algos[SHARD] == "sha256" and algos["config.json"] == "git-sha1"
        assert len(result.entries) == 9
    res = run_cli("verify", hf_home, "--json")
    assert res.code == 0, res.out + res.err
    doc = json.loads(res.out)["results"][0]
    assert doc["counts"]["ok"] == 9 and doc["revisions"] == {f"model:{REPO}@{COMMIT}": {"ok": 9}}


def test_flipped_bit_in_a_shard_blob_is_caught_and_located(hf_home: Path, run_cli) -> None:
    flip_bit(_blob_of(hf_home, SHARD), 20_000, 2, keep_mtime=True)
    result = verify_hub_cache(hf_home)
    (bad,) = result.problems
    assert (bad.path, bad.status, bad.revision) == (SHARD, "damaged", COMMIT)
    assert bad.actual != bad.blob
    res = run_cli("verify", _repo(hf_home))
    assert res.code == 1 and SHARD in res.out and "damaged" in res.out
    assert f"huggingface-cli download {REPO} --force-download" in res.err, res.err


def test_the_index_in_a_snapshot_stands_for_its_shards(hf_home: Path, run_cli) -> None:
    """verify of model.safetensors.index.json checks every shard it names against its blob's
    name: a damaged shard fails it, a shard the download lacks is missing."""
    snapshot = _repo(hf_home) / "snapshots" / COMMIT
    index = snapshot / "model.safetensors.index.json"
    clean = run_cli("verify", index)
    assert clean.code == 0 and "OK (4 ok)" in clean.out, clean.out + clean.err
    flip_bit(_blob_of(hf_home, SHARD), 20_000, 2, keep_mtime=True)
    (snapshot / "model-00003-of-00003.safetensors").unlink()
    res = run_cli("verify", "--json", index)
    assert res.code == 1
    got = {e["path"]: e["status"] for e in json.loads(res.out)["results"][0]["entries"]}
    assert got == {"model.safetensors.index.json": "ok", SHARD: "damaged",
                   "model-00002-of-00003.safetensors": "ok",
                   "model-00003-of-00003.safetensors": "missing"}


def test_truncated_and_small_file_blobs_are_caught(hf_home: Path) -> None:
    shard = _blob_of(hf_home, "model-00002-of-00003.safetensors")
    with open(shard, "r+b") as fh:
        fh.truncate(1000)
    flip_bit(_blob_of(hf_home, "config.json"), 5, 0)  # git blob SHA-1 named
    got = {e.path: e.status for e in verify_hub_repo(_repo(hf_home)).problems}
    assert got == {"model-00002-of-00003.safetensors": "damaged", "config.json": "damaged"}


def test_missing_blob_is_dangling_and_missing_snapshot_is_reported(hf_home: Path) -> None:
    _blob_of(hf_home, "tokenizer.json").unlink()
    (_repo(hf_home) / "refs" / "v1").write_text(COMMIT2)
    result = verify_hub_repo(_repo(hf_home))
    got = {(e.revision, e.path): e.status for e in result.problems}
    assert got == {(COMMIT, "tokenizer.json"): "dangling", (COMMIT2, ""): "missing"}


def test_link_out_of_the_cache_is_refused_never_followed(hf_home: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    os.mkfifo(outside)  # opening it would block: a finished check proves it was never opened
    snap = _repo(hf_home) / "snapshots" / COMMIT
    (snap / "evil.bin").symlink_to(os.path.relpath(outside, snap))
    (snap / "abs.bin").symlink_to("/etc/passwd")
    other = hf_home / "hub" / "models--other--repo" / "blobs"
    other.mkdir(parents=True)
    blob = other / ("a" * 64)
    blob.write_bytes(b"y")
    (snap / "cross.bin").symlink_to(os.path.relpath(blob, snap))
    done: dict[str, object] = {}

    def check() -> None:
        done["repo"] = verify_hub_repo(_repo(hf_home))
        done["one"] = hub_blob_check(snap / "evil.bin")

    worker = threading.Thread(target=check, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "the check opened the link's target"
    got = {e.path: e.status for e in done["repo"].problems}  # type: ignore[attr-defined]
    assert got == {"evil.bin": "outside", "abs.bin": "outside", "cross.bin": "outside"}
    assert done["one"].status == "outside"  # type: ignore[attr-defined]


def test_blob_that_is_itself_a_link_is_refused(hf_home: Path, tmp_path: Path) -> None:
    blob = _blob_of(hf_home, "config.json")
    (tmp_path / "elsewhere").write_bytes(blob.read_bytes())
    blob.unlink()
    blob.symlink_to(tmp_path / "elsewhere")
    (bad,) = verify_hub_repo(_repo(hf_home)).problems
    assert (bad.path, bad.status) == ("config.json", "outside")


def test_shared_blobs_are_hashed_once_and_reported_per_revision(hf_home: Path,
                                                                pristine: Path) -> None:
    hub_cache_from_folder(hf_home / "hub", REPO, COMMIT2, pristine, revision="v2")
    flip_bit(_blob_of(hf_home, SHARD), 100, 0)
    result = verify_hub_cache(hf_home)
    assert {(e.revision, e.path) for e in result.problems} == {(COMMIT, SHARD), (COMMIT2, SHARD)}
    per = result.revisions()
    assert per[f"model:{REPO}@{COMMIT2}"] == {"ok": 8, "damaged": 1}


def test_load_inside_a_hub_cache_checks_the_blob(hf_home: Path, recwarn) -> None:
    from huggingface_hub import try_to_load_from_cache

    import torchverity
    from torchverity.errors import IntegrityError

    path = try_to_load_from_cache(REPO, SHARD, cache_dir=hf_home / "hub")
    assert isinstance(path, str)
    state, report = torchverity.load(path, with_report=True)
    assert state and report.digest_source == "hub"
    assert not [w for w in recwarn if "sidecar" in str(w.message)]
    entry = hub_blob_check(path)
    assert entry is not None and entry.status == "ok"
    flip_bit(_blob_of(hf_home, SHARD), 20_000, 2, keep_mtime=True)
    with pytest.raises(IntegrityError, match="Hugging Face hub") as info:
        torchverity.load(path)
    assert info.value.expected == _blob_of(hf_home, SHARD).name and info.value.actual


def test_load_refuses_a_snapshot_link_out_of_the_cache(hf_home: Path, tmp_path: Path) -> None:
    import torch

    import torchverity
    from torchverity.errors import IntegrityError

    outside = tmp_path / "planted.pt"
    torch.save({"w": torch.zeros(2)}, outside)
    snap = _repo(hf_home) / "snapshots" / COMMIT
    (snap / "planted.pt").symlink_to(os.path.relpath(outside, snap))
    with pytest.raises(IntegrityError, match="leaves this repository"):
        torchverity.load(snap / "planted.pt")


def test_relative_paths_into_a_snapshot_are_checked_like_absolute_ones(
        hf_home: Path, tmp_path: Path, run_cli, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from huggingface_hub import try_to_load_from_cache

    import torchverity
    from torchverity.errors import IntegrityError

    path = try_to_load_from_cache(REPO, SHARD, cache_dir=hf_home / "hub")
    assert isinstance(path, str)
    monkeypatch.chdir(hf_home.parent)  # the path as a user types it from nearby
    rel = os.path.relpath(path)
    snap = os.path.dirname(rel)
    res = run_cli("verify", rel)
    assert res.code == 0 and "1 ok" in res.out and "outside" not in res.out, res.out + res.err
    assert hub_blob_check(rel) is not None and hub_blob_check(rel).status == "ok"
    assert torchverity.load(rel, with_report=True)[1].digest_source == "hub"
    assert torchverity.load(snap)  # the snapshot folder as a checkpoint
    monkeypatch.chdir(snap)
    assert run_cli("verify", SHARD).code == 0
    outside = tmp_path / "planted.pt"  # a link out of the cache is still refused
    torch.save({"w": torch.zeros(2)}, outside)
    os.symlink(os.path.relpath(outside), "planted.pt")
    with pytest.raises(IntegrityError, match="leaves this repository"):
        torchverity.load("planted.pt")
    assert run_cli("verify", "planted.pt").code == 1


def test_sharded_snapshot_load_says_what_the_hub_names_verified(hf_home: Path) -> None:
    """The index (named by its git SHA-1) and every shard (by SHA-256) are checked against
    their blob names: no 'not verified' warning for them, only that meta.json is absent."""
    import torchverity
    from torchverity.errors import IntegrityError

    snap = _repo(hf_home) / "snapshots" / COMMIT
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, report = torchverity.load(snap, with_report=True)
    assert state and report.shards
    texts = " | ".join(report.warnings) + " | ".join(str(w.message) for w in caught)
    assert "not verified" not in texts and "could not be fully verified" not in texts, texts
    assert "match their hub record" in texts and "no meta.json" in texts
    index = next(snap.glob("*.index.json"))
    blob = index.parent / os.readlink(index)
    blob.write_bytes(blob.read_bytes().replace(b'"metadata"', b'"metadatA"'))
    with pytest.raises(IntegrityError):  # the index's git SHA-1 is checked, not assumed
        torchverity.load(snap)


def test_load_of_a_damaged_small_hub_file_is_refused(local_dir: Path) -> None:
    import torch

    import torchverity
    from torchverity.errors import IntegrityError

    torch.save({"w": torch.ones(3)}, local_dir / "extra.pt")
    data = (local_dir / "extra.pt").read_bytes()
    from huggingface_hub._local_folder import write_download_metadata
    from provenance_helpers import git_blob_sha1

    write_download_metadata(local_dir, "extra.pt", COMMIT, git_blob_sha1(data))
    assert torch.equal(torchverity.load(local_dir / "extra.pt")["w"], torch.ones(3))
    flip_bit(local_dir / "extra.pt", len(data) - 30, 0, keep_mtime=True)
    with pytest.raises(IntegrityError, match="damaged"):
        torchverity.load(local_dir / "extra.pt")


def test_paths_outside_hub_layouts_are_left_alone(tmp_path: Path) -> None:
    plain = tmp_path / "model.pt"
    plain.write_bytes(b"x")
    assert hub_blob_check(plain) is None


@pytest.fixture
def local_dir(pristine: Path, tmp_path: Path) -> Path:
    return local_dir_from_folder(tmp_path / "dl", COMMIT, pristine)


def test_local_dir_download_verifies_clean(local_dir: Path, run_cli) -> None:
    result = verify_local_dir(local_dir)
    assert result.ok and len(result.entries) == 9
    res = run_cli("verify", local_dir)
    assert res.code == 0, res.out + res.err


def test_local_dir_damage_missing_and_edits_are_told_apart(local_dir: Path,
                                                           run_cli) -> None:
    flip_bit(local_dir / SHARD, 20_000, 1, keep_mtime=True)
    (local_dir / "tokenizer.json").unlink()
    cfg = local_dir / "config.json"
    cfg.write_text('{"edited": 1}')
    later = cfg.stat().st_mtime + 60
    os.utime(cfg, (later, later))
    got = {e.path: e.status for e in verify_local_dir(local_dir).problems}
    assert got == {SHARD: "damaged", "tokenizer.json": "missing", "config.json": "changed"}
    told = run_cli("verify", local_dir).err
    assert f"huggingface-cli download REPO_ID --local-dir {local_dir} --force-download" in told
    entry = hub_blob_check(local_dir / SHARD)
    assert entry is not None and entry.status == "damaged"
    import torchverity
    from torchverity.errors import HubFileMismatchError, IntegrityError

    with pytest.raises(HubFileMismatchError) as caught:  # the files a build reads come first
        torchverity.load(local_dir / SHARD)
    assert (caught.value.path, caught.value.status) == (str(cfg), "changed")
    cfg.unlink()  # no config.json beside it: the shard alone, as a file
    with pytest.raises(IntegrityError, match="Hugging Face hub"):
        torchverity.load(local_dir / SHARD)


def test_local_dir_link_is_not_followed(local_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "real.json").write_text("{}")
    os.unlink(local_dir / "config.json")
    os.symlink(tmp_path / "real.json", local_dir / "config.json")
    got = {e.path: e.status for e in verify_local_dir(local_dir).problems}
    assert got == {"config.json": "outside"}


def test_a_folder_with_its_own_manifest_is_not_taken_for_a_cache(hf_home: Path,
                                                                 run_cli) -> None:
    snap = _repo(hf_home) / "snapshots" / COMMIT
    copy = hf_home.parent / "copy"
    shutil.copytree(snap, copy)  # follows the links: plain files
    assert run_cli("manifest", copy).code == 0
    res = run_cli("verify", copy, "--json")
    assert res.code == 0 and json.loads(res.out)["results"][0]["kind"] == "directory"


def test_verify_one_cached_file_by_its_snapshot_path(hf_home: Path, run_cli) -> None:
    link = _repo(hf_home) / "snapshots" / COMMIT / SHARD
    res = run_cli("verify", link)
    assert res.code == 0, res.out + res.err
    flip_bit(_blob_of(hf_home, SHARD), 30_000, 7)
    res = run_cli("verify", link, "--json")
    assert res.code == 1
    (entry,) = json.loads(res.out)["results"][0]["entries"]
    assert (entry["path"], entry["status"]) == (SHARD, "damaged")


def test_hub_verify_output_is_stable(tmp_path: Path, run_cli, monkeypatch, golden) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_bytes(b'{"hidden_size": 16}\n')
    (src / "model.safetensors").write_bytes(bytes(range(256)) * 16)
    hub_cache_from_folder(tmp_path / "home" / "hub", REPO, COMMIT, src)
    monkeypatch.chdir(tmp_path)
    ok = run_cli("verify", "--json", "home")
    assert ok.code == 0
    golden("hub-verify-ok.json", ok.out)
    blob = _blob_of(tmp_path / "home", "model.safetensors")
    flip_bit(blob, 100, 0)
    _blob_of(tmp_path / "home", "config.json").unlink()
    bad = run_cli("verify", "home")
    assert bad.code == 1
    golden("hub-verify-failed.txt", bad.out)


def test_absolute_link_into_its_own_blobs_is_accepted(hf_home: Path) -> None:
    link = _repo(hf_home) / "snapshots" / COMMIT / "config.json"
    blob = _blob_of(hf_home, "config.json").resolve()
    link.unlink()
    link.symlink_to(blob)  # what huggingface_hub writes when no relative path exists
    assert verify_hub_repo(_repo(hf_home)).ok


# A module whose build reads the download's config.json, as from_pretrained does.
GPT2_FOLDER_MODEL = '''
import transformers

def build():
    transformers.logging.set_verbosity_error()
    config = transformers.AutoConfig.from_pretrained({folder!r})
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.input_spec = ["input_ids:int64:1,-1"]
    return model
'''


@pytest.fixture(params=["hub-cache", "local-dir"])
def sharded_download(request: pytest.FixtureRequest, pristine: Path, tmp_path: Path,
                     monkeypatch: pytest.MonkeyPatch) -> Path:
    """A sharded download (index named by its git SHA-1, shards by SHA-256) and beside it
    tvshard_model.py, whose build reads its config.json."""
    if request.param == "hub-cache":
        folder = hub_cache_from_folder(tmp_path / "hub", REPO, COMMIT, pristine) \
            / "snapshots" / COMMIT
    else:
        folder = local_dir_from_folder(tmp_path / "dl", COMMIT, pristine)
    (tmp_path / "tvshard_model.py").write_text(GPT2_FOLDER_MODEL.format(folder=str(folder)))
    monkeypatch.syspath_prepend(str(tmp_path))
    return folder


def test_a_sharded_download_is_loaded_and_served_strictly_against_its_names(
        sharded_download: Path, run_cli) -> None:
    """The hub's names vouch for every byte of a sharded download, so a strict load and
    serve take them as the record: the index by its git SHA-1, each shard by SHA-256."""
    import torchverity
    from torchverity.errors import IntegrityError

    state, report = torchverity.load(sharded_download, sidecar="require", with_report=True)
    assert len(state) == 28 and len(report.shards) == 3
    assert (report.algo, report.digest_source) == ("git-sha1", "hub")
    served = run_cli("serve", "--json", "--model", "tvshard_model:build", "--weights",
                     sharded_download, "--check")
    assert served.code == 0, served.err
    weights = json.loads(served.out)["weights"]
    assert (weights["algorithm"], weights["verified_by"]) == ("git-sha1", "hub")

    # The index is checked against its name, not waved through: the refusal names it
    # and both digests.
    index = sharded_download / "model.safetensors.index.json"
    before = index.read_bytes()
    index.write_bytes(before.replace(b'"metadata"', b'"metadatA"'))  # through a cache's link
    if "snapshots" not in index.parts:  # a local_dir file, saved after its download
        later = index.stat().st_mtime + 60
        os.utime(index, (later, later))
    expected, actual = git_blob_sha1(before), git_blob_sha1(index.read_bytes())
    with pytest.raises(IntegrityError) as caught:
        torchverity.load(sharded_download, sidecar="require")
    err = caught.value
    assert (err.path, err.expected, err.actual) == (str(index), expected, actual)
    served = run_cli("serve", "--json", "--model", "tvshard_model:build", "--weights",
                     sharded_download, "--check")
    assert served.code == 1 and "Traceback" not in served.err
    doc = json.loads(served.out)
    assert (doc["path"], doc["expected"], doc["actual"]) == (str(index), expected, actual)


@pytest.mark.parametrize("given", ["HF_HOME", "hub", "repository"])
def test_a_cache_folder_given_as_a_checkpoint_names_the_snapshot_to_give(
        hf_home: Path, run_cli, given: str) -> None:
    """A cache keeps a model's files only under snapshots/REV, so inspect and fingerprint of
    the cache (or of one repository folder) name the snapshot refs/main points at, and that
    snapshot reads clean."""
    hub_cache_from_folder(hf_home / "hub", REPO, COMMIT2, hf_model_folder_copy(hf_home),
                          revision="v0")  # a second revision, not the one main names
    folder = {"HF_HOME": hf_home, "hub": hf_home / "hub", "repository": _repo(hf_home)}[given]
    snapshot = _repo(hf_home) / "snapshots" / COMMIT
    for command in ("inspect", "fingerprint"):
        told = run_cli(command, folder)
        assert told.code == 2 and "Traceback" not in told.err, told.err
        assert "Hugging Face hub" in told.err and f"e.g. {snapshot}" in told.err, told.err
        assert run_cli(command, snapshot).code == 0
    doc = json.loads(run_cli("inspect", "--json", folder).out)
    assert doc["error"] == "InputError" and str(snapshot) in doc["hint"]


def hf_model_folder_copy(home: Path) -> Path:
    """The cached revision's files, as a plain folder (links followed)."""
    plain = home.parent / "plain"
    shutil.copytree(_repo(home) / "snapshots" / COMMIT, plain)
    return plain
