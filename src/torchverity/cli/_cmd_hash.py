"""``torchverity hash``: sha256sum-compatible digests, optionally written as sidecars."""

from __future__ import annotations

import argparse
from typing import Any

from torchverity.cli._command import add_command
from torchverity.cli._output import Output
from torchverity.digest import ALGORITHMS, DEFAULT_ALGO


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(
        subparsers, common, "hash", _run,
        help="print file digests like b3sum or sha256sum; --write sidecars",
        description="Print '<hex>  <path>' lines exactly like b3sum (sha256sum with --algo "
        "sha256). "
        "--write also writes the sidecar FILE.blake3 (FILE.sha256, FILE.xxh128 with --algo), "
        "which torchverity verify and load check (b3sum -c accepts FILE.blake3, sha256sum -c "
        "FILE.sha256).",
    )
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--algo", choices=ALGORITHMS, default=DEFAULT_ALGO)
    p.add_argument("--write", action="store_true", help="write a sidecar next to each file")


def _run(args: argparse.Namespace, out: Output) -> int:
    from torchverity.digest import digest_file, write_sidecar

    results = []
    for path in args.files:
        with out.progress(None, f"hashing {path}") as advance:
            d = digest_file(path, args.algo, progress=advance)
        sidecar = write_sidecar(path, d) if args.write else None
        results.append(
            {
                "path": path,
                "algorithm": d.algo,
                "digest": d.hexdigest,
                "size": d.size,
                **({"sidecar": str(sidecar)} if sidecar else {}),
            }
        )
        out.line(f"{d.hexdigest}  {path}")  # as each file is done, like sha256sum
        if sidecar:
            out.info(f"wrote {sidecar}")
    return out.result({"ok": True, "files": results})
