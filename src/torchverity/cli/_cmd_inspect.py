"""``torchverity inspect``: what a checkpoint holds, whether it is intact and safe to load."""

from __future__ import annotations

import argparse
import json
from typing import Any

from torchverity.cli._command import add_command, at_least
from torchverity.cli._output import Output


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(
        subparsers, common, "inspect", _run,
        help="tensors, sizes, fingerprint, meta.json, sidecar and scan verdict of a checkpoint",
        description="Show a checkpoint's tensors (names, shapes, dtypes, bytes), element count, "
        "bytes per dtype, content fingerprint, meta.json summary, whether the sidecar matches "
        "and, for pickle files, the scan verdict and weights_only plan. Never executes code "
        "from the file. Exit 1 if the sidecar or meta.json disagrees or the scan finds it "
        "unsafe.",
    )
    p.add_argument("path", metavar="PATH", help="a .pt/.bin/.safetensors/.onnx file, a Hugging "
                   "Face folder (single file or sharded) or its index, or a pipeline folder "
                   "(diffusers: each component in turn)")
    p.add_argument("--limit", type=at_least(0), default=50,
                   help="list at most this many tensors, and this many plain values "
                   "(default 50; 0 lists all; --json always lists all)")


def _run(args: argparse.Namespace, out: Output) -> int:
    from torchverity.checkpoint._folders import pipeline_components
    from torchverity.checkpoint._inspect import inspect

    parts = pipeline_components(args.path)
    if parts:  # a pipeline (diffusers): each component folder is a checkpoint of its own
        results = {part.name: inspect(part) for part in parts}
        checked = {name: _checked(r) for name, r in results.items()}

        def render() -> None:
            for r in results.values():
                _print(r, args.limit, out)

        code = out.result(
            {"ok": all(ok for ok, _ in checked.values()), "path": args.path,
             "components": {name: {"ok": checked[name][0], "problems": checked[name][1],
                                   **r.to_dict()} for name, r in results.items()}}, render)
        for name, r in results.items():
            _advise(r, checked[name][1], out)
        return code
    result = inspect(args.path)
    ok, found = _checked(result)
    code = out.result({"ok": ok, "problems": found, **result.to_dict()},
                      lambda: _print(result, args.limit, out))
    _advise(result, found, out)
    return code


def _checked(result: Any) -> tuple[bool, list[str]]:
    """Whether the checkpoint is intact and safe, and the damage found in it."""
    from torchverity.checkpoint._inspect_damage import problems

    found = problems(result)
    bad = (result.sidecar.status == "mismatched" or result.fingerprint_matches_meta is False
           or (result.scan is not None and not result.scan.ok) or bool(found))
    return not bad, found


def _advise(result: Any, found: list[str], out: Output) -> None:
    from torchverity.errors import restore_step

    for text in found:
        out.err.write(f"torchverity: damaged: {text}\n")
    if found or (result.scan is not None and result.scan.verdict == "malformed"):
        out.err.write(f"  next: {restore_step(result.path)}\n")


def _print(r: Any, limit: int, out: Output) -> None:
    out.line(f"{r.path}: {r.format} checkpoint, {_size(r.size)}"
             + (f", {len(r.shards)} shards" if r.shards else ""))
    s = r.sidecar
    record = s.sidecar if s.source == "sidecar" else "the hub's record (its blob's name)"
    side = {"ok": f"matches {record}", "missing": "no sidecar",
            "mismatched": f"DOES NOT MATCH {record} (expected {s.expected})"}[s.status]
    out.line(f"  {s.algo:<11} {s.actual}  {side}")
    if r.scan is not None:
        plan = r.scan.plan
        how = ("" if plan is None else
               " (weights_only loads it as is)" if plan.loadable and not plan.needs else
               f" (weights_only needs: {', '.join(plan.needs)})")
        out.line(f"  scan        {r.scan.verdict}{how}")
    if r.fingerprint:
        match = {None: "", True: "  matches meta.json", False: "  DOES NOT MATCH meta.json"}
        out.line(f"  fingerprint {r.fingerprint}{match[r.fingerprint_matches_meta]}")
    if r.meta:
        _print_meta(r.meta, out)
    if r.not_loaded:
        out.line(f"  tensors     {r.not_loaded}")
        return
    by_dtype = ", ".join(f"{d} {_size(n)}" for d, n in r.bytes_by_dtype.items())
    out.line(f"  tensors     {len(r.tensors)} tensors, {r.parameters:,} elements ({by_dtype})")
    shown = r.tensors if limit <= 0 else r.tensors[:limit]
    out.table(("name", "dtype", "shape", "bytes"),
              [(t.name, t.dtype, "x".join(map(str, t.shape)) or "()", _size(t.nbytes))
               for t in shown])
    if len(shown) < len(r.tensors):
        out.line(f"  ... {len(r.tensors) - len(shown)} more (--limit 0 lists all)")
    values = list(r.values.items())
    for name, value in values if limit <= 0 else values[:limit]:
        out.line(f"  {name} = {value}")
    if 0 < limit < len(values):
        out.line(f"  ... {len(values) - limit} more values (--limit 0 lists all)")


def _print_meta(meta: dict[str, Any], out: Output) -> None:
    if "error" in meta:
        out.line(f"  meta.json   {meta['error']}")
        return
    parts = [f"saved {meta['created']}", f"torch {meta['torch']}"]
    if meta.get("git_commit"):
        parts.append(f"git {meta['git_commit'][:12]}")
    if meta.get("seed") is not None:
        parts.append(f"seed {meta['seed']}")
    if meta.get("data"):
        parts.append(f"data {meta['data'].get('kind')} {meta['data'].get('digest', '')[:16]}...")
    out.line(f"  meta.json   {', '.join(parts)}")
    if meta.get("user") is not None:
        out.line(f"  user meta   {json.dumps(meta['user'], sort_keys=True)}")
    cert = meta.get("certification")
    if cert is not None:
        from torchverity.checkpoint._meta import certification_doubts

        doubts = "; ".join(certification_doubts(cert)) or "see meta.json"
        verdict = "certified" if cert["certified"] else (
            f"UNCERTIFIED (saved while the guard had doubts: {doubts})")
        out.line(f"  guard       {verdict} at step {cert.get('step')}")


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
