"""One checkpoint file loaded and verified: its digest checked as it is read (sidecar,
meta.json, or a pending record of an interrupted save), weights_only, the fingerprint
compared with meta.json.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from torchverity._formats import FileFormat, download_kind, foreign_format
from torchverity._tensors import dtype_name
from torchverity.checkpoint._fingerprint import (
    EXACT,
    Fingerprint,
    TensorDigest,
    exact_algo,
    fingerprint,
    from_entries,
    layout,
    tensor_hasher,
)
from torchverity.checkpoint._folders import manifest_entry, record_step, unlisted
from torchverity.checkpoint._hashing_reader import cpu_count, lane, load_while_hashing
from torchverity.checkpoint._meta import (
    META_SUFFIX,
    _meta_fingerprint,
    meta_path_for,
    read_meta,
)
from torchverity.checkpoint._read import (
    _count_tensors,
    _load_failure,
    _torch_load,
    joblib_error,
    plain_pickle_error,
    torch_cannot_read_error,
)
from torchverity.checkpoint._records import Records, recorded_digest, resolve_records
from torchverity.checkpoint._results import ExpectedDigest, LoadReport, SidecarPolicy
from torchverity.digest import (
    FASTER_THAN_COPY,
    digest_file,
    new_hasher,
    require_sha256,
)
from torchverity.errors import (
    FormatError,
    IntegrityError,
    UnsafeFileError,
    shell_path,
)
from torchverity.pickles._file_format import checkpoint_format
from torchverity.provenance._torch_hub import record_name, refetch_hint, torch_hub_prefix

log = logging.getLogger("torchverity.checkpoint")


def _load_file(p: Path, map_location: Any, policy: SidecarPolicy, trust_sha256: str | None,
               mmap: bool, recheck_tensors: bool = False,
               signed: ExpectedDigest | None = None) -> tuple[Any, LoadReport]:
    notes = []
    foreign = foreign_format(p) if p.is_file() else None
    if foreign is not None:  # what the file is comes before whether its digest is recorded
        raise foreign
    try:
        expected, meta, pending = current_expectation(p, policy)
    except IntegrityError as exc:
        raise joblib_error(p) or exc from None
    if pending:
        notes.append(f"{p}: its save was interrupted after the file was renamed; verified "
                     "against the pending records (the next save replaces them)")
    expected = signed or expected
    try:
        fmt = checkpoint_format(p)
    except FormatError:
        # Damage that hit the magic bytes is damage; a pointer or web page is a bad download.
        if p.stat().st_size and download_kind(p) is None:
            _check_digest(p, expected, None)
        raise
    if expected is None and policy == "warn":
        notes.append(_unverified_note(p))
    full_pickle = _trusted(p, trust_sha256)
    bound = _digest_binds_fingerprint(expected, meta) and not recheck_tensors
    if fmt == "safetensors":
        obj, digest, fp = _read_safetensors(p, expected, meta, hash_tensors=not bound)
        if map_location not in (None, "cpu", torch.device("cpu")):
            obj = {k: v.to(map_location) for k, v in obj.items()}
    else:
        obj, digest = _load_pt(p, fmt, expected, meta, map_location, full_pickle, mmap)
        fp = None
    fp_root = _check_fingerprint(p, obj, meta, fp, bound)
    _check_meta_size(p, meta)
    _check_meta_digest(p, meta, expected)
    if fp_root is None and policy == "warn":
        notes.append(f"{p}: no meta.json: the content fingerprint was not verified")
    report = LoadReport(
        path=os.fspath(p), format=fmt, algo=expected.algo if expected else None,
        digest=digest, digest_source=expected.source if expected else None, fingerprint=fp_root,
        fingerprint_verified=fp_root is not None, sidecar_policy=policy,
        fingerprint_check=None if fp_root is None else "bound" if bound else "rehashed",
        weights_only=not full_pickle, tensors=_count_tensors(obj), warnings=tuple(notes),
    )
    return obj, report


def current_expectation(p: Path, policy: SidecarPolicy
                        ) -> tuple[ExpectedDigest | None, dict[str, Any] | None, bool]:
    """``(expected digest, meta.json, pending)`` for ``p``, as :func:`resolve_records` reads them.

    A pending sidecar costs one extra digest pass, and only when it exists.
    """
    if policy == "ignore":
        return None, read_meta(p) if meta_path_for(p).exists() else None, False
    records = resolve_records(p)
    if records.pending and records.algo and records.hexdigest:
        return ExpectedDigest(records.algo, records.hexdigest, "sidecar"), records.meta, True
    meta = records.meta
    expected = _expected_digest(p, meta, policy, records) if p.is_file() else None
    return expected, meta, False


def _check_meta_digest(p: Path, meta: Mapping[str, Any] | None,
                       expected: ExpectedDigest | None) -> None:
    """meta.json's digest in another algorithm than the sidecar's: checked too (one more
    pass, only then), so a record made for other bytes is never taken for this file's."""
    recorded = recorded_digest(meta)
    if recorded is None or expected is None or recorded[0] == expected.algo:
        return
    actual = digest_file(p, recorded[0]).hexdigest
    if actual != recorded[1]:
        raise IntegrityError(
            f"{p}: meta.json records {recorded[0]} {recorded[1]}, the file's is {actual}: "
            "the record was made for other bytes", path=p, expected=recorded[1], actual=actual,
            hint=f"restore {p.name}.meta.json with its checkpoint; torchverity inspect "
                 f"{shell_path(p)}",
        )


def _check_meta_size(p: Path, meta: Mapping[str, Any] | None) -> None:
    """A meta.json that records another size describes another file (forged or misplaced)."""
    if meta is not None and meta["size"] != p.stat().st_size:
        raise IntegrityError(
            f"{p}: meta.json records {meta['size']} bytes, the file has {p.stat().st_size}: "
            "the record belongs to another file", path=p,
            hint=f"restore {p.name}.meta.json with its checkpoint; torchverity inspect "
                 f"{shell_path(p)}",
        )


def _expected_digest(p: Path, meta: Mapping[str, Any] | None, policy: SidecarPolicy,
                     records: Records | None = None) -> ExpectedDigest | None:
    """``(algo, hex, source)`` to check the file against, or None."""
    recorded = meta.get("digest") if meta else None
    if records is None and policy != "ignore":
        records = resolve_records(p)
    side = records.sidecar if records is not None and policy != "ignore" else None
    if side is not None and records is not None and records.algo and records.hexdigest:
        algo, hexd = records.algo, records.hexdigest
        if isinstance(recorded, dict) and recorded.get("algo") == algo \
                and recorded.get("hex") != hexd:
            raise IntegrityError(
                f"{p}: meta.json disagrees with the sidecar {side.name} "
                f"(meta.json records {recorded.get('hex')}, sidecar {hexd}): "
                "one of them belongs to another save", path=p, expected=hexd,
                actual=str(recorded.get("hex")),
                hint=f"torchverity verify {shell_path(p)}; restore the matching checkpoint, "
                     "sidecar and meta",
            )
        return ExpectedDigest(algo, hexd, "sidecar")
    listed = manifest_entry(p) if policy != "ignore" and p.is_file() else None
    if listed is not None:
        return ExpectedDigest(listed[0], listed[1], "manifest")
    if policy != "ignore" and (hub := _hub_record(p)) is not None:
        return hub
    if policy != "ignore" and (prefix := torch_hub_prefix(p)) is not None:
        return ExpectedDigest("sha256", prefix, "torch-hub", prefix=True)
    if policy == "require":
        raise IntegrityError(
            f"{p}: no sidecar ({p.name}.blake3), no entry in a manifest of its folder, and "
            "sidecar='require': refusing to load unverified bytes", path=p,
            hint=f"save with torchverity.save, or record the digest: {record_step(p)}",
        )
    if policy != "ignore" and isinstance(recorded, dict) and "hex" in recorded:
        return ExpectedDigest(str(recorded["algo"]), str(recorded["hex"]), "meta")
    return None


def _hub_record(p: Path) -> ExpectedDigest | None:
    from torchverity.provenance import hub_record

    found = hub_record(p)
    return ExpectedDigest(found[0], found[1], "hub") if found else None


def _digest_mismatch(p: Path, expected: ExpectedDigest, actual: str,
                     damaged: list[str]) -> IntegrityError:
    algo, want, source = expected.algo, expected.hex, expected.source
    where = (f"damaged tensor{'s' if len(damaged) > 1 else ''}: {', '.join(damaged[:10])}"
             if damaged else "the damage could not be tied to a tensor")
    record = {"sidecar": f"{p.name}.{algo}", "manifest": "its folder's manifest",
              "hub": "the name the Hugging Face hub gave it",
              "torch-hub": record_name(want),
              "signature": "its signature"}.get(source, f"{p.name}{META_SUFFIX}")
    return IntegrityError(
        f"{p}: {algo} digest does not match {record}: the file changed after it was saved "
        f"(expected {want}, got {actual}); {where}",
        path=p, expected=want, actual=actual, tensors=damaged,
        hint=refetch_hint(shell_path(p)) if source == "torch-hub" else (
            f"restore {p.name} from a verified copy; torchverity diff {shell_path(p)} "
            "<good copy> shows every changed value"),
    )


def _check_digest(p: Path, expected: ExpectedDigest | None,
                  meta: Mapping[str, Any] | None) -> str | None:
    if expected is None:
        return None
    actual = digest_file(p, expected.algo).hexdigest
    if not expected.matches(actual):
        raise _digest_mismatch(p, expected, actual, _damaged_tensors(p, meta))
    return actual


def _unverified_note(p: Path) -> str:
    found = unlisted(p)
    if found is None:
        return (f"{p}: no sidecar: the file's bytes were not verified "
                f"(write one with: torchverity hash --write {shell_path(p)})")
    manifest, check = found
    return (f"{p}: no sidecar, and the manifest {manifest} does not list it (added after the "
            f"manifest, or renamed): the file's bytes were not verified ({check})")


def _trusted(p: Path, trust_sha256: str | None) -> bool:
    if trust_sha256 is None:
        return False
    actual = require_sha256(
        p, trust_sha256, refusing="refusing a full-pickle load",
        hint="trust_sha256 must be the SHA-256 its publisher lists for this exact file; a "
             "different digest means a different file: get it again from the publisher")
    log.warning("loading %s with weights_only=False: caller trusts sha256 %s", p, actual)
    return True


def _load_pt(p: Path, fmt: FileFormat, expected: ExpectedDigest | None,
             meta: Mapping[str, Any] | None, map_location: Any, full_pickle: bool,
             mmap: bool) -> tuple[Any, str | None]:
    try:
        return _read_pt(p, fmt, expected, meta, map_location, full_pickle, mmap)
    except (FormatError, UnsafeFileError) as exc:
        # Asked only once torch failed: a scan of every file would slow each load.
        raise torch_cannot_read_error(p) or exc from None


def _read_pt(p: Path, fmt: FileFormat, expected: ExpectedDigest | None,
             meta: Mapping[str, Any] | None, map_location: Any, full_pickle: bool,
             mmap: bool) -> tuple[Any, str | None]:
    if expected is not None and fmt == "pt" and not (full_pickle or mmap):
        return _load_while_hashing(p, expected, meta, map_location)
    # A full pickle may run code: its bytes are verified before anything is unpickled.
    digest = _check_digest(p, expected, meta)
    refused = plain_pickle_error(p) if fmt == "pickle" else None
    if refused is not None:  # torch.load cannot read it: not even trust_sha256 runs it
        raise refused
    return _torch_load(p, fmt, map_location, full_pickle, mmap and fmt == "pt"), digest


def _load_while_hashing(p: Path, expected: ExpectedDigest,
                        meta: Mapping[str, Any] | None, map_location: Any) -> tuple[Any, str]:
    """One pass over the file: torch.load reads it through a reader that hashes it.

    The weights_only unpickler runs no code from the file, so it may read the
    bytes before their digest is known; nothing is returned unless it matches,
    and a file that fails to load is reported as damaged when its digest differs.
    """
    obj, failure, actual = load_while_hashing(
        p, expected.algo,
        lambda reader: torch.load(reader, map_location=map_location,  # type: ignore[arg-type]
                                  weights_only=True))
    if not expected.matches(actual):
        raise _digest_mismatch(p, expected, actual, _damaged_tensors(p, meta))
    if failure is not None:
        raise _load_failure(p, "pt", failure) from None
    return obj, actual


def _read_safetensors(p: Path, expected: ExpectedDigest | None,
                      meta: Mapping[str, Any] | None, hash_tensors: bool = True,
                      ) -> tuple[dict[str, torch.Tensor], str | None, Fingerprint | None]:
    """One pass: read tensors into place while hashing the file and (``hash_tensors``) each tensor.

    Without meta.json there is no fingerprint to compare with, so none is computed.
    """
    import torchverity.checkpoint._safetensors as st  # a .pt load never needs it

    try:
        header = st.read_header(p)
    except FormatError:
        _check_digest(p, expected, None)  # a damaged header is reported as damage
        raise
    file_hasher = new_hasher(expected.algo) if expected else None
    recorded = _meta_fingerprint(meta, meta_path_for(p)) if meta else None
    algo = exact_algo(recorded) if recorded else EXACT
    tensor_hashers = {e.name: tensor_hasher(e.name, e.dtype, e.shape, algo)
                      for e in header.entries} if hash_tensors and recorded else {}
    # A hash faster than the copy runs on this thread while a second core reads alongside;
    # a slower one (SHA-256) runs on a second core while this thread reads.
    split = cpu_count() > 1 and (expected is None or expected.algo in FASTER_THAN_COPY)
    pool = lane("load-read" if split else "load-hash")
    pending: list[Future[Any]] = []

    def feed(name: str, chunk: memoryview) -> None:
        # Beside: the file digest of a chunk runs on the pool while this thread hashes
        # the tensor and reads the next chunk: two cores, one read. A chunk's view
        # keeps its tensor alive until the pool is done with it.
        for f in pending:
            f.result()
        pending.clear()
        if file_hasher is not None:
            if split:
                file_hasher.update(chunk)
            else:
                pending.append(pool.submit(file_hasher.update, chunk))
        if name and tensor_hashers:
            tensor_hashers[name].update(chunk)

    try:
        tensors = st.read_tensors(p, header, feed, pool if split else None)
    finally:
        for f in pending:
            f.result()
    fp = from_entries(algo, [
        TensorDigest(e.name, dtype_name(e.dtype), e.shape, tensor_hashers[e.name].hexdigest())
        for e in header.entries
    ]) if tensor_hashers else None
    digest = file_hasher.hexdigest() if file_hasher else None
    if expected is not None and (digest is None or not expected.matches(digest)):
        damaged = (recorded.differing(fp) if recorded and fp
                   else _damaged_tensors(p, meta))
        raise _digest_mismatch(p, expected, str(digest), damaged)
    return tensors, digest, fp


def _digest_binds_fingerprint(expected: ExpectedDigest | None,
                              meta: Mapping[str, Any] | None) -> bool:
    """Whether the verified file digest is the one meta.json recorded beside its fingerprint.

    ``save`` computes both from the same tensors in one call, so bytes that
    match that digest are the bytes the fingerprint describes: hashing the
    loaded tensors again would only catch a fault in this machine's memory
    during the load (``recheck_tensors=True`` asks for that).
    """
    if expected is None or meta is None:
        return False
    recorded = meta.get("digest")
    return (isinstance(recorded, dict) and recorded.get("algo") == expected.algo
            and recorded.get("hex") == expected.hex)


def _check_fingerprint(p: Path, obj: Any, meta: Mapping[str, Any] | None,
                       computed: Fingerprint | None, bound: bool = False) -> str | None:
    if meta is None:
        return None
    recorded = _meta_fingerprint(meta, meta_path_for(p))
    if bound and computed is None:
        _check_layout(p, obj, recorded)
        return recorded.root
    actual = computed or fingerprint(obj, mode=exact_algo(recorded))
    bad = recorded.differing(actual)
    if bad:
        raise _content_mismatch(p, recorded, actual.tensors, bad)
    return actual.root


def _check_layout(p: Path, obj: Any, recorded: Fingerprint) -> None:
    """Names, dtypes, shapes and plain values against the record (tensor bytes not hashed)."""
    loaded, want = layout(obj), recorded.tensors
    bad = sorted(
        set(loaded) ^ set(want)
        | {n for n, e in loaded.items() if n in want and (
            (e.dtype, e.shape) != (want[n].dtype, want[n].shape)
            or (e.digest and e.digest != want[n].digest))}
    )
    if bad:
        raise _content_mismatch(p, recorded, loaded, bad)


def _content_mismatch(p: Path, recorded: Fingerprint, actual: Mapping[str, TensorDigest],
                      bad: list[str]) -> IntegrityError:
    first = bad[0]
    want, got = recorded.tensors.get(first), actual.get(first)
    return IntegrityError(
        f"{p}: content does not match {p.name}{META_SUFFIX}: {len(bad)} tensor(s) differ: "
        f"{', '.join(bad[:10])} (first: '{first}' expected "
        f"{_describe(want)}, got {_describe(got)})",
        path=p, expected=want.digest if want else None,
        actual=(got.digest or None) if got else None, tensors=bad,
        hint=f"restore {p.name} from a verified copy, or its meta.json if only that changed; "
             f"torchverity diff {shell_path(p)} <good copy>",
    )


def _damaged_tensors(p: Path, meta: Mapping[str, Any] | None) -> list[str]:
    """The tensors whose bytes differ from meta.json's record (none without meta.json)."""
    from torchverity.checkpoint._damage import _locate_pt_damage  # only once a digest differs

    return _locate_pt_damage(p, meta)


def _describe(entry: TensorDigest | None) -> str:
    if entry is None:
        return "no such entry"
    digest = f" digest {entry.digest[:16]}..." if entry.digest else ""
    return f"{entry.dtype}{list(entry.shape)}{digest}"
