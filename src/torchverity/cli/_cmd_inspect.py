"""``torchverity inspect``: what a checkpoint holds, whether it is intact and safe to load."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

from torchverity.cli._command import add_command, at_least
from torchverity.cli._output import Output
from torchverity.errors import shell_path


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(
        subparsers, common, "inspect", _run,
        help="tensors, sizes, fingerprint, meta.json, sidecar and scan verdict of a checkpoint",
        description="Show a checkpoint's tensors (names, shapes, dtypes, bytes), element count, "
        "bytes per dtype, content fingerprint, meta.json summary, whether the file (and each "
        "shard) matches its record (its sidecar, else its entry in its folder's manifest) "
        "and, for pickle files, the scan verdict and weights_only plan. Never executes code "
        "from the file: a file the scan finds unsafe is listed from an inert read. Exit 1 if "
        "a record or meta.json disagrees, or the scan finds a file needs-review, unsafe or "
        "malformed (as torchverity scan exits); 2 if it cannot be read.",
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
    records = (result.sidecar, *result.shard_records.values())
    bad = (any(r.status == "mismatched" for r in records)
           or result.fingerprint_matches_meta is False
           or any(not scan.ok for scan in result.scans) or bool(found))
    return not bad, found


def _advise(result: Any, found: list[str], out: Output) -> None:
    from torchverity.errors import restore_step

    for scan in result.scans:
        if scan.verdict == "unsafe":
            _advise_unsafe(scan, result.not_loaded is None and bool(result.tensors), out)
        elif scan.plan is not None and scan.plan.torch_cannot_read and not found:
            _advise_convert(scan, out)
    for text in found:
        out.err.write(f"torchverity: damaged: {text}\n")
    if found or any(scan.verdict == "malformed" for scan in result.scans):
        out.err.write(f"  next: {restore_step(result.path)}\n")


def _advise_unsafe(scan: Any, read: bool, out: Output) -> None:
    """An unsafe file is not damaged: name what it would run, and the way to its tensors
    when the inert reader ``read`` some."""
    from torchverity.pickles._dangerous import dangerous_globals, describe_globals, rescue_step

    named = describe_globals(dangerous_globals(scan)) or scan.reason
    out.err.write(f"torchverity: unsafe: {scan.path}: it names globals that run code or touch "
                  f"the system: {named}; inspect ran nothing from it\n"
                  f"  next: {rescue_step(scan) if read else 'do not load it'}\n")


def _advise_convert(scan: Any, out: Output) -> None:
    """An intact file no torch.load reads is not damaged: say so, and how to convert it."""
    out.err.write(f"torchverity: {scan.path}: intact, but torch.load cannot read it: "
                  f"{scan.plan.torch_cannot_read}\n"
                  f"  next: torchverity migrate {shell_path(scan.path)} NEW.safetensors "
                  "converts it without running it\n")


_KINDS = {
    "torchscript": "TorchScript archive (torch.jit.save)",
    "pickle": "plain pickle (pickle.dump, not torch.save: torch.load cannot read it)",
}


def _print(r: Any, limit: int, out: Output) -> None:
    kind = _KINDS.get(r.format, f"{r.format} checkpoint")
    if r.scan is not None and r.scan.plan is not None and r.scan.plan.torch_cannot_read:
        kind += " at pickle protocol 0 (no torch.load setting reads it)"
    out.line(f"{r.path}: {kind}, {_size(r.size)}"
             + (f", {len(r.shards)} shards" if r.shards else ""))
    out.line(f"  {r.sidecar.algo:<11} {r.sidecar.actual}  {_against(r.sidecar)}")
    _print_shard_records(r, out)
    if r.scan is not None:
        out.line(f"  scan        {r.scan.verdict}{_plan_words(r.scan, limit)}")
    if r.shard_scans:
        counts = Counter(scan.verdict for scan in r.shard_scans)
        flagged = [Path(scan.path).name for scan in r.shard_scans if not scan.ok]
        out.line("  scan        shards: " + ", ".join(f"{n} {v}" for v, n in counts.items())
                 + (f" ({', '.join(flagged[:5])})" if flagged else ""))
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


def _plan_words(scan: Any, limit: int) -> str:
    """What the scan's load plan says, after its verdict."""
    plan = scan.plan
    # An unsafe file's plan would name its code-running globals as what to allowlist.
    if scan.verdict == "unsafe":
        return f": {scan.reason}"
    if plan is None:
        return ""
    if plan.torch_cannot_read:
        return " (torch.load cannot read it, with any weights_only setting)"
    if not plan.loadable:
        return (" (torch.load(weights_only=True) cannot read it, whatever you allowlist: "
                f"torchverity scan {shell_path(scan.path)} says why)")
    if plan.needs:
        shown = plan.needs if limit <= 0 else plan.needs[:limit]
        more = len(plan.needs) - len(shown)
        # The plan is the scan's to give whole: the cut list says where to read it.
        rest = (f", ... {more} more (torchverity scan {shell_path(scan.path)} prints the "
                "safe_globals plan)") if more else ""
        return f" (weights_only needs: {', '.join(shown)}{rest})"
    return " (weights_only loads it as is)"


def _against(s: Any) -> str:
    """A SidecarCheck as words: which record the file matched, or did not."""
    from torchverity.provenance._torch_hub import record_name

    record = {"sidecar": s.sidecar, "manifest": f"{s.sidecar} (entry {s.entry})",
              "hub": "the hub's record (its blob's name)",
              "torch-hub": record_name(s.expected or "")}[s.source]
    return {"ok": f"matches {record}", "missing": "no sidecar",
            "mismatched": f"DOES NOT MATCH {record} (expected {s.expected})"}[s.status]


def _print_shard_records(r: Any, out: Output) -> None:
    """Each shard with a record against it: those that differ named, the rest counted."""
    if not r.shard_records:
        return
    for name, check in r.shard_records.items():
        if check.status == "mismatched":
            out.line(f"  shard       {name}: {check.algo} {check.actual} {_against(check)}")
    matched = sum(check.status == "ok" for check in r.shard_records.values())
    folder = Path(r.path) if Path(r.path).is_dir() else Path(r.path).parent
    absent = [s for s in r.shards if s not in r.shard_records]
    gone = sum(not (folder / s).is_file() for s in absent)
    notes = []
    if len(absent) > gone:
        notes.append(f"{len(absent) - gone} have none")
    if gone:
        notes.append(f"{gone} missing")
    out.line(f"  shards      {matched} of {len(r.shards)} match their records"
             + (f" ({', '.join(notes)})" if notes else ""))


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
