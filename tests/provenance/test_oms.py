"""OpenSSF model signatures: torchverity sign/verify with the real model-signing library."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from provenance_helpers import (
    copy_model,
    flip_bit,
    hf_model_folder,
    write_pki,
    write_rsa_keys,
)

from torchverity.provenance._keys import write_key_pair

pytest.importorskip("model_signing")

from torchverity.provenance import sign_model, verify_model

MODEL_SIGNING = [sys.executable, "-m", "model_signing"]
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_model_folder(tmp_path_factory.mktemp("hf") / "tiny-gpt2")


@pytest.fixture
def model(pristine: Path, tmp_path: Path) -> Path:
    return copy_model(pristine, tmp_path / "tiny-gpt2")


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    return write_key_pair(tmp_path)


def _ms(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MODEL_SIGNING, *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def _statuses(result: object) -> dict[str, str]:
    return {e.path: e.status for e in result.entries}  # type: ignore[attr-defined]


def test_sign_then_verify_clean_model_has_no_alarm(model: Path, keys: tuple[Path, Path],
                                                    run_cli) -> None:
    priv, pub = keys
    signed = run_cli("sign", model, "--key", priv)
    assert signed.code == 0, signed.err
    assert (model / "model.sig").is_file()
    res = run_cli("verify", model, "--signature", model / "model.sig", "--public-key", pub,
                  "--json")
    assert res.code == 0, res.out + res.err
    doc = json.loads(res.out)["results"][0]
    assert doc["signature_valid"] and doc["ok"]
    paths = {e["path"] for e in doc["entries"]}
    assert {WEIGHTS, "config.json", "tokenizer.json"} <= paths
    assert ".gitattributes" not in paths  # model_signing never signs git files
    assert doc["counts"] == {"ok": len(paths), "mismatched": 0, "missing": 0, "extra": 0}


def test_tampered_added_removed_files_are_each_named(model: Path, keys: tuple[Path, Path],
                                                      run_cli) -> None:
    priv, pub = keys
    sign_model(model, private_key=priv)
    flip_bit(model / WEIGHTS, 4000, 3)
    (model / "extra.bin").write_bytes(b"planted")
    (model / "tokenizer.json").unlink()
    result = verify_model(model, model / "model.sig", public_key=pub)
    assert result.valid and not result.ok
    got = _statuses(result)
    assert got[WEIGHTS] == "mismatched"
    assert got["extra.bin"] == "extra"
    assert got["tokenizer.json"] == "missing"
    assert got["config.json"] == "ok"
    res = run_cli("verify", model, "--signature", model / "model.sig", "--public-key", pub)
    assert res.code == 1
    for name in (WEIGHTS, "extra.bin", "tokenizer.json"):
        assert name in res.out


def test_replaced_signature_is_refused_and_named(model: Path, keys: tuple[Path, Path],
                                                 tmp_path: Path, run_cli) -> None:
    _priv, pub = keys
    other_priv, _ = write_key_pair(tmp_path, "attacker")
    flip_bit(model / WEIGHTS, 4000, 3)
    sign_model(model, private_key=other_priv)  # re-signed over the tampered bytes
    result = verify_model(model, model / "model.sig", public_key=pub)
    assert not result.valid and not result.ok and result.reason
    res = run_cli("verify", model, "--signature", model / "model.sig", "--public-key", pub)
    assert res.code == 1
    assert "model.sig" in res.out and "refused" in res.out


def test_edited_payload_does_not_verify(model: Path, keys: tuple[Path, Path]) -> None:
    import base64

    priv, pub = keys
    sign_model(model, private_key=priv)
    flip_bit(model / WEIGHTS, 4000, 3)
    bundle = json.loads((model / "model.sig").read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    actual = __import__("hashlib").sha256((model / WEIGHTS).read_bytes()).hexdigest()
    for res in statement["predicate"]["resources"]:
        if res["name"] == WEIGHTS:
            res["digest"] = actual  # the attacker rewrites the signed digest
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    (model / "model.sig").write_text(json.dumps(bundle))
    result = verify_model(model, model / "model.sig", public_key=pub)
    assert not result.valid


def test_model_signing_signature_verifies_with_torchverity(model: Path,
                                                           keys: tuple[Path, Path]) -> None:
    priv, pub = keys
    done = _ms("sign", "key", model, "--private_key", priv, "--signature", model / "model.sig")
    assert done.returncode == 0, done.stderr
    assert verify_model(model, model / "model.sig", public_key=pub).ok
    flip_bit(model / "config.json", 10, 1)
    result = verify_model(model, model / "model.sig", public_key=pub)
    assert result.valid and _statuses(result)["config.json"] == "mismatched"
    assert [e.path for e in result.problems] == ["config.json"]


def test_torchverity_signature_verifies_with_model_signing(model: Path,
                                                           keys: tuple[Path, Path]) -> None:
    priv, pub = keys
    from torchverity.manifest import write_manifest

    write_manifest(model)  # torchverity's own records stay out of the signature
    sign_model(model, private_key=priv)
    done = _ms("verify", "key", model, "--public_key", pub, "--signature", model / "model.sig")
    assert done.returncode == 0, done.stdout + done.stderr
    flip_bit(model / WEIGHTS, 4000, 3)
    done = _ms("verify", "key", model, "--public_key", pub, "--signature", model / "model.sig")
    assert done.returncode != 0 and WEIGHTS in done.stdout + done.stderr


def test_single_file_interop_both_ways(model: Path, keys: tuple[Path, Path],
                                       tmp_path: Path) -> None:
    priv, pub = keys
    weights = model / WEIGHTS
    sign_model(weights, private_key=priv, signature=tmp_path / "w.sig")
    done = _ms("verify", "key", weights, "--public_key", pub, "--signature", tmp_path / "w.sig")
    assert done.returncode == 0, done.stdout + done.stderr
    done = _ms("sign", "key", weights, "--private_key", priv, "--signature", tmp_path / "m.sig")
    assert done.returncode == 0, done.stderr
    assert verify_model(weights, tmp_path / "m.sig", public_key=pub).ok
    flip_bit(weights, 4000, 0)
    result = verify_model(weights, tmp_path / "m.sig", public_key=pub)
    assert [(e.path, e.status) for e in result.entries] == [(WEIGHTS, "mismatched")]


def test_fresh_manifest_digests_are_reused_not_rehashed(model: Path,
                                                        keys: tuple[Path, Path]) -> None:
    from torchverity.manifest import write_manifest

    priv, pub = keys
    write_manifest(model, "sha256")  # signatures hold SHA-256: such records are reused
    report = sign_model(model, private_key=priv)
    assert report.hashed == ()
    assert set(report.reused) == set(report.files)
    assert verify_model(model, model / "model.sig", public_key=pub).ok


def test_default_blake3_records_are_not_signed_as_sha256(model: Path,
                                                         keys: tuple[Path, Path]) -> None:
    """A BLAKE3 manifest cannot stand in for SHA-256: every file is hashed, and the
    signature still verifies with model_signing's own command."""
    from torchverity.manifest import write_manifest

    priv, pub = keys
    write_manifest(model)
    report = sign_model(model, private_key=priv)
    assert report.reused == {} and set(report.hashed) == set(report.files)
    done = _ms("verify", "key", model, "--public_key", pub, "--signature", model / "model.sig")
    assert done.returncode == 0, done.stdout + done.stderr


def test_stale_records_are_hashed_again(model: Path, keys: tuple[Path, Path]) -> None:
    from torchverity.manifest import write_manifest

    priv, pub = keys
    write_manifest(model, "sha256")  # signatures hold SHA-256: such records are reused
    manifest_mtime = (model / "torchverity.manifest.json").stat().st_mtime_ns
    (model / "config.json").write_text('{"edited": true}\n')
    os.utime(model / "config.json", ns=(manifest_mtime + 10**9, manifest_mtime + 10**9))
    report = sign_model(model, private_key=priv)
    assert report.hashed == ("config.json",)
    assert verify_model(model, model / "model.sig", public_key=pub).ok


def test_silent_damage_after_the_record_is_caught_after_signing(
        model: Path, keys: tuple[Path, Path]) -> None:
    """A flip that keeps the mtime: the recorded (good) digest is signed, verify names the file."""
    from torchverity.manifest import write_manifest

    priv, pub = keys
    write_manifest(model, "sha256")  # signatures hold SHA-256: such records are reused
    flip_bit(model / WEIGHTS, 4000, 5, keep_mtime=True)
    report = sign_model(model, private_key=priv)
    assert WEIGHTS in report.reused
    result = verify_model(model, model / "model.sig", public_key=pub)
    assert [e.path for e in result.problems] == [WEIGHTS]


def test_save_sidecar_is_reused(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    import torch

    import torchverity

    priv, pub = keys
    folder = tmp_path / "ckpt"
    folder.mkdir()
    torchverity.save({"w": torch.arange(1000, dtype=torch.float32)}, folder / "model.pt",
                     algo="sha256")
    report = sign_model(folder, private_key=priv)
    assert report.reused.get("model.pt") == "model.pt.sha256"
    assert "model.pt" not in report.hashed
    done = _ms("verify", "key", folder, "--public_key", pub, "--signature", folder / "model.sig")
    assert done.returncode == 0, done.stdout + done.stderr


def test_certificate_mode_both_ways(model: Path, tmp_path: Path, run_cli) -> None:
    pki = write_pki(tmp_path)
    res = run_cli("sign", model, "--key", pki.leaf_key, "--certificate", pki.leaf,
                  "--chain", pki.ca)
    assert res.code == 0, res.err
    res = run_cli("verify", model, "--signature", model / "model.sig", "--certificate", pki.ca)
    assert res.code == 0, res.out + res.err
    assert "CN=model publisher" in res.out
    done = _ms("verify", "certificate", model, "--signature", model / "model.sig",
               "--certificate_chain", pki.ca)
    assert done.returncode == 0, done.stdout + done.stderr
    other = write_pki(tmp_path, tag="-other")
    res = run_cli("verify", model, "--signature", model / "model.sig", "--certificate", other.ca)
    assert res.code == 1 and "refused" in res.out


def test_model_signing_certificate_signature_verifies(model: Path, tmp_path: Path) -> None:
    pki = write_pki(tmp_path)
    done = _ms("sign", "certificate", model, "--private_key", pki.leaf_key,
               "--signing_certificate", pki.leaf, "--certificate_chain", pki.ca,
               "--signature", model / "model.sig")
    assert done.returncode == 0, done.stderr
    result = verify_model(model, model / "model.sig", certificate_chain=[pki.ca])
    assert result.ok and "model publisher" in result.signer


def test_expired_certificate_exits_2_and_writes_nothing(model: Path, tmp_path: Path,
                                                        run_cli) -> None:
    pki = write_pki(tmp_path, expired=True)
    before = sorted(p.name for p in model.iterdir())
    res = run_cli("sign", model, "--key", pki.leaf_key, "--certificate", pki.leaf,
                  "--chain", pki.ca)
    assert res.code == 2
    assert "expired" in res.err and "Traceback" not in res.err
    assert sorted(p.name for p in model.iterdir()) == before


def test_wrong_key_type_exits_2_and_writes_nothing(model: Path, tmp_path: Path,
                                                   run_cli) -> None:
    rsa_priv, rsa_pub = write_rsa_keys(tmp_path)
    res = run_cli("sign", model, "--key", rsa_priv)
    assert res.code == 2 and "RSA" in res.err and "elliptic-curve" in res.err
    assert not (model / "model.sig").exists()
    priv, _ = write_key_pair(tmp_path)
    sign_model(model, private_key=priv)
    res = run_cli("verify", model, "--signature", model / "model.sig", "--public-key", rsa_pub)
    assert res.code == 2 and "RSA" in res.err


@pytest.mark.parametrize("content", [b"", b"{not json", b'{"mediaType": "x"}',
                                     b"\xff\xfe binary"])
def test_malformed_bundle_exits_2_with_a_clear_message(model: Path, keys: tuple[Path, Path],
                                                       tmp_path: Path, content: bytes,
                                                       run_cli) -> None:
    _priv, pub = keys
    sig = tmp_path / "bad.sig"
    sig.write_bytes(content)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    res = run_cli("verify", model, "--signature", sig, "--public-key", pub)
    assert res.code == 2, res.out + res.err
    assert "not an OpenSSF model signature" in res.err and "Traceback" not in res.err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_symlinks_are_refused_when_signing(model: Path, keys: tuple[Path, Path],
                                           tmp_path: Path) -> None:
    from torchverity.errors import InputError

    (tmp_path / "outside.bin").write_bytes(b"secret")
    os.symlink(tmp_path / "outside.bin", model / "link.bin")
    with pytest.raises(InputError, match="symlinks"):
        sign_model(model, private_key=keys[0])
    assert not (model / "model.sig").exists()


def test_missing_signature_and_no_trust_are_usage_errors(model: Path, keys: tuple[Path, Path],
                                                         run_cli) -> None:
    res = run_cli("verify", model, "--signature", model / "nope.sig", "--public-key", keys[1])
    assert res.code == 2 and "no such signature" in res.err
    sign_model(model, private_key=keys[0])
    res = run_cli("verify", model, "--signature", model / "model.sig")
    assert res.code == 2 and "--public-key" in res.err
    res = run_cli("verify", model, "--public-key", keys[1])  # model.sig found beside it
    assert res.code == 0 and "model.sig" in res.out
    res = run_cli("verify", model / "config.json", "--public-key", keys[1])
    assert res.code == 2 and "no model.sig" in res.err
    shutil.rmtree(model)


def test_load_with_signature_accepts_signed_and_refuses_tampered(
        tmp_path: Path, keys: tuple[Path, Path]) -> None:
    import torch

    import torchverity
    from torchverity.errors import IntegrityError

    priv, pub = keys
    folder = tmp_path / "run"
    folder.mkdir()
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    torch.save(state, folder / "model.pt")  # plain torch.save: no sidecar at all
    sign_model(folder, private_key=priv)
    obj, report = torchverity.load(folder / "model.pt", signature=folder / "model.sig",
                                   public_key=pub, with_report=True)
    assert torch.equal(obj["w"], state["w"]) and report.digest_source == "signature"
    _other_priv, other_pub = write_key_pair(tmp_path, "other")
    with pytest.raises(IntegrityError, match="does not verify"):
        torchverity.load(folder / "model.pt", signature=folder / "model.sig", public_key=other_pub)
    flip_bit(folder / "model.pt", (folder / "model.pt").stat().st_size - 3000, 6)
    with pytest.raises(IntegrityError, match="its signature"):
        torchverity.load(folder / "model.pt", signature=folder / "model.sig", public_key=pub)


def test_load_of_a_signed_sharded_folder(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    import torchverity
    from torchverity.errors import IntegrityError

    priv, pub = keys
    model = hf_model_folder(tmp_path / "sharded", shard="60KB")
    sign_model(model, private_key=priv)
    state = torchverity.load(model, signature=model / "model.sig", public_key=pub)
    shard = "model-00001-of-00003.safetensors"
    single = torchverity.load(model / shard, signature=model / "model.sig", public_key=pub)
    assert set(single) < set(state)
    (model / "planted.bin").write_bytes(b"x")
    with pytest.raises(IntegrityError, match=r"planted\.bin extra"):
        torchverity.load(model, signature=model / "model.sig", public_key=pub)


def test_load_of_a_file_the_signature_does_not_cover(tmp_path: Path,
                                                     keys: tuple[Path, Path]) -> None:
    import torch

    import torchverity
    from torchverity.errors import IntegrityError

    (tmp_path / "run").mkdir()
    a, b = tmp_path / "run" / "a.pt", tmp_path / "b.pt"
    torch.save({"x": torch.ones(2)}, a)
    torch.save({"x": torch.zeros(2)}, b)
    sign_model(a.parent, private_key=keys[0])
    with pytest.raises(IntegrityError, match="not covered"):
        torchverity.load(b, signature=a.parent / "model.sig", public_key=keys[1])
    # A single-file signature speaks for whichever file it is given with.
    sign_model(a, private_key=keys[0])
    with pytest.raises(IntegrityError, match="does not match its signature"):
        torchverity.load(b, signature=tmp_path / "run" / "a.pt.sig", public_key=keys[1])


@pytest.mark.parametrize("hashing", ["shards", "blake2"])
def test_other_serializations_from_model_signing_verify(model: Path, keys: tuple[Path, Path],
                                                        hashing: str) -> None:
    import model_signing

    priv, pub = keys
    cfg = model_signing.hashing.Config()
    if hashing == "shards":
        cfg.use_shard_serialization(shard_size=4096)
    else:
        cfg.use_file_serialization(hashing_algorithm="blake2")
    cfg.set_ignored_paths(paths=[model / "model.sig"])
    model_signing.signing.Config().use_elliptic_key_signer(private_key=priv) \
        .set_hashing_config(cfg).sign(model, model / "model.sig")
    assert verify_model(model, model / "model.sig", public_key=pub).ok
    flip_bit(model / WEIGHTS, 5000, 1)
    result = verify_model(model, model / "model.sig", public_key=pub)
    bad = [e.path for e in result.problems]
    assert bad == ([f"{WEIGHTS}:4096:8192"] if hashing == "shards" else [WEIGHTS])


def test_a_signed_file_swapped_for_a_link_is_not_followed(model: Path, keys: tuple[Path, Path],
                                                          tmp_path: Path, run_cli) -> None:
    priv, pub = keys
    res = run_cli("sign", model, "--key", priv, "--json")
    assert res.code == 0 and json.loads(res.out)["mode"] == "key"
    outside = tmp_path / "same-bytes.json"
    outside.write_bytes((model / "config.json").read_bytes())
    (model / "config.json").unlink()
    os.symlink(outside, model / "config.json")  # identical bytes, but behind a link
    result = verify_model(model, model / "model.sig", public_key=pub)
    (bad,) = result.problems
    assert (bad.path, bad.status, bad.actual) == ("config.json", "mismatched", "symlink")


def test_key_and_certificate_modes_are_not_confused(model: Path, keys: tuple[Path, Path],
                                                    tmp_path: Path) -> None:
    pki = write_pki(tmp_path)
    sign_model(model, private_key=pki.leaf_key, certificate=pki.leaf, chain=[pki.ca],
               signature=tmp_path / "cert.sig")
    result = verify_model(model, tmp_path / "cert.sig", public_key=keys[1])
    assert not result.valid and "--certificate" in (result.reason or "")
    sign_model(model, private_key=keys[0], signature=tmp_path / "key.sig")
    result = verify_model(model, tmp_path / "key.sig", certificate_chain=[pki.ca])
    assert not result.valid and "--public-key" in (result.reason or "")


def test_signed_model_downloaded_into_a_hub_cache_verifies(model: Path, keys: tuple[Path, Path],
                                                           tmp_path: Path, run_cli) -> None:
    """A publisher's signature shipped in the repo: the snapshot's links into its own blobs
    are followed, nothing else is."""
    from provenance_helpers import hub_cache_from_folder

    priv, pub = keys
    done = _ms("sign", "key", model, "--private_key", priv, "--signature", model / "model.sig")
    assert done.returncode == 0, done.stderr
    repo = hub_cache_from_folder(tmp_path / "hub", "org/signed", "c" * 40, model)
    snap = repo / "snapshots" / ("c" * 40)
    res = run_cli("verify", snap, "--signature", snap / "model.sig", "--public-key", pub)
    assert res.code == 0, res.out + res.err
    done = _ms("sign", "key", model / WEIGHTS, "--private_key", priv, "--signature",
               tmp_path / "w.sig")
    assert done.returncode == 0, done.stderr
    assert verify_model(snap / WEIGHTS, tmp_path / "w.sig", public_key=pub).ok
    flip_bit(snap / os.readlink(snap / WEIGHTS), 4000, 1)
    (tmp_path / "evil.json").write_bytes((model / "config.json").read_bytes())
    (snap / "config.json").unlink()
    (snap / "config.json").symlink_to(tmp_path / "evil.json")
    result = verify_model(snap, snap / "model.sig", public_key=pub)
    got = {e.path: (e.status, e.actual) for e in result.problems}
    assert got[WEIGHTS][0] == "mismatched"
    assert got["config.json"] == ("mismatched", "symlink")  # same bytes, but outside: refused
    assert not verify_model(snap / WEIGHTS, tmp_path / "w.sig", public_key=pub).ok


def test_a_keyless_sigstore_bundle_says_how_to_check_it(model: Path, keys: tuple[Path, Path],
                                                        tmp_path: Path) -> None:
    """Keyless bundles carry a Fulcio certificate and need the Sigstore logs (network)."""
    import base64

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    pki = write_pki(tmp_path)
    sign_model(model, private_key=keys[0])
    bundle = json.loads((model / "model.sig").read_text())
    leaf = x509.load_pem_x509_certificate(pki.leaf.read_bytes())
    der = leaf.public_bytes(serialization.Encoding.DER)
    bundle["verificationMaterial"] = {"certificate": {"rawBytes": base64.b64encode(der).decode()},
                                      "tlogEntries": []}
    (tmp_path / "keyless.sig").write_text(json.dumps(bundle))
    result = verify_model(model, tmp_path / "keyless.sig", public_key=keys[1])
    assert not result.valid and "model_signing verify sigstore" in (result.reason or "")


def test_a_missing_model_path_says_what_to_give(tmp_path: Path) -> None:
    from torchverity.errors import InputError
    from torchverity.provenance._attest import verify_attestation
    from torchverity.provenance._oms import verify_model

    for check in (lambda p: verify_model(p, tmp_path / "model.sig"),
                  lambda p: verify_attestation(p, tmp_path / "a.intoto.json")):
        with pytest.raises(InputError) as caught:
            check(tmp_path / "absent")
        assert caught.value.path == str(tmp_path / "absent")
        assert "no such file or directory" in caught.value.message
        assert caught.value.hint and "model folder or checkpoint file" in caught.value.hint
