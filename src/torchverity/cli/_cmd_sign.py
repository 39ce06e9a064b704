"""``torchverity sign``: an OpenSSF model signature (``model_signing verify`` reads it)."""

from __future__ import annotations

import argparse
from typing import Any

from torchverity.cli._command import add_command
from torchverity.cli._output import Output
from torchverity.cli._signing_args import add_signing_args
from torchverity.errors import shell_path


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(
        subparsers, common, "sign", _run,
        help="sign a model folder or file (OpenSSF model signing)",
        description="Write an OpenSSF model signature (Sigstore bundle over every file's "
        "SHA-256) with an elliptic-curve key, optionally with its certificate chain. "
        "Digests recorded by torchverity manifest or save are reused while the files are "
        "unchanged since. Verify with: torchverity verify DIR --signature model.sig "
        "--public-key pub.pem (or model_signing verify key ...).",
    )
    p.add_argument("model", metavar="DIR|FILE")
    add_signing_args(p, key_required=True)
    p.add_argument("--signature", metavar="SIG",
                   help="where to write it (default: DIR/model.sig, or FILE.sig)")


def _run(args: argparse.Namespace, out: Output) -> int:
    from torchverity.provenance import sign_model

    report = sign_model(args.model, private_key=args.key, signature=args.signature,
                        certificate=args.certificate, chain=args.chain)

    def render() -> None:
        out.line(f"{report.signature}: signed {len(report.files)} files of {report.target} "
                 f"({report.mode} mode)")
        if report.reused:
            sources = sorted(set(report.reused.values()))
            out.info(f"reused {len(report.reused)} recorded digests ({', '.join(sources)}); "
                     f"hashed {len(report.hashed)} files")
        trust = "--certificate CA.pem" if report.mode == "certificate" else "--public-key PUB.pem"
        out.info(f"check it with: torchverity verify {shell_path(report.target)} "
                 f"--signature {report.signature} {trust}")

    return out.result({"ok": True, **report.__dict__}, render)
