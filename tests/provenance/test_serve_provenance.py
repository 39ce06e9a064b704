"""serve --signature / --attestation: refused before listening, exposed in /metadata."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from provenance_helpers import flip_bit

from torchverity.provenance._keys import write_key_pair
from uvicorn_server import start

pytest.importorskip("fastapi")
pytest.importorskip("model_signing")
import httpx

import torchverity
from torchverity.errors import IntegrityError
from torchverity.provenance import sign_model, write_attestation
from torchverity.serve import create_app

MODEL_SOURCE = textwrap.dedent(
    """
    import torch

    class Tiny(torch.nn.Module):
        input_spec = ["x:float32:-1,4"]

        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x)

    def build():
        torch.manual_seed(0)
        return Tiny()
    """
)


@pytest.fixture
def served(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    (tmp_path / "tvprov_model.py").write_text(MODEL_SOURCE)
    sys.path.insert(0, str(tmp_path))
    from tvprov_model import build

    folder = tmp_path / "weights"
    folder.mkdir()
    torchverity.save(build().state_dict(), folder / "model.pt", seed=7)
    priv, pub = write_key_pair(tmp_path)
    sign_model(folder, private_key=priv)
    training = tmp_path / "certified.json"
    training.write_text('{"steps_verified": 500, "anomalies": 0}')
    att, _ = write_attestation(folder / "model.pt", private_key=priv, training=training)
    yield folder / "model.pt", folder / "model.sig", pub, att
    sys.path.remove(str(tmp_path))


def test_metadata_exposes_signature_and_attestation(served) -> None:
    weights, sig, pub, att = served
    app = create_app("tvprov_model:build", weights, recheck_interval=None, provenance={
        "signature": sig, "public_key": pub, "attestation": att})
    svc = start(app)
    url = svc.url
    try:
        meta = httpx.get(f"{url}/metadata", timeout=10).json()
        answer = httpx.post(f"{url}/predict", timeout=10, json={"inputs": [
            {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0.0, 1.0, 2.0, 3.0]}]})
    finally:
        svc.stop()
    weights_meta = meta["parameters"]["weights"]
    assert weights_meta["verified_by"] == "signature"
    prov = weights_meta["provenance"]
    assert prov["signature"] == str(sig)
    predicate = prov["attestation"]["predicate"]
    assert predicate["training"]["record"]["steps_verified"] == 500
    recorded = predicate["checkpoint"]["model.pt"]["fingerprint"]["root"]
    assert recorded == weights_meta["fingerprint_verified"]
    assert answer.status_code == 200
    served_fp = meta["parameters"]["fingerprint"]
    header = answer.headers["TorchVerity-Fingerprint"]
    assert header == f"{served_fp['algorithm']}:{served_fp['root']}"


def test_weights_the_signature_refuses_never_serve(served, run_cli) -> None:
    weights, sig, pub, _att = served
    flip_bit(weights, weights.stat().st_size - 400, 2)
    with pytest.raises(IntegrityError, match="its signature"):
        create_app("tvprov_model:build", weights, recheck_interval=None,
                   provenance={"signature": sig, "public_key": pub})
    res = run_cli("serve", "--model", "tvprov_model:build", "--weights", weights,
                  "--signature", sig, "--public-key", pub, "--check")
    assert res.code == 1 and "signature" in res.err


def test_attestation_for_other_weights_is_refused(served) -> None:
    weights, sig, pub, att = served
    flip_bit(weights, weights.stat().st_size - 400, 2)
    # The sidecar is rewritten by an attacker; only the attestation still knows.
    torchverity.write_sidecar(weights, torchverity.digest_file(weights))
    weights.with_name("model.pt.meta.json").unlink()
    with pytest.raises(IntegrityError, match="attestation"):
        create_app("tvprov_model:build", weights, recheck_interval=None,
                   provenance={"attestation": att, "public_key": pub})
    assert sig.is_file()
