"""RFC 9530 digest fields: parsing, formatting, and an ASGI middleware.

``Content-Digest`` carries a Structured-Field dictionary (RFC 8941) of
``algorithm=:base64:`` members computed over the message content as sent;
``Want-Content-Digest`` carries ``algorithm=weight`` members (0 to 10, 0 means
"not acceptable"). Only ``sha-256`` and ``sha-512`` are active algorithms.

:class:`ContentDigestMiddleware` is plain ASGI (no Starlette import), so it
mounts in any Starlette/FastAPI app::

    app.add_middleware(ContentDigestMiddleware, policy="require")

Requests: the body is hashed chunk by chunk as it arrives and held (never
beyond ``max_body`` bytes) until its digest is checked; the application sees
the body only after it passed. Digests are compared in constant time and the
computed value is never revealed. Failures answer 400 ``problem+json`` with
the digest-fields problem types: unsupported algorithm, invalid value, or
mismatching value. When a request carries several supported algorithms,
every one must match; unsupported ones are ignored as long as at least one
supported algorithm is present (RFC 9530 lets a recipient pick).

Responses carry ``Content-Digest`` computed over the body actually sent, in
the algorithm the client prefers in ``Want-Content-Digest`` (or the default).

``deferred=True`` (opt-in, used by the model service) overlaps the check with
the application's own work: a large body (``DEFER_MIN_BYTES`` and up) is
handed to the application at once, and hashed on the event loop as soon as
the application first waits (hashlib releases the GIL, so the hash runs
beside the application's worker threads); ``scope[DEFERRED_DIGEST]`` holds
the pending check (:class:`DeferredDigest`). The application may parse the body meanwhile but
must call ``check()`` (from a thread) or ``await verified()`` before anything
with an effect; a mismatch raises the same 400 problem. Whatever the
application does, its response is held until the check is done and replaced
by the 400 problem when the digest does not match, and an exception it
raises on such a body is answered with that 400 too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future
from typing import Any, Literal

from torchverity.errors import UsageError
from torchverity.serve._digests import (
    HASHES,
    WANT_VALUE,
    check_digests,
    choose_algorithm,
    format_digest,
    new_hashers,
    parse_digest_field,
)
from torchverity.serve._problem import (
    BODY_TOO_LARGE,
    DIGEST_REQUIRED,
    Message,
    Problem,
    ProblemError,
    Send,
    send_problem,
)

Policy = Literal["require", "verify-if-present", "ignore"]


POLICIES: tuple[str, ...] = ("require", "verify-if-present", "ignore")




DEFAULT_MAX_BODY = 8 * 1024 * 1024


# Large enough for any prediction; a bigger streamed response is passed on
# without a digest rather than held in memory.
MAX_DIGESTED_RESPONSE = 64 * 1024 * 1024


# Deferred mode hashes smaller bodies inline: below this size a thread hand-off
# costs more than it hides (and hashlib keeps the GIL under 2 KiB anyway).
DEFER_MIN_BYTES = 64 * 1024


# The scope key under which deferred mode leaves the pending check.
DEFERRED_DIGEST = "torchverity.deferred_digest"


Receive = Callable[[], Awaitable[Message]]


ASGIApp = Callable[[Message, Receive, Send], Awaitable[None]]


class DeferredDigest:
    """The pending check of a request body the application already received (deferred mode).

    ``check()`` blocks until the worker thread has hashed the body and raises
    the 400 :class:`ProblemError` when it does not match; ``await verified()``
    does the same without blocking the event loop. Both may be called any
    number of times.
    """

    def __init__(self, outcome: Future[Problem | None]) -> None:
        self._outcome = outcome

    def check(self) -> None:
        _raise_if(self._outcome.result())

    async def verified(self) -> None:
        _raise_if(await self.problem())

    async def problem(self) -> Problem | None:
        """The 400 problem when the body does not match, else None (waits for the hash)."""
        return await asyncio.wrap_future(self._outcome)


def _raise_if(problem: Problem | None) -> None:
    if problem is not None:
        raise ProblemError(problem)


def _hash_into(outcome: Future[Problem | None], body: bytes,
               expected: Mapping[str, bytes]) -> None:
    """Deferred mode's check: one update per algorithm over the whole body, so the GIL is
    released for all of it."""
    hashers = new_hashers(expected)
    for hasher in hashers.values():
        hasher.update(body)
    try:
        check_digests("content-digest", expected, hashers)
    except ProblemError as exc:
        outcome.set_result(exc.problem)
        return
    outcome.set_result(None)


class ContentDigestMiddleware:
    """Verify request ``Content-Digest`` and add one to every response.

    ``policy``: ``require`` (a request with a body must carry a digest),
    ``verify-if-present`` (default) or ``ignore`` (request digests are not
    read). ``max_body`` bounds what is held: larger bodies get 413.
    ``response_algorithm`` is used when the client states no preference
    (``None``: add a digest only when asked with ``Want-Content-Digest``).
    ``deferred``: hand large bodies to the application while their digest is
    computed on a worker thread (see the module documentation); the default
    keeps the application from seeing any body before it matched.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        policy: Policy = "verify-if-present",
        max_body: int = DEFAULT_MAX_BODY,
        response_algorithm: str | None = "sha-256",
        deferred: bool = False,
    ) -> None:
        if policy not in POLICIES:
            raise UsageError(f"ContentDigestMiddleware: unknown digest policy {policy!r}",
                             hint=f"use one of {POLICIES}")
        if response_algorithm is not None and response_algorithm not in HASHES:
            raise UsageError(
                f"ContentDigestMiddleware: unsupported response algorithm {response_algorithm!r}",
                hint=f"use one of {sorted(HASHES)} or None")
        self.app = app
        self.policy = policy
        self.max_body = max_body
        self.response_algorithm = response_algorithm
        self.deferred = deferred

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        algorithm = choose_algorithm(headers.get("want-content-digest"), self.response_algorithm)
        if scope.get("method") != "HEAD" and algorithm is not None:
            send = _DigestingSend(send, algorithm).send
        try:
            checked = await self._checked_body(headers, receive)
        except ProblemError as exc:
            await send_problem(send, exc.problem)
            return
        if checked is None:  # the client went away before sending everything
            return
        chunks, pending = checked
        if pending is None:
            await self.app(scope, _replay(chunks, receive), send)
            return
        gate = _GatedSend(send, pending)
        try:
            await self.app({**scope, DEFERRED_DIGEST: pending}, _replay(chunks, receive),
                           gate.send)
        except Exception:
            # The failed check escaped the application (a plain Starlette app has
            # no handler for it), or the application choked on a body that did
            # not match: either way the answer is the 400, as in strict mode.
            problem = await pending.problem()
            if problem is None:
                raise
            await gate.refuse(problem)

    async def _checked_body(
        self, headers: Mapping[str, str], receive: Receive
    ) -> tuple[list[bytes], DeferredDigest | None] | None:
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise _too_large(self.max_body)
        field = headers.get("content-digest") if self.policy != "ignore" else None
        expected = parse_digest_field(field) if field is not None else {}
        hashers = new_hashers(expected)
        defer = self.deferred and bool(expected)
        chunks = await _read_body(receive, {} if defer else hashers, self.max_body)
        if chunks is None:
            return None
        if defer:
            body = b"".join(chunks)
            if len(body) >= DEFER_MIN_BYTES:
                return [body], _start_check(body, expected)
            for hasher in hashers.values():
                hasher.update(body)
        if expected:
            check_digests("content-digest", expected, hashers)
        elif self.policy == "require" and any(chunks):
            raise ProblemError(
                Problem(
                    400, DIGEST_REQUIRED, "Content-Digest Required",
                    "this service requires a Content-Digest field (sha-256 or sha-512) "
                    "on every request with content",
                    headers={"Want-Content-Digest": WANT_VALUE},
                )
            )
        return chunks, None


def _start_check(body: bytes, expected: Mapping[str, bytes]) -> DeferredDigest:
    """Schedule the hash on the event loop, to run when the application first waits
    (the model service waits for its parsing thread): hashlib releases the GIL, so
    hashing and parsing run at once on two cores, with no thread hand-off of its own."""
    outcome: Future[Problem | None] = Future()
    asyncio.get_running_loop().call_soon(_hash_into, outcome, body, expected)
    return DeferredDigest(outcome)


def _headers(scope: Message) -> dict[str, str]:
    """Request headers by lowercase name; repeated fields are joined with ', ' (RFC 9110)."""
    out: dict[str, str] = {}
    for raw_name, raw_value in scope.get("headers", []):
        name = raw_name.decode("latin-1").lower()
        value = raw_value.decode("latin-1")
        out[name] = f"{out[name]}, {value}" if name in out else value
    return out


def _too_large(limit: int) -> ProblemError:
    return ProblemError(
        Problem(
            413, BODY_TOO_LARGE, "Content Too Large",
            f"the request body is larger than this service accepts ({limit} bytes)",
            {"max-body-bytes": limit},
        )
    )


async def _read_body(
    receive: Receive, hashers: Mapping[str, Any], limit: int
) -> list[bytes] | None:
    """Collect the body, hashing each chunk as it arrives; stop at ``limit`` with 413."""
    chunks: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        total += len(chunk)
        if total > limit:
            raise _too_large(limit)
        for hasher in hashers.values():
            hasher.update(chunk)
        if chunk:
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks


def _replay(chunks: list[bytes], receive: Receive) -> Receive:
    """Hand the checked chunks to the app, then defer to the server (for disconnects)."""
    pending = iter(chunks or [b""])
    last = len(chunks) - 1
    sent = 0

    async def replay() -> Message:
        nonlocal sent
        chunk = next(pending, None)
        if chunk is None:
            return await receive()
        sent += 1
        return {"type": "http.request", "body": chunk, "more_body": sent <= last}

    return replay


class _GatedSend:
    """Deferred mode: the application's response waits for the digest check; on a mismatch
    the 400 problem goes out instead and the application's messages are dropped."""

    def __init__(self, send: Send, pending: DeferredDigest) -> None:
        self._send = send
        self._pending = pending
        self._started = False
        self._refused = False

    async def send(self, message: Message) -> None:
        if self._refused:
            return
        if message["type"] == "http.response.start":
            try:
                await self._pending.verified()
            except ProblemError as exc:
                await self.refuse(exc.problem)
                return
            self._started = True
        await self._send(message)

    async def refuse(self, problem: Problem) -> None:
        """Answer ``problem`` unless an answer already went out."""
        if not (self._started or self._refused):
            self._refused = True
            await send_problem(self._send, problem)


class _DigestingSend:
    """Holds the response start until the body is complete, then adds ``Content-Digest``."""

    def __init__(self, send: Send, algorithm: str) -> None:
        self._send = send
        self._algorithm = algorithm
        self._start: Message | None = None
        self._chunks: list[bytes] = []
        self._held = 0
        self._passthrough = False

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if any(k.lower() == b"content-digest" for k, _ in message.get("headers", [])):
                self._passthrough = True  # the app computed its own
                await self._send(message)
            else:
                self._start = message
            return
        if kind != "http.response.body" or self._passthrough or self._start is None:
            await self._send(message)
            return
        chunk = message.get("body", b"")
        self._chunks.append(chunk)
        self._held += len(chunk)
        if message.get("more_body", False):
            if self._held > MAX_DIGESTED_RESPONSE:
                await self._flush(with_digest=False, more_body=True)
            return
        await self._flush(with_digest=True, more_body=False)

    async def _flush(self, *, with_digest: bool, more_body: bool) -> None:
        start = self._start
        assert start is not None
        if with_digest:
            value = format_digest(self._algorithm, self._chunks)
            start = {**start, "headers": [*start.get("headers", []),
                                          (b"content-digest", value.encode())]}
        await self._send(start)
        await self._send({"type": "http.response.body", "body": b"".join(self._chunks),
                          "more_body": more_body})
        self._start, self._chunks, self._passthrough = None, [], True
