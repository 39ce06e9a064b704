"""An httpx client that checks every answer of a torchverity model service.

Each request carries ``Content-Digest`` over the exact bytes sent and asks for
one back (``Want-Content-Digest``); each response's digest is checked over the
bytes received, and its ``TorchVerity-Fingerprint`` is compared with the
fingerprint the caller expects (or, when none is given, with the first one
seen, so a service that silently swaps its weights is noticed).

>>> with Client("http://127.0.0.1:8000", fingerprint="blake3:9f86...") as c:  # doctest: +SKIP
...     out = c.predict({"x": torch.ones(2, 4)})["output"]
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from torchverity.errors import IntegrityError, ServiceError, UsageError, require_extra
from torchverity.serve._digest_fields import HASHES
from torchverity.serve._digests import format_digest, verify_digest
from torchverity.serve._problem import ProblemError
from torchverity.serve._rechecks import FINGERPRINT_HEADER
from torchverity.serve._spec import decode_outputs, encode_inputs

if TYPE_CHECKING:
    import httpx


class Client:
    """A verified client for ``torchverity serve``.

    ``fingerprint`` (``"sha256:<hex>"`` or the bare hex) pins the weights the
    answers must come from. ``algorithm`` is used for request digests and asked
    for on responses. ``require_digest`` refuses responses without one.
    """

    def __init__(
        self,
        base_url: str,
        *,
        fingerprint: str | None = None,
        algorithm: str = "sha-256",
        require_digest: bool = True,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if algorithm not in HASHES:
            raise UsageError(f"Client: unsupported algorithm {algorithm!r}",
                             hint=f"use one of {sorted(HASHES)}")
        self.algorithm = algorithm
        self.require_digest = require_digest
        self.fingerprint = fingerprint
        self._httpx = require_extra("httpx", extra="serve", feature="torchverity.serve.Client")
        self._http: httpx.Client = self._httpx.Client(
            base_url=base_url, timeout=timeout, transport=transport,
            headers={"Want-Content-Digest": f"{algorithm}=10"})

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -------------------------------------------- endpoints

    def predict(
        self, inputs: Mapping[str, torch.Tensor] | torch.Tensor, *, request_id: str | None = None
    ) -> dict[str, torch.Tensor]:
        """Run the model; a single tensor is sent as the input named ``x``."""
        named = {"x": inputs} if isinstance(inputs, torch.Tensor) else dict(inputs)
        doc: dict[str, Any] = {"inputs": encode_inputs(named)}
        if request_id is not None:
            doc["id"] = request_id
        answer = self.request("POST", "/predict", json_body=doc).json()
        return decode_outputs(answer["outputs"])

    def metadata(self) -> dict[str, Any]:
        data: dict[str, Any] = self.request("GET", "/metadata").json()
        return data

    def ready(self) -> bool:
        """True when the service answers 200 on /ready, False on 503."""
        try:
            self.request("GET", "/ready")
        except ServiceError as exc:
            if exc.status == 503:
                return False
            raise
        return True

    def health(self) -> bool:
        self.request("GET", "/health")
        return True

    # -------------------------------------------- the verified exchange

    def request(
        self, method: str, path: str, *, json_body: Any = None
    ) -> httpx.Response:
        """Send (with a digest when there is a body) and return the verified response."""
        headers: dict[str, str] = {}
        content: bytes | None = None
        if json_body is not None:
            content = json.dumps(json_body, separators=(",", ":"), allow_nan=False).encode()
            headers = {"Content-Type": "application/json",
                       "Content-Digest": format_digest(self.algorithm, content)}
        url = str(self._http.base_url).rstrip("/") + path
        try:
            response = self._http.request(method, path, content=content, headers=headers)
        except self._httpx.HTTPError as exc:
            raise ServiceError(f"{method} {url}: cannot reach the service: {exc}", url=url,
                               hint="check that torchverity serve is running there") from None
        self._verify(response, url)
        if response.status_code >= 400:
            raise _service_error(response, method, url)
        return response

    def _verify(self, response: httpx.Response, url: str) -> None:
        field = response.headers.get("content-digest")
        if field is None:
            if self.require_digest:
                raise IntegrityError(f"{url}: the response carries no Content-Digest",
                                     hint="ask the service's operator; or require_digest=False")
        else:
            try:
                verify_digest(field, response.content)
            except ProblemError as exc:
                raise IntegrityError(
                    f"{url}: the response does not match its Content-Digest "
                    f"({exc.problem.title}): it was changed on the way", path=url,
                    hint="retry; if it persists, something between you and the service "
                         "alters responses",
                ) from None
        self._check_fingerprint(response.headers.get(FINGERPRINT_HEADER), url)

    def _check_fingerprint(self, served: str | None, url: str) -> None:
        if served is None:
            raise IntegrityError(f"{url}: the response carries no {FINGERPRINT_HEADER}",
                                 hint="is this a torchverity service?")
        if self.fingerprint is None:
            self.fingerprint = served  # pin the first one seen
            return
        if served != self.fingerprint and served.partition(":")[2] != self.fingerprint:
            raise IntegrityError(
                f"{url}: the service answers from other weights: fingerprint {served}, "
                f"expected {self.fingerprint}", path=url, expected=self.fingerprint,
                actual=served, hint="check which checkpoint the service was started with "
                                    "(GET /metadata)",
            )


def _service_error(response: httpx.Response, method: str, url: str) -> ServiceError:
    try:
        problem = response.json()
    except ValueError:
        problem = {}
    if not isinstance(problem, dict):
        problem = {}
    title = problem.get("title") or response.reason_phrase
    detail = problem.get("detail") or response.text[:200]
    return ServiceError(
        f"{method} {url}: {response.status_code} {title}: {detail}", url=url,
        status=response.status_code, problem_type=problem.get("type"),
        hint="GET /ready tells why the service is not ready" if response.status_code == 503
        else None,
    )
