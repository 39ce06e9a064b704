"""Problem details (RFC 9457) shared by the digest middleware and the model service.

Every error the service answers is an ``application/problem+json`` document
with a stable ``type`` URI a client can switch on. The three digest problem
types are the ones registered by the IETF digest-fields problem-types draft;
the others are torchverity's own (``urn:torchverity:problem:<name>``).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

PROBLEM_MEDIA_TYPE = "application/problem+json"

_IANA = "https://iana.org/assignments/http-problem-types#"
DIGEST_UNSUPPORTED = _IANA + "digest-unsupported-algorithms"
DIGEST_INVALID = _IANA + "digest-invalid-values"
DIGEST_MISMATCH = _IANA + "digest-mismatching-values"

_OWN = "urn:torchverity:problem:"
DIGEST_REQUIRED = _OWN + "digest-required"
BODY_TOO_LARGE = _OWN + "body-too-large"
UNSUPPORTED_MEDIA_TYPE = _OWN + "unsupported-media-type"
INVALID_JSON = _OWN + "invalid-json"
INVALID_INPUT = _OWN + "invalid-input"
NOT_READY = _OWN + "not-ready"
NOT_FOUND = _OWN + "not-found"
METHOD_NOT_ALLOWED = _OWN + "method-not-allowed"
INTERNAL = _OWN + "internal-error"

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]


@dataclass(frozen=True)
class Problem:
    """One problem answer: status, type, title, detail and extension members."""

    status: int
    type: str
    title: str
    detail: str
    extensions: Mapping[str, Any] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            **self.extensions,
        }

    def body(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()


class ProblemError(Exception):
    """Raised inside the service to answer with ``problem``."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        super().__init__(f"{problem.status} {problem.title}: {problem.detail}")


async def send_problem(send: Send, problem: Problem) -> None:
    """Answer a problem directly on the ASGI channel (used before the app runs)."""
    body = problem.body()
    headers = [
        (b"content-type", PROBLEM_MEDIA_TYPE.encode()),
        (b"content-length", str(len(body)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in problem.headers.items()),
    ]
    await send({"type": "http.response.start", "status": problem.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def problem_schema() -> dict[str, Any]:
    """JSON schema of a problem document, for the OpenAPI description."""
    return {
        "type": "object",
        "required": ["type", "title", "status", "detail"],
        "properties": {
            "type": {"type": "string", "format": "uri"},
            "title": {"type": "string"},
            "status": {"type": "integer"},
            "detail": {"type": "string"},
        },
        "additionalProperties": True,
    }
