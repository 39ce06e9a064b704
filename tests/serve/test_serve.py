"""The model service, end to end over real HTTP: uvicorn on 127.0.0.1, real files, real torch.

Both directions everywhere: tampered requests, corrupted weights and corrupted
memory are refused with the right problem type (and the model never runs on
refused input); clean traffic, clean weights and clean re-checks raise nothing.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from uvicorn_server import Service, start

pytest.importorskip("fastapi")
import httpx
import torch

import torchverity
from torchverity.errors import IntegrityError, ServiceError
from torchverity.serve._app import create_app
from torchverity.serve._client import Client
from torchverity.serve._digest_fields import (
    DEFER_MIN_BYTES,
    DEFERRED_DIGEST,
    ContentDigestMiddleware,
)
from torchverity.serve._digests import format_digest
from torchverity.serve._problem import (
    BODY_TOO_LARGE,
    DIGEST_INVALID,
    DIGEST_MISMATCH,
    DIGEST_REQUIRED,
    DIGEST_UNSUPPORTED,
    INVALID_INPUT,
    INVALID_JSON,
    NOT_READY,
    UNSUPPORTED_MEDIA_TYPE,
)

MODEL_SOURCE = textwrap.dedent(
    """
    import torch

    GOLDEN_INPUT = torch.linspace(-1, 1, 8).reshape(2, 4)

    class Mlp(torch.nn.Module):
        input_spec = ["x:float32:-1,4"]

        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(4, 8)
            self.fc2 = torch.nn.Linear(8, 3)
            # Not in the state_dict, so not fingerprinted: only the golden check sees it.
            self.register_buffer("shift", torch.zeros(3), persistent=False)
            self.calls = 0  # how often the model ran on request data (not the golden probe)

        def forward(self, x):
            if x.shape != GOLDEN_INPUT.shape or not torch.equal(x, GOLDEN_INPUT):
                self.calls += 1
            return self.fc2(torch.relu(self.fc1(x))) + self.shift

    def build():
        torch.manual_seed(0)
        return Mlp()
    """
)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model module, verified weights (sidecar + meta.json) and a golden record."""
    root = tmp_path_factory.mktemp("serve")
    (root / "tvserve_model.py").write_text(MODEL_SOURCE)
    sys.path.insert(0, str(root))
    from tvserve_model import GOLDEN_INPUT, build

    model = build()
    torchverity.save(model.state_dict(), root / "model.pt")
    torchverity.golden.record(model, GOLDEN_INPUT, root / "golden.json")
    yield root
    sys.path.remove(str(root))


@pytest.fixture(scope="module")
def service(workspace: Path) -> Iterator[Service]:
    # The overlapping check (opt-in) here; the default strict check has its own test.
    app = create_app("tvserve_model:build", workspace / "model.pt",
                     golden=workspace / "golden.json", recheck_interval=0.1, max_body=1 << 20,
                     overlap_digest=True)
    svc = start(app)
    yield svc
    svc.stop()


def post(url: str, body: bytes, **headers: str) -> httpx.Response:
    headers = {"Content-Type": "application/json", **headers}
    return httpx.post(url + "/predict", content=body, headers=headers)


def request_body(rows: int = 2) -> bytes:
    data = torch.arange(rows * 4, dtype=torch.float32).div(10).tolist()
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, 4], "data": data}]}
    return json.dumps(doc).encode()


def sha256_field(body: bytes) -> str:
    return f"sha-256=:{base64.b64encode(hashlib.sha256(body).digest()).decode()}:"


def problem(response: httpx.Response, status: int, kind: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    doc = response.json()
    assert doc["type"] == kind and doc["status"] == status and doc["detail"]
    return doc


# ------------------------------------------------ clean traffic


def test_predict_answers_what_the_model_computes(service: Service) -> None:
    x = torch.randn(5, 4)
    with Client(service.url) as client:
        out = client.predict({"x": x})["output"]
        with torch.no_grad():
            assert torch.equal(out, service.model(x))
        assert client.fingerprint == service.state.fingerprint_header
        assert client.ready() and client.health()


def test_metadata_traces_answers_to_the_verified_weights(service: Service,
                                                          workspace: Path) -> None:
    with Client(service.url) as client:
        meta = client.metadata()
    sidecar_hex = (workspace / "model.pt.blake3").read_text().split()[0]
    params = meta["parameters"]
    assert meta["name"] == "Mlp" and meta["platform"] == "pytorch"
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert params["weights"]["digest"] == sidecar_hex
    assert params["weights"]["verified_by"] == "sidecar"
    assert params["weights"]["fingerprint_verified"] == params["fingerprint"]["root"]
    assert params["golden"]["status"] == "passed" and params["ready"] is True
    assert params["torch_version"] == torch.__version__


def test_every_response_carries_fingerprint_and_digest(service: Service) -> None:
    for path in ("/health", "/ready", "/metadata", "/no-such-path"):
        r = httpx.get(service.url + path)
        assert r.headers["torchverity-fingerprint"] == service.state.fingerprint_header
        assert r.headers["content-digest"] == sha256_field(r.content)


def test_want_content_digest_is_honoured(service: Service) -> None:
    r = httpx.get(service.url + "/health", headers={"Want-Content-Digest": "sha-256=1, sha-512=9"})
    digest = base64.b64encode(hashlib.sha512(r.content).digest()).decode()
    assert r.headers["content-digest"] == f"sha-512=:{digest}:"
    r = httpx.get(service.url + "/health", headers={"Want-Content-Digest": "sha-256=0, md5=10"})
    assert "content-digest" not in r.headers  # nothing acceptable was asked for
    with Client(service.url, algorithm="sha-512") as client:
        assert client.predict(torch.zeros(1, 4))["output"].shape == (1, 3)


def test_request_digests_in_every_accepted_form(service: Service) -> None:
    body = request_body()
    sha512 = base64.b64encode(hashlib.sha512(body).digest()).decode()
    for field in (sha256_field(body), f"sha-512=:{sha512}:",
                  f"md5=:AAAA:, {sha256_field(body)}",  # unsupported ignored beside a supported one
                  f"{sha256_field(body)};note=1"):  # parameters are allowed by the syntax
        assert post(service.url, body, **{"Content-Digest": field}).status_code == 200, field
    assert post(service.url, body).status_code == 200  # verify-if-present: no digest is fine


def test_checksum_envelope_for_clients_without_headers(service: Service) -> None:
    payload = request_body().decode()
    checksum = sha256_field(payload.encode())
    ok = post(service.url, json.dumps({"payload": payload, "checksum": checksum}).encode())
    assert ok.status_code == 200
    assert ok.json()["outputs"] == post(service.url, request_body()).json()["outputs"]
    tampered = payload.replace("0.1", "0.2")
    bad = post(service.url, json.dumps({"payload": tampered, "checksum": checksum}).encode())
    assert problem(bad, 400, DIGEST_MISMATCH)["mismatching-digests"][0]["header"] == "checksum"
    worse = post(service.url, json.dumps({"payload": payload, "checksum": "sha-1=:AA==:"}).encode())
    problem(worse, 400, DIGEST_UNSUPPORTED)


# ------------------------------------------------ tampered and malformed requests


def test_tampered_body_is_refused_before_the_model_runs(service: Service) -> None:
    body = request_body()
    tampered = body.replace(b"0.1", b"0.9")
    calls = service.model.calls
    r = post(service.url, tampered, **{"Content-Digest": sha256_field(body)})
    doc = problem(r, 400, DIGEST_MISMATCH)
    assert doc["mismatching-digests"] == [{"algorithm": "sha-256", "header": "content-digest"}]
    computed = base64.b64encode(hashlib.sha256(tampered).digest()).decode()
    assert computed not in r.text and computed not in str(r.headers)  # never revealed
    assert service.model.calls == calls


def test_unsupported_algorithm(service: Service) -> None:
    r = post(service.url, request_body(), **{"Content-Digest": "md5=:1B2M2Y8AsgTpgAmY7PhCfg==:"})
    doc = problem(r, 400, DIGEST_UNSUPPORTED)
    assert doc["unsupported-algorithms"] == [{"algorithm": "md5", "header": "content-digest"}]
    assert r.headers["want-content-digest"] == "sha-256=10, sha-512=5"


@pytest.mark.parametrize("field", [
    "sha-256=abc",                       # a token, not a byte sequence
    "sha-256=:not*base64:",              # not base64
    "sha-256=:AAAA:",                    # wrong length for sha-256
    "SHA-256=:AAAA:",                    # keys are lowercase
    "sha-256=:" + "A" * 43 + "=:,",      # trailing comma
    "sha-256=?1",                        # a boolean
    "",                                  # empty
])
def test_malformed_digest_field(service: Service, field: str) -> None:
    calls = service.model.calls
    problem(post(service.url, request_body(), **{"Content-Digest": field}), 400, DIGEST_INVALID)
    assert service.model.calls == calls


def test_oversized_body(service: Service) -> None:
    big = b" " * ((1 << 20) + 1)
    doc = problem(post(service.url, big), 413, BODY_TOO_LARGE)
    assert doc["max-body-bytes"] == 1 << 20


def tensor_doc(name: str = "x", datatype: str = "FP32", shape: Any = (1, 4),
               data: str = "[1, 2, 3, 4]") -> bytes:
    return (f'{{"inputs": [{{"name": "{name}", "datatype": "{datatype}", '
            f'"shape": {list(shape)}, "data": {data}}}]}}').encode()


@pytest.mark.parametrize(("body", "headers", "status", "kind", "says"), [
    (b'{"inputs": []}', {"Content-Type": "text/plain"}, 415, UNSUPPORTED_MEDIA_TYPE, "text/plain"),
    (b"{not json", {}, 422, INVALID_JSON, "not valid JSON"),
    (tensor_doc(data="[NaN, 1, 2, 3]"), {}, 422, INVALID_JSON, "not valid JSON"),
    (tensor_doc(data="[1e39, 1, 2, 3]"), {}, 422, INVALID_INPUT, "infinite"),
    (tensor_doc(shape=(2, 3), data="[1, 2, 3, 4, 5, 6]"), {}, 422, INVALID_INPUT,
     "shape [2, 3] given, the model takes [-1, 4]"),
    (tensor_doc(datatype="INT64"), {}, 422, INVALID_INPUT,
     "datatype INT64 given, the model takes FP32"),
    (tensor_doc(data="[1, 2, 3]"), {}, 422, INVALID_INPUT,
     "data has 3 values, shape [1, 4] needs 4"),
    (tensor_doc(name="y"), {}, 422, INVALID_INPUT, "x: missing"),
    (tensor_doc(data='["a", 2, 3, 4]'), {}, 422, INVALID_INPUT, "not a FP32 array"),
    (tensor_doc(datatype="FP99"), {}, 422, INVALID_INPUT, "does not fit the schema"),
    (b'{"inputs": "x"}', {}, 422, INVALID_INPUT, "does not fit the schema"),
    (b"[" * 100_000, {}, 422, INVALID_JSON, "not valid JSON"),
])
def test_bad_input_is_a_4xx_problem_never_a_500(
    service: Service, body: bytes, headers: dict[str, str], status: int, kind: str, says: str
) -> None:
    calls = service.model.calls
    doc = problem(post(service.url, body, **headers), status, kind)
    assert says in json.dumps(doc)
    assert service.model.calls == calls


# ------------------------------------------------ the middleware in any ASGI app


@pytest.fixture(scope="module")
def echo_service() -> Iterator[Service]:
    """ContentDigestMiddleware(policy="require") mounted in a plain Starlette app."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def echo(request: Request) -> Response:
        return Response(await request.body(), media_type="application/octet-stream")

    app = Starlette(routes=[Route("/echo", echo, methods=["POST"])])
    app.add_middleware(ContentDigestMiddleware, policy="require", max_body=64 * 1024)
    svc = start(app)
    yield svc
    svc.stop()


def test_require_policy_in_a_plain_starlette_app(echo_service: Service) -> None:
    body = os.urandom(40_000)
    r = httpx.post(echo_service.url + "/echo", content=body,
                   headers={"Content-Digest": format_digest("sha-512", body)})
    assert r.status_code == 200 and r.content == body
    assert r.headers["content-digest"] == format_digest("sha-256", body)
    missing = httpx.post(echo_service.url + "/echo", content=body)
    problem(missing, 400, DIGEST_REQUIRED)
    assert missing.headers["want-content-digest"] == "sha-256=10, sha-512=5"


def test_streamed_body_is_hashed_as_it_arrives(echo_service: Service) -> None:
    chunks = [os.urandom(8192) for _ in range(6)]
    body = b"".join(chunks)
    r = httpx.post(echo_service.url + "/echo", content=iter(chunks),  # chunked, no length
                   headers={"Content-Digest": format_digest("sha-256", body)})
    assert r.status_code == 200 and r.content == body
    chunks[3] = bytes(8192)
    r = httpx.post(echo_service.url + "/echo", content=iter(chunks),
                   headers={"Content-Digest": format_digest("sha-256", body)})
    problem(r, 400, DIGEST_MISMATCH)
    too_many = iter([os.urandom(8192) for _ in range(10)])  # 80 KiB > 64 KiB, length unknown
    problem(httpx.post(echo_service.url + "/echo", content=too_many,
                       headers={"Content-Digest": format_digest("sha-256", body)}),
            413, BODY_TOO_LARGE)


# ------------------------------------------------ deferred checks: large bodies overlap parsing


def large_request_body(rows: int = 12_000) -> bytes:
    body = request_body(rows)
    assert len(body) >= DEFER_MIN_BYTES  # takes the deferred path
    return body


def test_large_tampered_body_never_reaches_the_model(service: Service) -> None:
    body = large_request_body()
    position = body.index(b'"data": [') + 20
    assert body[position:position + 1].isdigit()
    flipped = body[:position] + bytes([body[position] ^ 1]) + body[position + 1:]  # a digit
    not_json = body[:position] + b"x" + body[position + 1:]
    calls = service.model.calls
    for tampered in (flipped, not_json):
        r = post(service.url, tampered, **{"Content-Digest": sha256_field(body)})
        doc = problem(r, 400, DIGEST_MISMATCH)  # not 422: the digest decides first
        assert doc["mismatching-digests"] == [{"algorithm": "sha-256", "header": "content-digest"}]
        computed = base64.b64encode(hashlib.sha256(tampered).digest()).decode()
        assert computed not in r.text and computed not in str(r.headers)
        assert r.headers["content-digest"] == sha256_field(r.content)
    sha512 = base64.b64encode(hashlib.sha512(flipped).digest()).decode()
    both = f"sha-512=:{sha512}:, {sha256_field(body)}"  # one algorithm matches, one does not
    doc = problem(post(service.url, flipped, **{"Content-Digest": both}), 400, DIGEST_MISMATCH)
    assert [d["algorithm"] for d in doc["mismatching-digests"]] == ["sha-256"]
    assert service.model.calls == calls  # the model never ran on a refused body


def test_large_clean_body_is_answered_after_its_check(service: Service) -> None:
    body = large_request_body()
    calls = service.model.calls
    r = post(service.url, body, **{"Content-Digest": sha256_field(body)})
    assert r.status_code == 200, r.text
    x = torch.tensor(json.loads(body)["inputs"][0]["data"]).reshape(-1, 4)
    with torch.no_grad():
        expected = service.model(x)
    assert torch.equal(torch.tensor(r.json()["outputs"][0]["data"]).reshape(-1, 3), expected)
    assert service.model.calls == calls + 2  # this request, then the reference above


def test_without_overlap_a_large_body_is_checked_before_it_is_read(workspace: Path) -> None:
    svc = start(create_app("tvserve_model:build", workspace / "model.pt",
                           recheck_interval=None, overlap_digest=False))
    try:
        body = large_request_body()
        tampered = body.replace(b"0.1", b"0.3", 1)
        r = post(svc.url, tampered, **{"Content-Digest": sha256_field(body)})
        problem(r, 400, DIGEST_MISMATCH)
        assert svc.model.calls == 0
        r = post(svc.url, body, **{"Content-Digest": sha256_field(body)})
        assert r.status_code == 200 and svc.model.calls == 1
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def deferred_service() -> Iterator[tuple[Service, list[str]]]:
    """ContentDigestMiddleware(deferred=True) in a plain Starlette app. ``/effect`` records an
    effect only after awaiting the check; ``/careless`` answers without checking at all;
    ``/fragile`` fails on every body."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    effects: list[str] = []

    async def effect(request: Request) -> Response:
        body = await request.body()
        pending = request.scope.get(DEFERRED_DIGEST)
        if pending is not None:
            await pending.verified()  # raises the 400 problem on a mismatch
        effects.append(f"{len(body)} bytes, {'deferred' if pending else 'checked first'}")
        return Response(body, media_type="application/octet-stream")

    async def careless(request: Request) -> Response:
        effects.append("careless")
        return Response(await request.body(), media_type="application/octet-stream")

    async def fragile(request: Request) -> Response:
        raise ValueError(f"cannot use {len(await request.body())} bytes")

    app = Starlette(routes=[Route("/effect", effect, methods=["POST"]),
                            Route("/careless", careless, methods=["POST"]),
                            Route("/fragile", fragile, methods=["POST"])])
    app.add_middleware(ContentDigestMiddleware, policy="require", max_body=1 << 20,
                       deferred=True)
    svc = start(app)
    yield svc, effects
    svc.stop()


def test_deferred_mode_gates_effects_on_the_check(
    deferred_service: tuple[Service, list[str]]
) -> None:
    svc, effects = deferred_service
    large, small = os.urandom(DEFER_MIN_BYTES * 3), os.urandom(1000)
    for body in (large, small):
        tampered = bytes([body[0] ^ 1]) + body[1:]
        r = httpx.post(svc.url + "/effect", content=tampered,
                       headers={"Content-Digest": format_digest("sha-256", body)})
        problem(r, 400, DIGEST_MISMATCH)
    assert effects == []  # neither reached an effect
    for body in (large, small):
        r = httpx.post(svc.url + "/effect", content=body,
                       headers={"Content-Digest": format_digest("sha-512", body)})
        assert r.status_code == 200 and r.content == body
        assert r.headers["content-digest"] == format_digest("sha-256", body)
    assert effects == [f"{len(large)} bytes, deferred", f"{len(small)} bytes, checked first"]
    problem(httpx.post(svc.url + "/effect", content=large), 400, DIGEST_REQUIRED)


def test_deferred_mode_holds_back_an_unchecked_answer(
    deferred_service: tuple[Service, list[str]]
) -> None:
    svc, effects = deferred_service
    done = len(effects)
    body = os.urandom(DEFER_MIN_BYTES * 2)
    tampered = body[:-1] + bytes([body[-1] ^ 0x80])  # one bit, in the last byte
    r = httpx.post(svc.url + "/careless", content=tampered,
                   headers={"Content-Digest": format_digest("sha-256", body)})
    problem(r, 400, DIGEST_MISMATCH)  # the app's echo of the tampered body was dropped
    assert tampered not in r.content and effects[done:] == ["careless"]
    r = httpx.post(svc.url + "/careless", content=body,
                   headers={"Content-Digest": format_digest("sha-256", body)})
    assert r.status_code == 200 and r.content == body


def test_deferred_mode_answers_400_when_the_app_fails_on_a_tampered_body(
    deferred_service: tuple[Service, list[str]]
) -> None:
    svc, _ = deferred_service
    body = os.urandom(DEFER_MIN_BYTES * 2)
    tampered = bytes(16) + body[16:]
    r = httpx.post(svc.url + "/fragile", content=tampered,
                   headers={"Content-Digest": format_digest("sha-256", body)})
    problem(r, 400, DIGEST_MISMATCH)  # the body's fault, as in strict mode
    r = httpx.post(svc.url + "/fragile", content=body,
                   headers={"Content-Digest": format_digest("sha-256", body)})
    assert r.status_code == 500  # a matching body: the app's own failure stays a 500


# ------------------------------------------------ the client checks the service


def test_client_refuses_other_weights_and_tampered_responses(service: Service) -> None:
    with Client(service.url, fingerprint="blake3:" + "0" * 64) as client, \
            pytest.raises(IntegrityError, match="answers from other weights"):
        client.metadata()

    def tamper(request: httpx.Request) -> httpx.Response:
        real = httpx.get(str(request.url))
        return httpx.Response(200, content=real.content.replace(b"alive", b"alivE"),
                              headers=dict(real.headers))

    with Client(service.url, transport=httpx.MockTransport(tamper)) as client, \
            pytest.raises(IntegrityError, match="does not match its Content-Digest"):
        client.health()
    with Client(service.url) as client, pytest.raises(ServiceError, match="422") as err:
        client.predict({"x": torch.zeros(2, 5)})
    assert err.value.status == 422 and err.value.problem_type == INVALID_INPUT


# ------------------------------------------------ weights and memory


def _corrupt_byte(path: Path) -> None:
    """Flip one bit inside the last tensor's data (well past the zip headers)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_corrupted_weights_refuse_to_start(workspace: Path, tmp_path: Path) -> None:
    bad = tmp_path / "model.pt"
    for suffix in ("", ".blake3", ".meta.json"):
        bad.with_name("model.pt" + suffix).write_bytes(
            (workspace / ("model.pt" + suffix)).read_bytes())
    _corrupt_byte(bad)
    env = {**os.environ, "PYTHONPATH": str(workspace), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torchverity", "serve", "--model", "tvserve_model:build",
         "--weights", str(bad), "--port", "1"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert "torchverity: error:" in proc.stderr and "digest does not match" in proc.stderr
    assert "model.pt" in proc.stderr and "next:" in proc.stderr
    assert "Uvicorn running" not in proc.stderr


def test_unverifiable_or_failing_weights_refuse_in_process(workspace: Path,
                                                           tmp_path: Path) -> None:
    from tvserve_model import build

    bare = tmp_path / "bare.pt"
    torch.save(build().state_dict(), bare)
    with pytest.raises(IntegrityError, match="refusing to serve unverified weights"):
        create_app(build, bare)
    torchverity.write_manifest(tmp_path)  # a manifest digest is accepted instead of a sidecar
    app = create_app(build, bare)
    assert app.state.torchverity.weights.digest_source == "manifest"
    other = build()
    with torch.no_grad():
        other.fc2.bias[1] += 1e-3  # a small change the golden record must notice
    with pytest.raises(IntegrityError, match="weights are not the recorded ones"):
        create_app(other, golden=workspace / "golden.json")


def test_cli_serves_verified_weights(workspace: Path) -> None:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(workspace), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchverity", "serve", "--model", "tvserve_model:build",
         "--weights", str(workspace / "model.pt"), "--golden", str(workspace / "golden.json"),
         "--port", str(port), "--device", "cpu", "--json", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        report = json.loads(_read_json_doc(proc))
        assert report["ok"] and report["golden"] == "passed"
        with Client(f"http://127.0.0.1:{port}", fingerprint=report["fingerprint"]) as client:
            _wait_ready(client)
            assert client.predict(torch.ones(1, 4))["output"].shape == (1, 3)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    assert proc.returncode == 0


def test_cli_json_is_one_document_with_access_logs_on_stderr(workspace: Path) -> None:
    """--port 0 serves on the port the system picks and reports it; uvicorn's access log of a
    request goes to stderr, so stdout stays the one JSON report. A port in use fails before
    any report, as one JSON error document."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(workspace), *sys.path]),
           "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "torchverity", "serve", "--json", "--model",
            "tvserve_model:build", "--weights", str(workspace / "model.pt")]
    proc = subprocess.Popen([*args, "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        report = json.loads(_read_json_doc(proc))
        port = int(report["url"].rsplit(":", 1)[1])
        assert port > 0
        with Client(report["url"], fingerprint=report["fingerprint"]) as client:
            _wait_ready(client)
            client.predict(torch.ones(1, 4))
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", port + 1 if port < 65535 else port - 1))
            taken.listen()
            busy = subprocess.run([*args, "--port", str(taken.getsockname()[1])],
                                  capture_output=True, text=True, timeout=120, env=env)
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert out.strip() == "", out  # nothing after the report: the access log is on stderr
    assert '"POST /predict' in err and "200" in err, err
    assert busy.returncode == 2 and "cannot listen on 127.0.0.1" in busy.stderr, busy.stderr
    doc = json.loads(busy.stdout)  # one document: the error, no report before it
    assert doc["ok"] is False and "url" not in doc, busy.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _read_json_doc(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("}"):
            return "".join(lines)
    raise AssertionError(f"no report; stderr: {proc.stderr.read() if proc.stderr else ''}")


def _wait_ready(client: Client) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            if client.ready():
                return
        except ServiceError:
            pass
        assert time.monotonic() < deadline, "the service did not become ready"
        time.sleep(0.05)


def test_memory_corruption_turns_readiness_off_within_the_interval(workspace: Path) -> None:
    from tvserve_model import build

    svc = start(create_app(build, workspace / "model.pt", golden=workspace / "golden.json",
                           recheck_interval=0.1))
    try:
        with Client(svc.url) as client:
            deadline = time.monotonic() + 0.6
            while time.monotonic() < deadline:  # clean re-checks: no false alarm
                assert client.ready()
            assert client.metadata()["parameters"]["rechecks"]["count"] >= 2
            with torch.no_grad():
                svc.model.fc1.weight.view(-1)[5] = svc.model.fc1.weight.view(-1)[5].neg()
            flipped = time.monotonic()
            while client.ready():
                assert time.monotonic() - flipped < 2.0, "corruption not noticed"
                time.sleep(0.02)
            r = httpx.get(svc.url + "/ready")
            assert "fc1.weight" in problem(r, 503, NOT_READY)["detail"]
            calls = svc.model.calls
            problem(post(svc.url, request_body()), 503, NOT_READY)
            assert svc.model.calls == calls  # corrupted memory serves no answers
    finally:
        svc.stop()


def test_a_golden_recheck_that_meets_changed_weights_names_them(workspace: Path) -> None:
    """A flip after a re-check's fingerprint and before its golden pass fails the golden
    pass first: its reason names the changed tensor all the same."""
    from tvserve_model import build

    from torchverity.serve._rechecks import ServiceState

    model = build()
    model.load_state_dict(torchverity.load(workspace / "model.pt"))
    state = ServiceState(model, "tvserve", (), None, workspace / "golden.json")
    assert state.golden_failure() is None
    with torch.no_grad():
        model.fc1.weight.view(-1)[5] = model.fc1.weight.view(-1)[5].neg()
    reason = state.golden_failure()
    assert reason is not None and reason.startswith("golden check failed")
    assert "its weights are not the recorded ones (1 tensor(s) differ: fc1.weight)" in reason


def test_wrong_computation_fails_the_golden_recheck(workspace: Path) -> None:
    from tvserve_model import build

    svc = start(create_app(build, workspace / "model.pt", golden=workspace / "golden.json",
                           recheck_interval=0.1))
    try:
        with Client(svc.url) as client:
            assert client.ready()
            svc.model.shift[1] = 1e-4  # outputs move; the weights' fingerprint does not
            deadline = time.monotonic() + 2.0
            while client.ready():
                assert time.monotonic() < deadline, "wrong outputs not noticed"
                time.sleep(0.02)
            meta = client.metadata()["parameters"]
        assert meta["golden"]["status"] == "failed"
        assert meta["not_ready_reason"].startswith("golden check failed")
    finally:
        svc.stop()


def test_mounted_in_another_app_it_still_rechecks(workspace: Path) -> None:
    from fastapi import FastAPI
    from tvserve_model import build

    inner = create_app(build, workspace / "model.pt", recheck_interval=0.1,
                       digest_policy="require")
    parent = FastAPI()  # Starlette does not run a mounted app's lifespan
    parent.mount("/model", inner)
    svc = start(parent)
    try:
        with Client(svc.url + "/model") as client:
            assert client.ready()
            assert client.predict(torch.ones(2, 4))["output"].shape == (2, 3)
            problem(post(svc.url + "/model", request_body()), 400, DIGEST_REQUIRED)
            model = inner.state.torchverity.model
            with torch.no_grad():
                model.fc2.bias[0] += 1.0
            deadline = time.monotonic() + 2.0
            while client.ready():
                assert time.monotonic() < deadline, "re-checks did not run in the mounted app"
                time.sleep(0.02)
    finally:
        svc.stop()


# ------------------------------------------------ schema fuzzing and load


def test_openapi_documents_every_problem(service: Service) -> None:
    spec = httpx.get(service.url + "/openapi.json").json()
    predict = spec["paths"]["/predict"]["post"]
    for status in ("400", "413", "415", "422", "503"):
        assert "application/problem+json" in predict["responses"][status]["content"]
    model_input = spec["components"]["schemas"]["ModelInput"]["properties"]
    assert model_input["name"]["enum"] == ["x"] and model_input["datatype"]["enum"] == ["FP32"]
    example = predict["requestBody"]["content"]["application/json"]["example"]
    assert post(service.url, json.dumps(example).encode()).status_code == 200


def test_schemathesis_finds_no_server_error(service: Service) -> None:
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(service.url + "/openapi.json")
    statuses: list[int] = []
    for op in schema.get_all_operations():
        operation = op.ok()
        modes = list(schemathesis.GenerationMode)  # valid and deliberately invalid data
        if operation.method.upper() != "POST":  # nothing to make invalid without a body
            modes = [schemathesis.GenerationMode.POSITIVE]
        for mode in modes:

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=20, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def fuzz(case: Any) -> None:
                response = case.call_and_validate(
                    base_url=service.url, checks=[schemathesis.checks.not_a_server_error])
                statuses.append(response.status_code)

            fuzz()
    assert len(statuses) >= 40 and max(statuses) < 500
    assert {200, 422} <= set(statuses)
    assert service.state.readiness().ready  # fuzzing did not disturb the service


def test_load_zero_errors(service: Service) -> None:
    total, concurrency = 2000, 8
    body = {"x": torch.randn(4, 4)}
    latencies: list[float] = []

    def worker(n: int) -> list[float]:
        times = []
        with Client(service.url, fingerprint=service.state.fingerprint_header) as client:
            for _ in range(n):
                t0 = time.perf_counter()
                client.predict(body)
                times.append(time.perf_counter() - t0)
        return times

    with ThreadPoolExecutor(concurrency) as pool:
        for times in pool.map(worker, [total // concurrency] * concurrency):
            latencies += times
    assert len(latencies) == total  # every answer verified (digest and fingerprint), no error
    q = statistics.quantiles(latencies, n=100)
    print(f"\nload: {total} requests, concurrency {concurrency}: "
          f"p50 {q[49] * 1000:.1f} ms, p99 {q[98] * 1000:.1f} ms")
