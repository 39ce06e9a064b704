"""The ``--key``, ``--certificate`` and ``--chain`` options of commands that sign
(``sign`` always, ``attest`` when given a key)."""

from __future__ import annotations

import argparse


def add_signing_args(parser: argparse.ArgumentParser, *, key_required: bool) -> None:
    parser.add_argument("--key", required=key_required, metavar="KEY.pem",
                        help="EC private key (PEM) to sign with")
    parser.add_argument("--certificate", metavar="PEM",
                        help="signing certificate for KEY (certificate mode)")
    parser.add_argument("--chain", metavar="PEM", action="append", default=[],
                        help="intermediate/CA certificates to embed (repeatable)")
