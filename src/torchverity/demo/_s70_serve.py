"""Demo step: a model service that refuses corrupted weights and tampered requests."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import torch

from torchverity.demo import DemoContext

TITLE = "Serving: verified weights and config, RFC 9530 request digests, golden readiness"
NEEDS = ("serve",)


class DemoNet(torch.nn.Module):
    """The served model; ``input_spec`` is what /predict accepts."""

    input_spec = ("x:float32:-1,8",)

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                        torch.nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def run(ctx: DemoContext) -> None:
    import torchverity

    folder = ctx.workdir / "serve"
    folder.mkdir()
    torch.manual_seed(0)
    model = DemoNet()
    weights, golden = folder / "model.pt", folder / "golden.json"
    saved = torchverity.save(model.state_dict(), weights)
    torchverity.golden.record(model, torch.linspace(-1, 1, 16).reshape(2, 8), golden)
    spec = f"{__name__}:DemoNet"

    bad = folder / "bad" / "model.pt"
    bad.parent.mkdir()
    for suffix in ("", f".{saved.algo}", ".meta.json"):
        bad.with_name(bad.name + suffix).write_bytes(weights.with_name(weights.name + suffix)
                                                     .read_bytes())
    ctx.say("a copy of the weights gets one flipped bit; the service refuses to start on it:")
    ctx.cli("inject", "bitflip", str(bad), "--offset", str(bad.stat().st_size // 2), "--bit", "4")
    ctx.cli("serve", "--model", spec, "--weights", str(bad), expect=1)
    _edited_config(ctx, spec, model)
    ctx.say("the good weights pass every start-up check:")
    ctx.cli("serve", "--model", spec, "--weights", str(weights), "--golden", str(golden), "--check")
    _serve_and_probe(ctx, spec, weights, golden)


def _edited_config(ctx: DemoContext, spec: str, model: DemoNet) -> None:
    """A model folder's config.json edited after its manifest: a different model."""
    import torchverity

    folder = ctx.workdir / "serve" / "folder"
    folder.mkdir()
    torchverity.save(model.state_dict(), folder / "model.safetensors")
    (folder / "config.json").write_text('{"in_features": 8, "hidden": 16, "act": "relu"}\n')
    ctx.say("a model folder recorded in its manifest, then its config.json edited:")
    ctx.cli("manifest", str(folder))
    (folder / "config.json").write_text('{"in_features": 8, "hidden": 16, "act": "gelu"}\n')
    _, _, err = ctx.cli("serve", "--model", spec, "--weights", str(folder), "--check", expect=1)
    ctx.expect("config.json: listed in" in err, "the service names the edited config.json")


def _serve_and_probe(ctx: DemoContext, spec: str, weights: Any, golden: Any) -> None:
    import httpx
    import uvicorn

    from torchverity.serve._app import create_app
    from torchverity.serve._client import Client
    from torchverity.serve._digests import format_digest

    app = create_app(spec, weights, golden=golden)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        ctx.say(f"serving on {url}; a verified client request (Content-Digest both ways):")
        with Client(url) as client:
            out = client.predict(torch.ones(1, 8))["output"]
            ctx.say(f"  POST /predict -> {[round(v, 4) for v in out.flatten().tolist()]} "
                    f"from weights {(client.fingerprint or '')[:23]}...")
        body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 8],
                                       "data": [1.0] * 8}]}).encode()
        tampered = body.replace(b"1.0]", b"9.0]")
        ctx.say("the same request altered on the way (its Content-Digest is for the original):")
        r = httpx.post(url + "/predict", content=tampered,
                       headers={"Content-Type": "application/json",
                                "Content-Digest": format_digest("sha-256", body)})
        ctx.say(f"  {r.status_code} {r.headers['content-type']}: {r.json()['type']}")
        ctx.expect(r.status_code == 400 and r.json()["type"].endswith("digest-mismatching-values"),
                   "the tampered request was refused with the RFC 9530 mismatch problem type")
    finally:
        server.should_exit = True
        thread.join(timeout=10)
