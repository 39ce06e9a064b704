"""``torchverity serve``: a verified model service (FastAPI under uvicorn, extra ``serve``)."""

from __future__ import annotations

import argparse
import re
from typing import Any, Literal, get_args

from torchverity.cli._command import add_command
from torchverity.cli._fit_args import add_fit_args, fit_kwargs
from torchverity.cli._output import Output
from torchverity.errors import InputError, require_extra
from torchverity.serve._digest_fields import Policy

# uvicorn's log levels (the server is started here, nowhere else).
LogLevel = Literal["critical", "error", "warning", "info", "debug"]
_UNITS = {"": 1, "b": 1, "kb": 1000, "kib": 1024, "mb": 1000**2, "mib": 1024**2,
          "gb": 1000**3, "gib": 1024**3}


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(
        subparsers, common, "serve", _run,
        help="serve a model from verified weights (extra: serve)",
        description="Verify the weights (sidecar or manifest digest, content fingerprint), load "
        "them with weights_only=True, run the golden check, then serve /predict, /health, "
        "/ready and /metadata with RFC 9530 Content-Digest checks. Refuses to start (exit 1) "
        "when any check fails.",
    )
    p.add_argument("--model", required=True, metavar="MODULE:CALLABLE",
                   help="builds the model, as uvicorn names apps (mypkg.models:build)")
    p.add_argument("--weights", required=True, metavar="CKPT",
                   help="checkpoint (file, Hugging Face folder or index) with a sidecar "
                   "(CKPT.blake3) or listed in its folder's manifest")
    add_fit_args(p)
    p.add_argument("--golden", metavar="FILE", help="golden record checked before serving and "
                   "at every re-check (torchverity golden record)")
    p.add_argument("--input-spec", action="append", metavar="NAME:DTYPE:DIMS",
                   help="an input, e.g. x:float32:-1,4 (-1 = any size); repeat for more; "
                   "default: the model's input_spec attribute")
    p.add_argument("--name", help="model name in /metadata (default: the model's class name)")
    p.add_argument("--device", help="move the model there after verifying (cpu, cuda, cuda:1...)")
    p.add_argument("--signature", metavar="SIG", help="OpenSSF model signature the weights "
                   "must verify against (with --public-key or --certificate)")
    p.add_argument("--public-key", metavar="PEM")
    p.add_argument("--certificate", metavar="PEM", action="append", default=[],
                   help="trusted CA certificate(s) (repeatable)")
    p.add_argument("--attestation", metavar="FILE",
                   help="in-toto attestation of the weights, checked and shown in /metadata")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--digest-policy", choices=get_args(Policy),
                   default="verify-if-present",
                   help="request Content-Digest: require it, check it when present, or ignore it")
    p.add_argument("--max-body", type=_size, default="8MiB", metavar="SIZE",
                   help="largest request body (413 above it), e.g. 8MiB")
    p.add_argument("--recheck-interval", type=float, default=30.0, metavar="SECONDS",
                   help="re-fingerprint the weights and rerun the golden check this often "
                   "(0 = never)")
    p.add_argument("--check", action="store_true",
                   help="run the start-up checks, print the report and exit without serving")
    p.add_argument("--log-level", default="info",
                   choices=get_args(LogLevel))


def _size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not match or match[2].lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size (e.g. 8MiB, 512KiB, 1000000)")
    return int(match[1]) * _UNITS[match[2].lower()]


def _run(args: argparse.Namespace, out: Output) -> int:
    require_extra("fastapi", extra="serve", feature="torchverity serve")
    uvicorn = require_extra("uvicorn", extra="serve", feature="torchverity serve")
    from torchverity.serve._app import create_app

    app = create_app(
        args.model, args.weights, golden=args.golden, input_spec=args.input_spec,
        name=args.name, digest_policy=args.digest_policy, max_body=args.max_body,
        recheck_interval=args.recheck_interval or None, device=args.device,
        **fit_kwargs(args),
        provenance={"signature": args.signature, "public_key": args.public_key,
                    "certificate_chain": args.certificate, "attestation": args.attestation},
    )
    state = app.state.torchverity
    if args.check:
        report = _report(state, None)
        out.result(report, lambda: _print_report(report, out))
        return 0
    # Bound before the report is written: a port in use fails here, and --port 0 is
    # reported as the port the system picked.
    sock = _listen(args.host, args.port)
    port = int(sock.getsockname()[1])
    host = f"[{args.host}]" if ":" in args.host else args.host
    report = _report(state, f"http://{host}:{port}")
    out.result(report, lambda: _print_report(report, out))
    out.out.flush()
    from torchverity.serve import timed_protocol

    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=port,
                                           log_level=args.log_level, http=timed_protocol(),
                                           log_config=_log_config()))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        out.info("torchverity serve: stopped")
    return 0


def _listen(host: str, port: int) -> Any:
    """A socket bound to ``host:port`` for uvicorn to serve on."""
    import socket

    try:
        family, kind, proto, _name, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise InputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                         hint="is the port in use? pick another with --port (--port 0 takes a "
                              "free one)") from None
    return sock


def _log_config() -> dict[str, Any]:
    """uvicorn's logging with its access log on stderr: stdout carries the report alone (one
    JSON document with --json)."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    return config


def _report(state: Any, url: str | None) -> dict[str, Any]:
    status = state.readiness()
    return {
        "ok": True,
        "model": state.name,
        "weights": state.weights.to_dict() if state.weights else None,
        "fingerprint": state.fingerprint_header,
        "golden": status.golden,
        "inputs": [s.to_dict() for s in state.spec],
        "url": url,
        "warnings": [*_warnings(state.weights), *_spec_warnings(state)],
    }


def _spec_warnings(state: Any) -> list[str]:
    """A declared input spec the model refuses: every request of that shape would fail."""
    from torchverity.serve._spec import probe

    refused = probe(state.model, state.spec)
    if refused is None:
        return []
    shapes = ", ".join(f"{s.name}:{s.datatype}{list(s.shape)}" for s in state.spec)
    return [f"{state.name} raised {refused} on zeros of the declared inputs ({shapes}, -1 "
            "taken as 1): requests of that shape will fail; check --input-spec (or the "
            "model's input_spec attribute)"]


def _warnings(weights: Any) -> list[str]:
    """What the start-up could not verify or left out, for people (stderr) and --json alike."""
    if weights is None:
        return []
    found = [f"{weights.path}: --no-strict: {len(keys)} {kind} key(s) not loaded: "
             f"{', '.join(keys[:10])}"
             for kind, keys in (("missing", weights.missing_keys),
                                ("unexpected", weights.unexpected_keys)) if keys]
    found += weights.notes()
    if weights.file_fingerprint is None:
        found.append(f"{weights.path}: no meta.json, so the content fingerprint was not checked "
                     "against a record (the file digest was)")
    return found


def _print_report(report: dict[str, Any], out: Output) -> None:
    weights = report["weights"]
    out.line(f"weights:     {weights['path']}  {weights['algorithm']} {weights['digest']} "
             f"(verified by {weights['verified_by']})")
    out.line(f"fingerprint: {report['fingerprint']}")
    out.line(f"golden:      {report['golden']}")
    spec = ", ".join(f"{i['name']}:{i['datatype']}{i['shape']}" for i in report["inputs"])
    out.line(f"inputs:      {spec}")
    files = weights.get("model_files")
    if files:
        out.line(f"model files: {len(files['verified'])} verified against {files['against']} "
                 f"{files['record']}")
    if report["url"]:
        out.line(f"starting on  {report['url']}  (/predict /health /ready /metadata)")
    for note in report["warnings"]:
        out.warn(note)
