"""OpenSSF model signatures beside loaded files, made by the real model-signing library."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import model_signing
import pytest
import torch
from protect_helpers import flip_tensor_bit, run_python
from provenance_helpers import write_pki

import torchverity.provenance
from torchverity.errors import IntegrityError
from torchverity.protection import protect, protected, unprotect
from torchverity.provenance import sign_model
from torchverity.provenance._keys import write_key_pair

PLAIN_LOAD, PLAIN_SAVE = torch.load, torch.save
SHARDS = ("model-00001.pt", "model-00002.pt", "model-00003.pt")


def _state(i: int) -> dict[str, torch.Tensor]:
    return {f"layer{i}.weight": torch.arange(64, dtype=torch.float32) + i}


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    return write_key_pair(tmp_path, "publisher")


@pytest.fixture
def signed(tmp_path: Path, keys: tuple[Path, Path]) -> Path:
    """Three shards saved by plain torch.save (no sidecars), signed with ``model_signing``."""
    folder = tmp_path / "model"
    folder.mkdir()
    for i, name in enumerate(SHARDS):
        PLAIN_SAVE(_state(i), folder / name)
    (folder / "config.json").write_text('{"layers": 3}\n')
    model_signing.signing.Config().use_elliptic_key_signer(private_key=keys[0]).sign(
        folder, folder / "model.sig")
    return folder


def _events(log: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_every_shard_is_checked_against_the_signature_which_is_verified_once(
        signed: Path, keys: tuple[Path, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    real, calls = torchverity.provenance.signed_digests, []

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(args)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torchverity.provenance, "signed_digests", counted)
    log = tmp_path / "log.jsonl"
    with protected("refuse", log=log, public_key=keys[1]):
        for i, name in enumerate(SHARDS):
            assert torch.equal(torch.load(signed / name)[f"layer{i}.weight"],
                               _state(i)[f"layer{i}.weight"])
    assert len(calls) == 1
    verified = [e for e in _events(log) if e["kind"] == "verified"]
    assert [Path(str(e["path"])).name for e in verified] == list(SHARDS)
    assert {e["source"] for e in verified} == {"signature"}
    assert "model.sig (signed by key sha256:" in str(verified[0]["message"])


def test_a_tampered_byte_is_refused_naming_the_file_and_reported_under_warn(
        signed: Path, keys: tuple[Path, Path], tmp_path: Path) -> None:
    bad = signed / SHARDS[1]
    flip_tensor_bit(bad, bit=3)
    with pytest.raises(IntegrityError, match="does not match its signature") as caught, \
            protected("refuse", public_key=keys[1]):
        torch.load(signed / SHARDS[0])  # the untouched shards still load
        torch.load(bad)
    assert str(caught.value).startswith(f"{bad}: sha256 digest does not match its signature")
    log = tmp_path / "warn.jsonl"
    with protected("warn", log=log, public_key=keys[1]):
        torch.load(bad)  # loaded anyway ...
    [mismatch] = [e for e in _events(log) if e["kind"] == "mismatch"]
    assert mismatch["path"] == str(bad)  # ... and named
    assert "does not match its signature" in str(mismatch["message"])


def test_a_signature_by_another_key_is_refused(signed: Path, tmp_path: Path,
                                               off_after: None) -> None:
    _priv, stranger = write_key_pair(tmp_path, "stranger")
    protect("refuse", public_key=stranger)
    with pytest.raises(IntegrityError, match=r"signature .*model\.sig does not verify"):
        torch.load(signed / SHARDS[0])
    unprotect()


def test_a_file_added_after_signing_is_refused(signed: Path, keys: tuple[Path, Path]) -> None:
    PLAIN_SAVE(_state(9), signed / "extra.pt")
    with pytest.raises(IntegrityError, match="not covered by signature"), \
            protected("refuse", public_key=keys[1]):
        torch.load(signed / "extra.pt")


def test_without_a_key_the_load_goes_on_and_says_the_signature_was_not_checked(
        signed: Path, capfd: pytest.CaptureFixture[str]) -> None:
    flip_tensor_bit(signed / SHARDS[0])
    with protected("refuse"):
        for name in SHARDS:
            torch.load(signed / name)
    err = capfd.readouterr().err
    assert err.count("is signed") == 1  # once per signature, not once per shard
    assert f"{signed / SHARDS[0]} is signed ({signed / 'model.sig'}) but no key to trust was " \
        "given" in err
    assert "protect(public_key='pub.pem'), torchverity run --public-key pub.pem, or " \
        "TORCHVERITY_PUBLIC_KEY=pub.pem" in err


def test_a_certificate_signed_safetensors_file_and_its_own_signature(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    pki = write_pki(tmp_path)
    weights = tmp_path / "weights.safetensors"
    save_file({"w": torch.ones(32)}, weights)
    # weights.safetensors.sig, beside the file
    sign_model(weights, private_key=pki.leaf_key, certificate=pki.leaf, chain=[pki.ca])
    with protected("refuse", certificate_chain=[pki.ca]):
        assert torch.equal(load_file(weights)["w"], torch.ones(32))
    flip_tensor_bit(weights)
    with pytest.raises(IntegrityError, match=f"{weights}: sha256 digest does not match its "
                                             "signature"), \
            protected("refuse", certificate_chain=[pki.ca]):
        load_file(weights)


def test_the_startup_hook_and_torchverity_run_take_the_key(
        hooked_python: str, signed: Path, keys: tuple[Path, Path]) -> None:
    bad = signed / SHARDS[2]
    flip_tensor_bit(bad)
    code = """
        import sys, torch
        from torchverity.errors import IntegrityError
        torch.load(sys.argv[1])
        try:
            torch.load(sys.argv[2])
        except IntegrityError:
            sys.exit(3)
    """
    args = (str(signed / SHARDS[0]), str(bad))
    done = run_python(code, python=hooked_python, args=args,
                      env={"TORCHVERITY_PROTECT": "refuse", "TORCHVERITY_PUBLIC_KEY": str(keys[1])})
    assert done.returncode == 3, done.stderr
    assert f"refused torch.load: {bad}: sha256 digest does not match its signature" in done.stderr

    import textwrap

    run = subprocess.run(
        [sys.executable, "-m", "torchverity", "run", "--policy", "refuse", "--public-key",
         str(keys[1]), "--json", "--", hooked_python, "-c", textwrap.dedent(code), *args],
        capture_output=True, text=True, timeout=240)
    assert run.returncode == 3, run.stderr
    summary = json.loads(run.stdout)
    assert summary["counts"]["verified"] == 1 and summary["counts"]["refused"] == 1


def test_a_signature_over_pieces_of_files_checks_the_whole_folder_once(
        tmp_path: Path, keys: tuple[Path, Path]) -> None:
    folder = tmp_path / "sharded"
    folder.mkdir()
    for i, name in enumerate(SHARDS):
        PLAIN_SAVE(_state(i), folder / name)
    config = model_signing.signing.Config().use_elliptic_key_signer(private_key=keys[0])
    config.set_hashing_config(model_signing.hashing.Config().use_shard_serialization(
        shard_size=1024))
    config.sign(folder, folder / "model.sig")
    log = tmp_path / "log.jsonl"
    with protected("refuse", log=log, public_key=keys[1]):
        for name in SHARDS:
            torch.load(folder / name)
    assert not {"mismatch", "refused"} & {str(e["kind"]) for e in _events(log)}
    flip_tensor_bit(folder / SHARDS[2])
    with pytest.raises(IntegrityError, match=rf"refuses these weights: {SHARDS[2]}:0:1024 "
                                             "mismatched"), \
            protected("refuse", public_key=keys[1]):
        torch.load(folder / SHARDS[0])  # the folder is refused as a whole
