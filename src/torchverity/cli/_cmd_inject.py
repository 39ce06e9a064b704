"""``torchverity inject``: fault drills (bit flips, truncation) on files."""

from __future__ import annotations

import argparse
from typing import Any

from torchverity.cli._output import Output


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "inject",
        help="fault drills: flip a bit or truncate a file",
        description="Damage a file on purpose to rehearse detection. Use -o to damage a copy.",
    )
    kinds = p.add_subparsers(dest="kind", metavar="KIND", required=True)
    flip = kinds.add_parser("bitflip", parents=[common], help="flip one bit")
    flip.add_argument("file", metavar="FILE")
    flip.add_argument("--offset", type=int, help="byte offset (negative counts from the end)")
    flip.add_argument("--bit", type=int, help="bit 0 (least significant) to 7")
    flip.add_argument("--random", action="store_true", help="draw offset and bit from --seed")
    flip.add_argument("--seed", type=int, default=None)
    flip.add_argument("-o", "--output", help="write the damaged file here, keep FILE intact")
    flip.set_defaults(func=_bitflip)
    cut = kinds.add_parser("truncate", parents=[common], help="remove bytes from the end")
    cut.add_argument("file", metavar="FILE")
    cut.add_argument("--bytes", type=int, required=True, dest="nbytes")
    cut.add_argument("-o", "--output", help="write the damaged file here, keep FILE intact")
    cut.set_defaults(func=_truncate)


def _bitflip(args: argparse.Namespace, out: Output) -> int:
    import os

    from torchverity.errors import UsageError
    from torchverity.inject import flip_bit

    if not args.random and (args.offset is None or args.bit is None):
        raise UsageError(
            "give --offset and --bit, or --random [--seed S]",
            hint="torchverity inject bitflip FILE --offset 0 --bit 0",
        )
    offset = args.offset
    if offset is not None and offset < 0 and os.path.isfile(args.file):
        offset += os.path.getsize(args.file)
    flip = flip_bit(args.file, offset, args.bit, seed=args.seed, output=args.output)
    return out.result({"ok": True, "bitflip": flip}, lambda: out.line(
        f"flipped bit {flip.bit} of byte {flip.offset} in {flip.path}: "
        f"0x{flip.before:02x} -> 0x{flip.after:02x}"))


def _truncate(args: argparse.Namespace, out: Output) -> int:
    from torchverity.inject import truncate

    cut = truncate(args.file, args.nbytes, output=args.output)
    return out.result({"ok": True, "truncation": cut}, lambda: out.line(
        f"truncated {cut.path}: removed {cut.removed} bytes ({cut.old_size} -> {cut.new_size})"))
