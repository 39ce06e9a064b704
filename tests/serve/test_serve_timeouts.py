"""A client that stalls mid-headers or mid-body gets 408 problem+json and is disconnected
within the read timeout, a request that is not HTTP gets 400 problem+json, on a real
uvicorn server; a prompt client is served as before."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest
import torch

from uvicorn_server import start

pytest.importorskip("fastapi")

from torchverity.serve import create_app, timed_protocol

TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    torch.manual_seed(0)
    app = create_app(torch.nn.Linear(4, 2), input_spec=["x:FP32:-1,4"], recheck_interval=None)
    svc = start(app, lifespan="auto", http=timed_protocol(TIMEOUT_S, TIMEOUT_S))
    yield svc.port
    svc.stop()


def _exchange(port: int, first: bytes, rest: bytes | None = None) -> tuple[bytes, float]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        start = time.monotonic()
        conn.sendall(first)
        if rest is not None:
            conn.sendall(rest)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
            if rest is not None and b"\r\n\r\n" in data and _complete(data):
                break
        return data, time.monotonic() - start


def _complete(data: bytes) -> bool:
    head, _, body = data.partition(b"\r\n\r\n")
    length = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
              if line.lower().startswith(b"content-length:")]
    return bool(length) and len(body) >= length[0]


def _problem(data: bytes, status: bytes = b"408") -> dict[str, object]:
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 " + status), head
    assert b"application/problem+json" in head
    return dict(json.loads(body))


def test_stalled_headers_get_408(port: int) -> None:
    data, took = _exchange(port, b"POST /v2/models/Linear/infer HTTP/1.1\r\nHost: x\r\n")
    assert _problem(data)["status"] == 408 and took < TIMEOUT_S + 2


def test_a_stalled_body_gets_408(port: int) -> None:
    head = (b"POST /predict HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 400\r\n\r\n{\"inputs\": ")
    data, took = _exchange(port, head)
    problem = _problem(data)
    assert "request body" in str(problem["detail"]) and took < TIMEOUT_S + 2


def test_a_prompt_client_is_served(port: int) -> None:
    data, _ = _exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", b"")
    assert data.startswith(b"HTTP/1.1 200"), data[:200]


@pytest.mark.parametrize("request_bytes", [
    b"NOT HTTP AT ALL\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nbad header line\r\n\r\n",
    b"POST /predict HTTP/1.1\r\nHost: x\r\ncontent-length: -5\r\n\r\n",
])
def test_a_malformed_request_gets_400_problem_json(port: int, request_bytes: bytes) -> None:
    data, _ = _exchange(port, request_bytes)
    problem = _problem(data, b"400")
    assert problem["status"] == 400
    assert problem["type"] == "urn:torchverity:problem:malformed-request"
