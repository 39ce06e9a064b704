"""``torchverity manifest``: record every file of a folder with a root digest."""

from __future__ import annotations

import argparse
from typing import Any, get_args

from torchverity.cli._command import add_command
from torchverity.cli._output import Output
from torchverity.digest import ALGORITHMS
from torchverity.manifest import ManifestFormat


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(
        subparsers, common, "manifest", _run,
        help="write a manifest of every file in a folder",
        description="Hash every regular file under DIR (symlinks are skipped; version "
        "control's folders and the hub's download records are left out) and write "
        "DIR/torchverity.manifest.json, or DIR/manifest-sha256.txt with --format sha256sum. "
        "Prints the root digest.",
    )
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--algo", choices=ALGORITHMS,
                   help="the digest (default: blake3; sha256 with --format sha256sum)")
    p.add_argument("--format", choices=get_args(ManifestFormat), default="json", dest="fmt")


def _run(args: argparse.Namespace, out: Output) -> int:
    from torchverity.manifest import MANIFEST_NAME, SHA256SUM_NAME, write_manifest

    with out.progress(None, "hashing") as advance:
        manifest = write_manifest(args.directory, args.algo, fmt=args.fmt, progress=advance)
    name = MANIFEST_NAME if args.fmt == "json" else SHA256SUM_NAME
    for link in manifest.skipped:
        out.warn(f"skipped symlink {link} (links are never followed)")
    for tool in manifest.left_out:
        out.info(f"left out {tool}/: the records of the tool that fetched the folder, "
                 "rewritten by its every command")
    total = sum(e.size for e in manifest.entries)
    data = {"ok": True, "manifest": f"{args.directory}/{name}", "algorithm": manifest.algo,
            "root": manifest.root, "files": len(manifest.entries), "bytes": total,
            "skipped": list(manifest.skipped), "left_out": list(manifest.left_out)}
    return out.result(data, lambda: _print(data, args.directory, out))


def _print(data: dict[str, Any], directory: str, out: Output) -> None:
    out.line(f"{data['root']}  {directory}")
    out.info(f"wrote {data['manifest']}: {data['files']} files, {data['bytes']} bytes, "
             f"{data['algorithm']} root above")
