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

from typing import TYPE_CHECKING

from torchverity._lazy import attach

# Every submodule imports on a base install; the serve extra is required
# (MissingExtraError) when create_app or Client is used.
if TYPE_CHECKING:
    from torchverity.serve._app import build_model, create_app
    from torchverity.serve._client import Client
    from torchverity.serve._digest_fields import (
        DEFERRED_DIGEST,
        ContentDigestMiddleware,
        DeferredDigest,
    )
    from torchverity.serve._digests import (
        choose_algorithm,
        format_digest,
        parse_digest_field,
        verify_digest,
    )
    from torchverity.serve._problem import Problem, ProblemError
    from torchverity.serve._rechecks import FINGERPRINT_HEADER
    from torchverity.serve._spec import TensorSpec, parse_spec
    from torchverity.serve._timeouts import timed_protocol

__all__ = [
    "DEFERRED_DIGEST",
    "FINGERPRINT_HEADER",
    "Client",
    "ContentDigestMiddleware",
    "DeferredDigest",
    "Problem",
    "ProblemError",
    "TensorSpec",
    "build_model",
    "choose_algorithm",
    "create_app",
    "format_digest",
    "parse_digest_field",
    "parse_spec",
    "timed_protocol",
    "verify_digest",
]
__getattr__, __dir__ = attach(__name__, __file__)
