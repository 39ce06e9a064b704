"""Serve a PyTorch model so that every answer is traceable to verified weights.

``torchverity serve --model module:callable --weights CKPT [--golden FILE]``
verifies the weights (sidecar or manifest digest, content fingerprint), loads
them with ``weights_only=True``, runs the golden check, and only then serves:

* ``POST /predict``: JSON tensors (Open Inference Protocol v2 form), checked
  against the model's declared input spec;
* ``GET /health`` (liveness), ``GET /ready`` (200 only while the weights hold
  their verified fingerprint and the last golden check passed), ``GET
  /metadata`` (OIP v2 model metadata plus provenance);
* request and response integrity with RFC 9530 ``Content-Digest``
  (:class:`ContentDigestMiddleware`, reusable in any ASGI app), errors as
  ``application/problem+json``, the model fingerprint on every response, and
  background re-checks that turn readiness off when memory goes bad.

:class:`Client` is the matching httpx client. FastAPI, uvicorn and httpx are
the ``serve`` extra; importing this package works without them, and using it
raises ``MissingExtraError`` naming the extra.

>>> from torchverity.serve import create_app                 # doctest: +SKIP
>>> app = create_app("mypkg.models:build", "model.pt")        # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

from torchverity.errors import require_extra

# Public name -> (submodule, the serve-extra package it needs first, or None).
_PUBLIC: dict[str, tuple[str, str | None]] = {
    "create_app": ("_app", "fastapi"),
    "build_model": ("_app", "fastapi"),
    "FINGERPRINT_HEADER": ("_app", "fastapi"),
    "Client": ("_client", "httpx"),
    "ContentDigestMiddleware": ("_digest_fields", None),
    "parse_digest_field": ("_digest_fields", None),
    "verify_digest": ("_digest_fields", None),
    "format_digest": ("_digest_fields", None),
    "choose_algorithm": ("_digest_fields", None),
    "Problem": ("_problem", None),
    "ProblemError": ("_problem", None),
    "TensorSpec": ("_spec", None),
    "parse_spec": ("_spec", None),
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    entry = _PUBLIC.get(name)
    if entry is None:
        raise AttributeError(f"module 'torchverity.serve' has no attribute '{name}'")
    module, needs = entry
    if needs is not None:
        require_extra(needs, extra="serve", feature=f"torchverity.serve.{name}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
