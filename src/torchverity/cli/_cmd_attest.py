"""``torchverity attest``: an in-toto statement for a checkpoint, optionally signed."""

from __future__ import annotations

import argparse
from typing import Any

from torchverity.cli._command import add_command
from torchverity.cli._output import Output
from torchverity.cli._signing_args import add_signing_args
from torchverity.errors import shell_path


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(
        subparsers, common, "attest", _run,
        help="write an in-toto attestation for a checkpoint (optionally signed)",
        description="Write an in-toto Statement v1 whose subjects are the checkpoint's files "
        "(SHA-256) and whose predicate records its content fingerprint, seed, data-order "
        "record and environment (from meta.json), the TrainingGuard log's steps and anomalies "
        "and an optional training record. With --key "
        "it is signed into a Sigstore bundle like a model signature. Check it with: "
        "torchverity verify CKPT --attestation FILE [--public-key PUB.pem].",
    )
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint file or folder")
    p.add_argument("--out", metavar="FILE",
                   help="where to write it (default: CKPT.intoto.json, or "
                   "DIR/attestation.intoto.json)")
    add_signing_args(p, key_required=False)
    p.add_argument("--guard-log", metavar="EVENTS.jsonl",
                   help="TrainingGuard event log of the run: its steps and anomalies are recorded")
    p.add_argument("--training", metavar="JSON",
                   help="other training record to include verbatim")


def _run(args: argparse.Namespace, out: Output) -> int:
    from torchverity.provenance import write_attestation

    path, statement = write_attestation(args.checkpoint, out=args.out, private_key=args.key,
                                        certificate=args.certificate, chain=args.chain,
                                        training=args.training, guard_log=args.guard_log)

    def render() -> None:
        out.line(f"{path}: {'signed ' if args.key else ''}attestation over "
                 f"{len(statement['subject'])} files of {args.checkpoint}")
        for name, rec in statement["predicate"].get("checkpoint", {}).items():
            out.line(f"  {name}: fingerprint {rec['fingerprint']['root']}")
        out.info(f"check it with: torchverity verify {shell_path(args.checkpoint)} "
                 f"--attestation {shell_path(path)}"
                 + (" --public-key PUB.pem" if args.key else ""))

    return out.result({"ok": True, "attestation": str(path), "signed": bool(args.key),
                       "statement": statement}, render)

