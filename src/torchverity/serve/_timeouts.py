"""Read timeouts for the HTTP server: a client that stalls while sending its request line
and headers, or its body, is answered 408 (problem+json) and disconnected, instead of
holding a connection and a worker slot for ever (uvicorn itself only times out idle
keep-alive connections).

:class:`TimedH11Protocol` is uvicorn's h11 protocol with two timers: one from the
connection's start (or the end of the previous response) until the request's headers are
complete, one that restarts with every piece of body until the body is complete. A
request that is not valid HTTP/1.1 is answered 400 as problem+json too, not plain text.
"""

from __future__ import annotations

import asyncio
from typing import Any

from torchverity.serve._problem import _OWN, PROBLEM_MEDIA_TYPE, Problem

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
REQUEST_TIMEOUT = _OWN + "request-timeout"
BAD_REQUEST = _OWN + "malformed-request"


def timed_protocol(header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
                   body_timeout: float = DEFAULT_BODY_TIMEOUT_S) -> type:
    """uvicorn's ``http=`` protocol class with these read timeouts (seconds)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _before: Any = None  # the cycle current when the header timer was armed

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_headers()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            cycle = self.cycle
            if cycle is None or cycle is self._before:
                return  # the headers are not complete: their timer keeps running
            if cycle.more_body and not cycle.response_started:
                self._arm(body_timeout, "its request body")  # restarts with every piece
            else:
                self._cancel()

        def send_400_response(self, msg: str) -> None:
            """A request h11 cannot parse: answered as problem+json like every other error."""
            self._cancel()
            body = Problem(400, BAD_REQUEST, "Malformed HTTP request", msg).body()
            head = (f"HTTP/1.1 400 Bad Request\r\ncontent-type: {PROBLEM_MEDIA_TYPE}\r\n"
                    f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
            self.transport.write(head.encode("ascii") + body)
            self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel()
            super().connection_lost(exc)

        def _arm_headers(self) -> None:
            self._before = self.cycle
            self._arm(header_timeout, "its request line and headers")

        def _arm(self, seconds: float, what: str) -> None:
            self._cancel()
            self._timer = self.loop.call_later(seconds, self._timed_out, seconds, what)

        def _cancel(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _timed_out(self, seconds: float, what: str) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            started = self.cycle is not None and self.cycle.response_started
            if not started:
                self.transport.write(_timeout_response(seconds, what))
            self.transport.close()

    return TimedH11Protocol


def _timeout_response(seconds: float, what: str) -> bytes:
    body = Problem(408, REQUEST_TIMEOUT, "Request timeout",
                   f"the client did not send {what} within {seconds:g} s").body()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: {PROBLEM_MEDIA_TYPE}\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body
