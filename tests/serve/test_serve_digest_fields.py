"""RFC 9530 field parsing and formatting, and the serve package on a base install."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from torchverity.serve._digests import (
    choose_algorithm,
    format_digest,
    parse_digest_field,
    verify_digest,
)
from torchverity.serve._problem import (
    DIGEST_INVALID,
    DIGEST_MISMATCH,
    DIGEST_UNSUPPORTED,
    ProblemError,
)
from torchverity.serve._spec import parse_spec_entry
from torchverity.serve._structured_fields import FieldSyntaxError, parse_dictionary


def test_structured_dictionary_syntax() -> None:
    parsed = parse_dictionary('a=1, b="x\\"y";p=?0, c, d=(1 tok), e=:AQI=:, f=-2.5')
    assert parsed == {"a": 1, "b": 'x"y', "c": True, "d": [1, "tok"], "e": b"\x01\x02",
                      "f": -2.5}
    assert parse_dictionary("") == {}
    for bad in ("a=1,", "A=1", "a=1 b=2", 'a="open', "a=:bad*:", "a=1,,b=2", "a=\u00e9"):
        with pytest.raises(FieldSyntaxError):
            parse_dictionary(bad)


def test_digest_round_trip_and_constant_answers() -> None:
    body = b'{"inputs": []}'
    field = format_digest("sha-256", body)
    assert field == f"sha-256=:{base64.b64encode(hashlib.sha256(body).digest()).decode()}:"
    assert format_digest("sha-512", [body[:5], body[5:]]) == format_digest("sha-512", body)
    verify_digest(field, body)
    with pytest.raises(ProblemError) as err:
        verify_digest(field, body + b" ")
    assert err.value.problem.type == DIGEST_MISMATCH
    assert field.split("=:")[1] not in err.value.problem.body().decode()


@pytest.mark.parametrize(("field", "kind"), [
    ("sha=:AAAA:", DIGEST_UNSUPPORTED),
    ("md5=:AAAA:, unixsum=1", DIGEST_UNSUPPORTED),
    ("sha-256=1", DIGEST_INVALID),
    ("sha-256=:" + base64.b64encode(bytes(64)).decode() + ":", DIGEST_INVALID),
    ("sha-256", DIGEST_INVALID),
])
def test_digest_field_problems(field: str, kind: str) -> None:
    with pytest.raises(ProblemError) as err:
        parse_digest_field(field)
    assert err.value.problem.type == kind and err.value.problem.status == 400


def test_want_content_digest_choice() -> None:
    assert choose_algorithm(None, "sha-256") == "sha-256"
    assert choose_algorithm("sha-512=3, sha-256=10", None) == "sha-256"
    assert choose_algorithm("sha-512=3", "sha-256") == "sha-512"
    assert choose_algorithm("sha-256=0, md5=9", "sha-256") is None
    assert choose_algorithm("sha-256=11", "sha-256") is None  # out of range: not acceptable
    assert choose_algorithm("not a field!", "sha-256") == "sha-256"


def test_input_spec_forms() -> None:
    text = parse_spec_entry("x:float32:-1,4")
    mapping = parse_spec_entry({"name": "x", "dtype": "FP32", "shape": [-1, 4]})
    assert text == mapping and text.accepts([7, 4]) and not text.accepts([7, 5])
    assert parse_spec_entry("flag:bool:").shape == ()


def test_fast_float_path_matches_torch_tensor_and_stays_strict() -> None:
    import random

    import torch

    from torchverity.serve._spec import _from_json_data

    rng = random.Random(0)
    values = [rng.uniform(-70000, 70000) for _ in range(2000)] + [1e-8, 2**53 + 1, 0, True]
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        assert torch.equal(_from_json_data(values, dtype), torch.tensor(values, dtype=dtype))
    assert _from_json_data([[1.0, 2.0]], torch.float32).shape == (1, 2)  # nested: torch path
    for bad in (["1.5"], [None], [[1.0], 2.0]):
        with pytest.raises((TypeError, ValueError)):
            _from_json_data(bad, torch.float32)


def test_base_install_imports_serve_and_names_the_extra() -> None:
    script = textwrap.dedent(
        """
        import sys
        for name in ("fastapi", "httpx"):
            sys.modules[name] = None  # as if the serve extra were not installed
        import torch
        import torchverity.serve as serve
        from torchverity.errors import MissingExtraError
        from torchverity.cli import main
        serve.ContentDigestMiddleware  # pure ASGI: needs no extra
        for make in (lambda: serve.create_app(torch.nn.Linear(2, 2)),
                     lambda: serve.Client("http://127.0.0.1:1")):
            try:
                make()
            except MissingExtraError as exc:
                print(exc.extra, exc.module)
        sys.exit(main(["serve", "--model", "m:f", "--weights", "w.pt"]))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.stdout.split() == ["serve", "fastapi", "serve", "httpx"]
    assert proc.returncode == 2
    assert "pip install 'torchverity[serve]'" in proc.stderr


def _stream_through_middleware(parts: list[bytes]) -> list[dict[str, Any]]:
    """Run the middleware around an app that streams ``parts``; return what reached the wire."""
    import asyncio

    from torchverity.serve._digest_fields import ContentDigestMiddleware

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i, part in enumerate(parts):
            await send({"type": "http.response.body", "body": part,
                        "more_body": i < len(parts) - 1})

    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/", "headers": []}
    asyncio.run(ContentDigestMiddleware(app)(scope, receive, send))
    return sent


def test_streamed_response_gets_a_digest_over_every_part() -> None:
    parts = [b"alpha ", b"beta ", b"gamma"]
    sent = _stream_through_middleware(parts)
    headers = dict(sent[0]["headers"])
    assert headers[b"content-digest"] == format_digest("sha-256", b"".join(parts)).encode()
    assert b"".join(m["body"] for m in sent[1:]) == b"".join(parts)


def test_huge_streamed_response_passes_without_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchverity.serve import _digest_fields

    monkeypatch.setattr(_digest_fields, "MAX_DIGESTED_RESPONSE", 10)
    parts = [b"0123456789", b"abcdefghij", b"KLMNO"]
    sent = _stream_through_middleware(parts)
    assert b"content-digest" not in dict(sent[0]["headers"])
    assert b"".join(m["body"] for m in sent[1:]) == b"".join(parts)
    assert sent[-1]["more_body"] is False
