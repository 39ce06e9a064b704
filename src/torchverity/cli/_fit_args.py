"""The ``--no-strict``, ``--strip-prefix`` and ``--key-map`` options of commands that load
``--weights`` into a model."""

from __future__ import annotations

import argparse
from typing import Any


def add_fit_args(parser: argparse.ArgumentParser, *, strict: bool = True) -> None:
    if strict:
        parser.add_argument("--no-strict", dest="strict", action="store_false",
                            help="load the keys that fit; report missing and unexpected keys")
    parser.add_argument("--strip-prefix", action="append", default=[], metavar="PREFIX",
                        help="strip this prefix from the checkpoint's keys, once (module., "
                        "_orig_mod., model., or a stack: module._orig_mod.); repeat for more")
    parser.add_argument("--key-map", action="append", default=[], metavar="OLD=NEW",
                        help="rename checkpoint keys starting with OLD to start with NEW; "
                        "repeat for more")


def fit_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``strict``/``strip_prefix``/``key_map`` keyword arguments for load and create_app."""
    from torchverity.checkpoint._key_map import parse_key_map

    return {"strict": getattr(args, "strict", True), "strip_prefix": args.strip_prefix,
            "key_map": parse_key_map(args.key_map)}
