"""``torchverity verify``: files against sidecars, folders against manifests."""

from __future__ import annotations

import argparse
from typing import Any

from torchverity.cli._command import add_command
from torchverity.cli._output import Output
from torchverity.errors import EXIT_CHECK_FAILED


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(
        subparsers, common, "verify", _run,
        help="check files and folders against their records",
        description="A file is checked against FILE.sha256 (or .blake3), a folder against its "
        "manifest (a folder without one by the sidecars of its files, a file without a "
        "sidecar by its folder's manifest). Lists ok / mismatched / missing / extra paths; "
        "exit 1 if any is not ok.",
    )
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="skip paths (or file names) matching GLOB in folders; repeat for more")


def _run(args: argparse.Namespace, out: Output) -> int:
    from torchverity.verify import verify_path

    results = []
    for path in args.paths:
        with out.progress(None, f"verifying {path}") as advance:
            results.append(verify_path(path, progress=advance, exclude=args.exclude))
    # A file intact on disk but saved while the guard had doubts about its weights fails.
    ok = all(r.ok and r.certified is not False for r in results)
    if out.json_mode:
        out.data({"ok": ok, "results": results})
    else:
        for r in results:
            _print_result(r, out)
    return 0 if ok else EXIT_CHECK_FAILED


def _print_result(result: Any, out: Output) -> None:
    from torchverity._verify_sidecars import advice

    counts = ", ".join(f"{n} {s}" for s, n in result.counts.items() if n)
    verdict = "OK" if result.ok else "FAILED"
    out.line(f"{result.target}: {verdict} ({counts}) against {result.record}")
    rows = [(e.status, e.path, e.expected or "-", e.actual or "-") for e in result.problems]
    if rows:
        out.table(("status", "path", "expected", "actual"), rows)
    cert = result.certification
    if cert is not None:
        out.line(_certification_line(result.target, cert))
    for e in result.problems:
        if e.tensors:
            out.line(f"{e.path}: damaged tensors (from its meta.json): {', '.join(e.tensors)}")
    for step in advice(result):
        out.info(f"{result.target}: {step}")


def _certification_line(target: str, cert: dict[str, Any]) -> str:
    verified = cert.get("verified") or {}
    if cert["certified"]:
        return (f"{target}: certified by the training guard at step {cert.get('step')} "
                f"(at rest: {verified.get('tensors')} tensors verified)")
    why = []
    if cert.get("changed"):
        why.append(f"changed at rest: {', '.join(cert['changed'])}")
    for u in cert.get("unresolved") or []:
        why.append(f"unresolved {u['kind']} at step {u['step']}"
                   + (f" in {', '.join(u['suspects'])}" if u.get("suspects") else ""))
    if verified.get("at_rest") == "unavailable":
        why.append("no at-rest verification was possible")
    return (f"{target}: UNCERTIFIED: saved at step {cert.get('step')} while the training guard "
            f"had doubts ({'; '.join(why) or 'see meta.json'}); restore a certified checkpoint")
