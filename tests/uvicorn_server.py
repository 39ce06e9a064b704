"""A real uvicorn server for an ASGI app on a free 127.0.0.1 port, in a thread."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import uvicorn


@dataclass
class Service:
    url: str
    port: int
    app: Any
    model: Any
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def state(self) -> Any:
        return self.app.state.torchverity

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def start(app: Any, **config: Any) -> Service:
    """Serve ``app`` (the socket is bound first: no race for the port); ``config`` goes to
    ``uvicorn.Config``."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    options: dict[str, Any] = {"log_level": "error", "lifespan": "on", **config}
    server = uvicorn.Server(uvicorn.Config(app, **options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = int(sock.getsockname()[1])
    state = getattr(app.state, "torchverity", None)
    return Service(f"http://127.0.0.1:{port}", port, app, state.model if state else None,
                   server, thread)
