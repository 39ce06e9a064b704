"""in-toto attestations: what a checkpoint is, what produced it, signed like a model.

``write_attestation`` builds an in-toto Statement v1 (the ``in-toto-attestation``
package) whose subjects are the checkpoint's files with their SHA-256 and
whose predicate records the content fingerprint, the seed, data-order record
and environment ``torchverity.save`` wrote into meta.json, what the
TrainingGuard event log of the run says (steps, anomalies, skipped steps,
rollbacks, replays) and any other training record passed in (kept verbatim
with its digest). Written as JSON, or, with a key, as the same Sigstore bundle (DSSE
envelope) model signatures use, signed through ``model-signing``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchverity.digest import atomic_write_text, digest_files
from torchverity.errors import FormatError, InputError, UsageError, require_extra, shell_path
from torchverity.provenance._oms import (
    DEFAULT_SIGNATURE,
    GIT_PATHS,
    CheckedEntries,
    existing,
    model_files,
    open_bundle,
)
from torchverity.provenance._records import model_digests
from torchverity.verify import Status, VerifyEntry

PREDICATE_TYPE = "https://torchverity.dev/attestation/checkpoint/v1"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
SUFFIX = ".intoto.json"
_FEATURE = "in-toto attestations"


@dataclass(frozen=True)
class AttestationResult(CheckedEntries):
    """A checkpoint checked against its attestation: the envelope, then every subject."""

    target: str
    record: str
    valid: bool
    signer: str
    subject: dict[str, str]
    algo: str
    entries: tuple[VerifyEntry, ...]
    predicate: dict[str, Any]
    reason: str | None = None
    ignored: tuple[str, ...] = ()
    kind: str = "attestation"

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target, "kind": self.kind, "record": self.record, "ok": self.ok,
            "attestation_valid": self.valid, "signer": self.signer, "subject": self.subject,
            "reason": self.reason, "counts": self.counts, "predicate": self.predicate,
            "entries": self.entries_json(),
        }


def default_attestation_path(ckpt: str | os.PathLike[str]) -> Path:
    p = Path(ckpt)
    return p / f"attestation{SUFFIX}" if p.is_dir() else p.with_name(p.name + SUFFIX)


# ------------------------------------------------------------------ building


def _excluded(root: Path, attestation: Path) -> list[str]:
    """Inside a folder, the attestation itself and the model signature are not subjects."""
    if not root.is_dir():
        return []
    inside = os.path.relpath(os.path.abspath(attestation), os.path.abspath(root))
    return [DEFAULT_SIGNATURE, *([] if inside.startswith("..") else [Path(inside).as_posix()])]


def _meta_of(path: Path) -> dict[str, Any] | None:
    meta = path.with_name(path.name + ".meta.json")
    if not meta.is_file():
        return None
    try:
        data = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{meta}: unreadable meta.json ({exc})", path=meta,
                          hint=f"torchverity verify {shell_path(path)}") from None
    return data if isinstance(data, dict) else None


def _checkpoint_record(root: Path, files: Sequence[str]) -> dict[str, Any]:
    """Fingerprint, seed, data order and environment of each checkpoint file with a meta.json."""
    record: dict[str, Any] = {}
    for rel in files:
        path = root if rel == "." else root / rel
        meta = _meta_of(path)
        if meta is None:
            continue
        fp = meta.get("fingerprint") or {}
        record[path.name if rel == "." else rel] = {
            "fingerprint": {"root": fp.get("root"), "algo": fp.get("algo")},
            "seed": meta.get("seed"), "data": meta.get("data"),
            "environment": meta.get("environment"), "created": meta.get("created"),
            # The training guard's verdict on the weights it saved (certified checkpoints).
            "certification": meta.get("certification"),
        }
    return record


def _training_record(path: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    if path is None:
        return None
    p = Path(path)
    try:
        raw = p.read_bytes()
        doc = json.loads(raw)
    except OSError as exc:
        raise InputError(f"{p}: cannot read training record: {exc.strerror or exc}",
                         path=p) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{p}: training record is not JSON ({exc})", path=p) from None
    return {"file": p.name, "sha256": hashlib.sha256(raw).hexdigest(), "record": doc}


def _guard_record(path: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """What a TrainingGuard event log says about the run, with the log's SHA-256."""
    if path is None:
        return None
    from torchverity.digest import digest_file
    from torchverity.report import summarize

    p = Path(path)
    run = summarize(p)
    return {"file": p.name, "sha256": digest_file(p, "sha256").hexdigest, "steps": run.steps,
            "anomalies": run.counts, "first_anomaly_step": run.first_anomaly_step,
            "skipped": run.skipped, "rollbacks": run.rollbacks, "replays": run.replays,
            "checkpoints": run.checkpoints, "finished": run.finished}


def build_statement(ckpt: str | os.PathLike[str], *,
                    training: str | os.PathLike[str] | None = None,
                    guard_log: str | os.PathLike[str] | None = None,
                    exclude: Sequence[str] = ()) -> dict[str, Any]:
    """The in-toto Statement v1 for a checkpoint file or folder, as a JSON-ready dict."""
    itoto = require_extra("in_toto_attestation.v1.statement", extra="sign", feature=_FEATURE)
    from google.protobuf import json_format

    root = existing(ckpt)
    files, _links = model_files(root, [*GIT_PATHS, *exclude])
    # in-toto subjects are matched by SHA-256 everywhere they are consumed.
    digests = model_digests(root, files, "sha256")
    subjects = [itoto.ResourceDescriptor(name=root.name if rel == "." else rel,
                                         digest={"sha256": hx}).pb
                for rel, hx in digests.hexdigests.items()]
    from torchverity import __version__

    predicate = {
        "checkpoint": _checkpoint_record(root, files),
        "training": _training_record(training),
        "guard": _guard_record(guard_log),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "producer": {"name": "torchverity", "version": __version__},
    }
    statement = itoto.Statement(subjects, PREDICATE_TYPE, predicate)
    statement.validate()
    return dict(json.loads(json_format.MessageToJson(statement.pb)))


def write_attestation(
    ckpt: str | os.PathLike[str],
    *,
    out: str | os.PathLike[str] | None = None,
    private_key: str | os.PathLike[str] | None = None,
    certificate: str | os.PathLike[str] | None = None,
    chain: Sequence[str | os.PathLike[str]] = (),
    training: str | os.PathLike[str] | None = None,
    guard_log: str | os.PathLike[str] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Write the statement (signed into a Sigstore bundle when a key is given)."""
    target = Path(out) if out is not None else default_attestation_path(ckpt)
    exclude = _excluded(Path(ckpt), target)
    signer = _signer(private_key, certificate, chain) if private_key else None
    if signer is None and (certificate or chain):
        raise UsageError("--certificate needs --key", hint="pass the certificate's private key")
    statement = build_statement(ckpt, training=training, guard_log=guard_log, exclude=exclude)
    text = json.dumps(statement, indent=2) + "\n"
    if signer is not None:
        text = _sign_statement(signer, statement)
    atomic_write_text(target, text)
    return target, statement


# ------------------------------------------------------------------ signing


def _signer(private_key: Any, certificate: Any, chain: Sequence[Any]) -> Any:
    from torchverity.provenance._oms import _signer_config

    config, _mode = _signer_config(Path(private_key), Path(certificate) if certificate else None,
                                   [Path(c) for c in chain], None)
    return config._signer


class _StatementPayload:
    """What model-signing's signers sign: an object holding an in-toto ``statement``."""

    def __init__(self, statement: dict[str, Any]) -> None:
        from google.protobuf import json_format
        from in_toto_attestation.v1 import statement as itoto

        pb = json_format.ParseDict(statement, itoto.spb.Statement())
        self.statement = itoto.Statement.copy_from_pb(pb)


def _sign_statement(signer: Any, statement: dict[str, Any]) -> str:
    signature = signer.sign(_StatementPayload(statement))
    return str(signature.bundle.to_json())


# ------------------------------------------------------------------ verifying


def _load_document(att: Path) -> dict[str, Any]:
    try:
        doc = json.loads(att.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{att}: no such attestation", path=att,
                         hint="write one: torchverity attest CKPT --out "
                              f"{shell_path(att)}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{att}: not an attestation (JSON): {exc}", path=att) from None
    if not isinstance(doc, dict) or not ("dsseEnvelope" in doc or "_type" in doc):
        raise FormatError(f"{att}: neither an in-toto statement nor a Sigstore bundle", path=att,
                          hint="pass the file torchverity attest wrote")
    return doc


def _open_envelope(att: Path, public_key: Any, chain: Sequence[Any]) -> tuple[Any, str, str]:
    """The signed statement (or None), who signed it, and why it was refused."""
    bundle, verifier, signer = open_bundle(att, public_key, chain)
    try:
        _ptype, payload = verifier._verify_signed_content(bundle)
        return json.loads(payload), signer, ""
    except Exception as exc:  # bad signature, key mismatch, chain errors
        return None, signer, f"{type(exc).__name__}: {exc}"


def verify_attestation(
    ckpt: str | os.PathLike[str],
    attestation: str | os.PathLike[str],
    *,
    public_key: str | os.PathLike[str] | None = None,
    certificate_chain: Sequence[str | os.PathLike[str]] = (),
) -> AttestationResult:
    """Check the attestation (its signature when it has one), then every subject file."""
    root, att = existing(ckpt), Path(attestation)
    doc = _load_document(att)
    if "dsseEnvelope" in doc:
        statement, signer, reason = _open_envelope(att, public_key, certificate_chain)
    elif public_key or certificate_chain:
        statement, signer, reason = None, "nobody", "the attestation is not signed"
    else:
        statement, signer, reason = doc, "unsigned (stops accidental damage only)", ""
    if statement is None:
        return AttestationResult(os.fspath(root), os.fspath(att), False, signer, {}, "", (),
                                 {}, reason=reason)
    subjects = _subjects(att, statement)
    entries = _compare(root, subjects, att)
    return AttestationResult(
        os.fspath(root), os.fspath(att), True, signer,
        {"predicate": str(statement.get("predicateType")), "files": str(len(subjects))},
        "sha256", entries, dict(statement.get("predicate") or {}),
        ignored=(*GIT_PATHS, *_excluded(root, att)) if root.is_dir() else ())


def _subjects(att: Path, statement: dict[str, Any]) -> dict[str, str]:
    if statement.get("_type") != STATEMENT_TYPE or statement.get("predicateType") \
            != PREDICATE_TYPE:
        raise FormatError(f"{att}: not a torchverity checkpoint statement "
                          f"({statement.get('_type')}, {statement.get('predicateType')})",
                          path=att)
    try:
        return {s["name"]: s["digest"]["sha256"] for s in statement["subject"]}
    except (KeyError, TypeError):
        raise FormatError(f"{att}: a subject lacks its name or sha256 digest", path=att) \
            from None


def _compare(root: Path, subjects: dict[str, str], att: Path) -> tuple[VerifyEntry, ...]:
    if root.is_file():
        paths = {root.name: root}
    else:
        files, _links = model_files(root, [*GIT_PATHS, *_excluded(root, att)])
        paths = {rel: root / rel for rel in files}
    present = [name for name in subjects if name in paths]
    got = dict(zip(present, digest_files([paths[n] for n in present], "sha256"), strict=True))
    entries: list[VerifyEntry] = []
    for name, want in subjects.items():
        d = got.get(name)
        status: Status = "missing" if d is None else "ok" if d.hexdigest == want else "mismatched"
        entries.append(VerifyEntry(name, status, want, d.hexdigest if d else None,
                                   actual_size=d.size if d else None))
    entries += [VerifyEntry(name, "extra") for name in paths if name not in subjects]
    entries.sort(key=lambda e: e.path.encode())
    return tuple(entries)
