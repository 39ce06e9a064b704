"""in-toto attestations for checkpoints: written, signed, verified, tampering caught."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch
from provenance_helpers import flip_bit, write_pki

import torchverity
from torchverity.provenance import build_statement, verify_attestation, write_attestation
from torchverity.provenance._keys import write_key_pair

pytest.importorskip("in_toto_attestation")
pytest.importorskip("model_signing")


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    torchverity.save(model.state_dict(), folder / "model.pt", seed=1234)
    return folder / "model.pt"


def test_statement_is_in_toto_v1_with_fingerprint_and_seed(ckpt: Path, tmp_path: Path) -> None:
    from google.protobuf import json_format
    from in_toto_attestation.v1 import statement as itoto

    training = tmp_path / "certified.json"
    training.write_text(json.dumps({"steps_verified": 100, "anomalies": 0}))
    st = build_statement(ckpt, training=training)
    # The package's own parser and validator accept it.
    itoto.Statement.copy_from_pb(json_format.ParseDict(st, itoto.spb.Statement())).validate()
    assert st["_type"] == "https://in-toto.io/Statement/v1"
    assert st["subject"] == [{"name": "model.pt", "digest": {
        "sha256": torchverity.digest_file(ckpt, "sha256").hexdigest}}]
    rec = st["predicate"]["checkpoint"]["model.pt"]
    meta = json.loads(ckpt.with_name("model.pt.meta.json").read_text())
    assert rec["fingerprint"]["root"] == meta["fingerprint"]["root"]
    assert rec["seed"] == 1234
    assert st["predicate"]["training"]["record"] == {"steps_verified": 100, "anomalies": 0}


def test_unsigned_attestation_round_trip_and_damage(ckpt: Path, run_cli) -> None:
    res = run_cli("attest", ckpt)
    assert res.code == 0, res.err
    att = ckpt.with_name("model.pt.intoto.json")
    res = run_cli("verify", ckpt, "--attestation", att)
    assert res.code == 0, res.out + res.err
    assert "unsigned" in res.out
    flip_bit(ckpt, ckpt.stat().st_size - 200, 4)
    result = verify_attestation(ckpt, att)
    assert [(e.path, e.status) for e in result.problems] == [("model.pt", "mismatched")]
    assert run_cli("verify", ckpt, "--attestation", att).code == 1


def test_signed_attestation_verifies_and_refuses_edits(ckpt: Path, tmp_path: Path,
                                                       run_cli) -> None:
    priv, pub = write_key_pair(tmp_path)
    folder = ckpt.parent
    res = run_cli("attest", folder, "--key", priv)
    assert res.code == 0, res.err
    att = folder / "attestation.intoto.json"
    result = verify_attestation(folder, att, public_key=pub)
    assert result.ok and result.predicate["checkpoint"]["model.pt"]["seed"] == 1234
    names = {e.path for e in result.entries}
    assert names == {"model.pt", "model.pt.blake3", "model.pt.meta.json"}
    # An attacker edits the signed statement to match swapped weights: the envelope fails.
    bundle = json.loads(att.read_text())
    st = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    st["predicate"]["checkpoint"]["model.pt"]["seed"] = 1
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(st).encode()).decode()
    att.write_text(json.dumps(bundle))
    assert not verify_attestation(folder, att, public_key=pub).valid
    res = run_cli("verify", folder, "--attestation", att, "--public-key", pub)
    assert res.code == 1 and "refused" in res.out


def test_signed_attestation_with_certificate_chain(ckpt: Path, tmp_path: Path) -> None:
    pki = write_pki(tmp_path)
    att, _ = write_attestation(ckpt, private_key=pki.leaf_key, certificate=pki.leaf,
                               chain=[pki.ca])
    result = verify_attestation(ckpt, att, certificate_chain=[pki.ca])
    assert result.ok and "model publisher" in result.signer
    other = write_pki(tmp_path, tag="-x")
    assert not verify_attestation(ckpt, att, certificate_chain=[other.ca]).valid


def test_unsigned_attestation_is_refused_when_a_key_is_required(ckpt: Path,
                                                                tmp_path: Path) -> None:
    _priv, pub = write_key_pair(tmp_path)
    att, _ = write_attestation(ckpt)
    result = verify_attestation(ckpt, att, public_key=pub)
    assert not result.valid and "not signed" in (result.reason or "")


@pytest.mark.parametrize("content", [b"", b"[]", b'{"_type": "x"}', b"\x00\x01"])
def test_malformed_attestation_exits_2(ckpt: Path, tmp_path: Path, content: bytes,
                                       run_cli) -> None:
    att = tmp_path / "bad.json"
    att.write_bytes(content)
    res = run_cli("verify", ckpt, "--attestation", att)
    assert res.code == 2, res.out + res.err
    assert "Traceback" not in res.err and "bad.json" in res.err


def test_attest_with_a_wrong_key_writes_nothing(ckpt: Path, tmp_path: Path, run_cli) -> None:
    from provenance_helpers import write_rsa_keys

    rsa_priv, _ = write_rsa_keys(tmp_path)
    res = run_cli("attest", ckpt, "--key", rsa_priv)
    assert res.code == 2 and "RSA" in res.err
    assert not ckpt.with_name("model.pt.intoto.json").exists()


def test_guard_log_of_a_real_run_is_attested(tmp_path: Path, run_cli) -> None:
    from torchverity.training import TrainingGuard

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    log = tmp_path / "events.jsonl"
    guard = TrainingGuard(model, opt, log=log, checkpoint_dir=tmp_path / "ckpts")
    for _ in range(12):
        opt.zero_grad()
        loss = model(torch.randn(16, 8)).pow(2).mean()
        loss.backward()
        guard.check(loss)
        guard.step()
    saved = guard.save_checkpoint()  # a certified checkpoint: meta.json says so
    guard.close()
    res = run_cli("attest", saved, "--guard-log", log, "--out", tmp_path / "cert.intoto.json",
                  "--json")
    assert res.code == 0, res.err
    predicate = json.loads(res.out)["statement"]["predicate"]
    assert predicate["checkpoint"][saved.name]["certification"]["certified"] is True
    torchverity.save(model.state_dict(), tmp_path / "model.pt", seed=0)
    res = run_cli("attest", tmp_path / "model.pt", "--guard-log", log, "--json")
    assert res.code == 0, res.err
    record = json.loads(res.out)["statement"]["predicate"]["guard"]
    assert record["steps"] == 12 and record["anomalies"] == {} and record["finished"]
    assert record["sha256"] == torchverity.digest_file(log, "sha256").hexdigest
    result = verify_attestation(tmp_path / "model.pt", tmp_path / "model.pt.intoto.json")
    assert result.ok and result.predicate["guard"]["steps"] == 12
