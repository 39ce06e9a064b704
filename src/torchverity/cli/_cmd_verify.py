"""``torchverity verify``: files against sidecars, folders against manifests, models
against OpenSSF signatures, Hugging Face caches against their blob names."""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from torchverity.cli._command import add_command
from torchverity.cli._output import Output
from torchverity.errors import UsageError


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(
        subparsers, common, "verify", _run,
        help="check files and folders against their records",
        description="A file is checked against FILE.blake3 (or .sha256, .xxh128), a folder "
        "against its manifest (a folder without one by the sidecars of its files, listing the "
        "files none covers; a file without a sidecar by its folder's manifest), an index "
        "(*.index.json) with the shards it names, a Hugging Face hub cache (HF_HOME, "
        "models--ORG--NAME, snapshots/REV) or local_dir download against the names the hub "
        "gave its files (offline). "
        "--signature checks an OpenSSF model signature (key or certificate chain), "
        "--attestation an in-toto statement. Lists ok / mismatched / missing / extra paths and "
        "broken downloads (a Git LFS pointer or an HTML page saved as the file; with no "
        "record, also a weights file cut short or an index naming shards the folder lacks); "
        "exit 1 if "
        "any is not ok.",
    )
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="skip paths (or file names) matching GLOB in folders; repeat for more")
    p.add_argument("--signature", metavar="SIG", help="OpenSSF model signature (model.sig)")
    p.add_argument("--public-key", metavar="PEM", help="public key the signature must verify with")
    p.add_argument("--certificate", metavar="PEM", action="append", default=[],
                   help="trusted CA certificate(s) for certificate signatures (repeatable)")
    p.add_argument("--attestation", metavar="FILE",
                   help="in-toto statement (torchverity attest) to check the files against")


def _run(args: argparse.Namespace, out: Output) -> int:
    if (args.public_key or args.certificate) and not (args.signature or args.attestation):
        args.signature = _default_signature(args.paths)
    if args.signature or args.attestation:
        results = _provenance_results(args)
    else:
        results = [_verify_one(path, out, args.exclude) for path in args.paths]
    # A file intact on disk but saved while the guard had doubts about its weights fails.
    ok = all(r.ok and getattr(r, "certified", None) is not False for r in results)
    return out.result({"ok": ok, "results": results}, lambda: _print(results, out))


def _print(results: list[Any], out: Output) -> None:
    for r in results:
        _print_any(r, out)


def _default_signature(paths: list[str]) -> str:
    """A key or certificate alone means: the model's own signature (DIR/model.sig, FILE.sig)."""
    from torchverity.provenance import default_signature_path

    found = default_signature_path(paths[0]) if len(paths) == 1 else None
    if found is None or not found.is_file():
        raise UsageError("--public-key and --certificate check a signature: no --signature given "
                         "and no model.sig beside the model",
                         hint="torchverity verify DIR --signature model.sig --public-key pub.pem")
    return str(found)


def _verify_one(path: str, out: Output, exclude: list[str]) -> Any:
    from pathlib import Path

    from torchverity.digest import find_sidecar
    from torchverity.provenance import HubResult, hub_blob_check, hub_target, verify_hub_path
    from torchverity.verify import verify_path

    p = Path(path)
    if p.is_dir() and not _has_manifest(p) and hub_target(p) is not None:
        return verify_hub_path(p)
    if not p.is_dir() and find_sidecar(p) is None and (entry := hub_blob_check(p)) is not None:
        return HubResult(path, "hub-snapshot", (entry, *_hub_shards(p, entry)))
    with out.progress(None, f"verifying {path}") as advance:
        return verify_path(path, progress=advance, exclude=exclude)


def _hub_shards(index: Any, entry: Any) -> tuple[Any, ...]:
    """For an index the hub named (``model.safetensors.index.json``), the checks of the shards
    it names, each against the name the hub gave it: the index stands for the checkpoint. A
    damaged index names no shard it can be trusted for."""
    import dataclasses
    from pathlib import PurePosixPath

    from torchverity.checkpoint._index import read_index
    from torchverity.provenance import hub_file_checks
    from torchverity.verify import INDEX_SUFFIX

    if not index.name.endswith(INDEX_SUFFIX) or not entry.ok:
        return ()
    names = list(dict.fromkeys(read_index(index).values()))
    folder = PurePosixPath(entry.path).parent
    shards = []
    for name, found in zip(names, hub_file_checks([index.parent / n for n in names]),
                           strict=True):
        gone = not (index.parent / name).exists()
        shards.append(found or dataclasses.replace(
            entry, path=(folder / name).as_posix(), status="missing" if gone else "unchecked",
            blob=None, algo=None, actual=None, size=None,
            detail="the index names it, the download does not hold it" if gone else
            "no name from the hub to check it against"))
    return tuple(shards)


def _has_manifest(p: Any) -> bool:
    from torchverity.manifest import MANIFEST_FILES

    return any((p / name).is_file() for name in MANIFEST_FILES)


def _provenance_results(args: argparse.Namespace) -> list[Any]:
    if len(args.paths) != 1:
        raise UsageError("--signature and --attestation check one model at a time",
                         hint="run torchverity verify once per model")
    path = args.paths[0]
    results: list[Any] = []
    if args.signature:
        from torchverity.provenance import verify_model

        results.append(verify_model(path, args.signature, public_key=args.public_key,
                                    certificate_chain=args.certificate))
    if args.attestation:
        from torchverity.provenance import verify_attestation

        results.append(verify_attestation(path, args.attestation, public_key=args.public_key,
                                          certificate_chain=args.certificate))
    return results


def _print_any(result: Any, out: Output) -> None:
    if result.kind.startswith(("hub", "local")):
        _print_hub(result, out)
        return
    if result.kind in ("signature", "attestation"):
        out.line(f"{result.target}: {result.kind} {result.record} by {result.signer}")
        if not result.valid:
            out.line(f"{result.target}: FAILED: {result.kind} refused: {result.reason}")
            out.info(f"{result.record}: does not verify; get the model and its {result.kind} "
                     "again from the publisher, then rerun torchverity verify")
            return
        covers = ", ".join(f"{k} {v}" for k, v in result.subject.items())
        skipped = f"; not covered: {', '.join(result.ignored)}" if result.ignored else ""
        out.line(f"  covers {covers} ({result.algo}){skipped}")
    _print_result(result, out)


def _print_result(result: Any, out: Output) -> None:
    from torchverity._verify_sidecars import advice

    broken = getattr(result, "broken", ())
    counts = ", ".join([f"{n} {s}" for s, n in result.counts.items() if n]
                       + ([f"{len(broken)} broken download(s)"] if broken else []))
    verdict = "OK" if result.ok else "FAILED"
    out.line(f"{result.target}: {verdict} ({counts}) against {result.record}")
    rows = [(e.status, e.path, e.expected or "-", e.actual or "-") for e in result.problems]
    rows += [("broken", rel, "-", "-") for rel in broken]
    if rows:
        out.table(("status", "path", "expected", "actual"), rows)
    unrecorded = getattr(result, "unrecorded", ())
    if unrecorded:
        out.line(f"  not checked, no record covers them: {', '.join(unrecorded)}")
    skipped = getattr(result, "skipped", ())
    if skipped:
        out.line(f"  not checked, skipped by --exclude: {', '.join(skipped)}")
    cert = getattr(result, "certification", None)
    if cert is not None:
        out.line(_certification_line(result.target, cert))
    records = getattr(result, "unlisted_records", ())
    if records:
        out.line("  not in the manifest but not counted (torchverity's own records of listed "
                 f"files): {', '.join(records)}")
    for e in result.problems:
        if e.tensors:
            out.line(f"{e.path}: damaged tensors (from its meta.json): {', '.join(e.tensors)}")
    if result.kind in ("signature", "attestation"):
        if not result.ok:
            out.info(f"{result.target}: the files differ from what the {result.kind} vouches "
                     "for; get the listed files again from the publisher, then rerun "
                     "torchverity verify")
        return
    for step in advice(result):
        out.info(f"{result.target}: {step}")


def _print_hub(result: Any, out: Output) -> None:
    counts = ", ".join(f"{n} {s}" for s, n in result.counts.items() if n) or "no files"
    verdict = "OK" if result.ok else "FAILED"
    out.line(f"{result.target}: {verdict} ({counts}) against the {result.record}")
    for revision, per in result.revisions().items():
        out.line(f"  {revision}: " + ", ".join(f"{n} {s}" for s, n in sorted(per.items())))
    rows = [(e.status, e.where(), e.blob or "-", e.actual or e.detail or "-")
            for e in result.problems]
    if rows:
        out.table(("status", "file", "named", "content / why"), rows)
    if not result.ok:
        fetch = "; ".join(sorted({_fetch_again(e.repo) for e in result.problems}))
        out.info(f"{result.target}: delete the listed files and download them again "
                 f"({fetch}), then rerun torchverity verify")


def _fetch_again(repo: str) -> str:
    """The download of a cached repository (``model:ORG/NAME``) again; a ``local_dir``
    download names only its folder, so the repository id is the user's to fill in."""
    kind, sep, name = repo.partition(":")
    if not sep:
        return (f"huggingface-cli download REPO_ID --local-dir {shlex.quote(repo)} "
                "--force-download")
    typed = "" if kind == "model" else f" --repo-type {kind}"
    return f"huggingface-cli download {shlex.quote(name)}{typed} --force-download"

def _certification_line(target: str, cert: dict[str, Any]) -> str:
    verified = cert.get("verified") or {}
    if cert["certified"]:
        return (f"{target}: certified by the training guard at step {cert.get('step')} "
                f"(at rest: {verified.get('tensors')} tensors verified)")
    from torchverity.checkpoint._meta import certification_doubts

    why = certification_doubts(cert)
    return (f"{target}: UNCERTIFIED: saved at step {cert.get('step')} while the training guard "
            f"had doubts ({'; '.join(why) or 'see meta.json'}); restore a certified checkpoint")
