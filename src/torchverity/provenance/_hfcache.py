"""Hugging Face hub caches and ``local_dir`` downloads, re-hashed offline.

A hub cache (``HF_HOME/hub/models--ORG--NAME``) is content-addressed: each file
in ``blobs/`` is named by its SHA-256 (LFS and Xet files) or by its git blob
SHA-1 (``sha1(b"blob %d\\0" % size + data)``, small files), and each entry of
``snapshots/REV/`` is a relative symlink to one blob. Checking needs no network
and no token: every entry's link is read (never followed) and must lead to a
blob of this repository's own ``blobs/`` folder; that blob is hashed once
however many revisions share it, and its digest must equal its name.

A ``local_dir`` download keeps ``.cache/huggingface/download/PATH.metadata``
(commit, etag, timestamp); the etag is the file's SHA-256 or git blob SHA-1.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torchverity.digest import Hasher, hash_stream, new_hasher, open_for_reading
from torchverity.errors import InputError, IntegrityError, shell_path
from torchverity.provenance._hub_paths import (
    DOWNLOAD_RECORDS,
    REPO_PREFIXES,
    local_dir_of,
    snapshot_of,
)

HubStatus = Literal["ok", "damaged", "changed", "dangling", "outside", "missing", "unchecked"]
HUB_STATUSES: tuple[HubStatus, ...] = (
    "ok", "damaged", "changed", "dangling", "outside", "missing", "unchecked")
# Statuses that do not make a result fail: "unchecked" files have no name to check against.
_PASSING = frozenset({"ok", "unchecked"})
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SHA1 = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class HubEntry:
    """One file of one revision (or one ref / download record)."""

    repo: str
    revision: str
    path: str
    status: HubStatus
    blob: str | None = None
    algo: str | None = None
    actual: str | None = None
    size: int | None = None
    detail: str | None = None

    @property
    def ok(self) -> bool:
        return self.status in _PASSING

    def where(self) -> str:
        return f"{self.repo}@{self.revision[:12]}:{self.path}" if self.path else self.repo


@dataclass(frozen=True)
class HubResult:
    """The outcome for a hub cache, one repository, one snapshot or a local_dir download."""

    target: str
    kind: Literal["hub-cache", "hub-repo", "hub-snapshot", "local-dir"]
    entries: tuple[HubEntry, ...]
    record: str = "names given by the hub (blob names, download records)"

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.entries)

    @property
    def counts(self) -> dict[str, int]:
        counted = Counter(e.status for e in self.entries)
        return {s: counted.get(s, 0) for s in HUB_STATUSES}

    @property
    def problems(self) -> tuple[HubEntry, ...]:
        return tuple(e for e in self.entries if not e.ok)

    def revisions(self) -> dict[str, dict[str, int]]:
        """Per ``repo@revision``: counts of each status."""
        per: dict[str, Counter[str]] = {}
        for e in self.entries:
            per.setdefault(f"{e.repo}@{e.revision}", Counter())[e.status] += 1
        return {k: dict(v) for k, v in per.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target, "kind": self.kind, "record": self.record, "ok": self.ok,
            "counts": self.counts, "revisions": self.revisions(),
            "entries": [{k: v for k, v in vars(e).items() if v is not None}
                        for e in self.entries],
        }


# ------------------------------------------------------------------ hashing


def blob_algo(name: str) -> str | None:
    """``sha256`` or ``git-sha1`` from a blob name (or an etag); None if it is neither."""
    name = name.strip('"').lower()
    if _SHA256.match(name):
        return "sha256"
    return "git-sha1" if _SHA1.match(name) else None


def content_digest(path: Path, algo: str) -> tuple[str, int]:
    """The digest a hub name states: SHA-256 of the bytes, or their git blob SHA-1."""
    with open_for_reading(path) as fh:
        hasher: Hasher
        if algo == "git-sha1":
            hasher = hashlib.sha1(usedforsecurity=False)
            hasher.update(b"blob %d\0" % os.fstat(fh.fileno()).st_size)
        else:
            hasher = new_hasher(algo)
        try:
            size = hash_stream(fh, hasher)
        except OSError as exc:
            raise InputError(f"{path}: cannot read: {exc.strerror or exc}", path=path) from None
    return hasher.hexdigest(), size


def _hash_all(jobs: Iterable[tuple[Path, str]]) -> dict[Path, tuple[str, int] | None]:
    """Digest each (path, algo) once, in parallel threads (the hashes release the GIL)."""
    todo = sorted(set(jobs))
    workers = min(len(todo), os.cpu_count() or 1) or 1

    def one(job: tuple[Path, str]) -> tuple[str, int] | None:
        try:
            return content_digest(*job)
        except InputError:
            return None

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return {job[0]: got for job, got in zip(todo, pool.map(one, todo), strict=True)}


# ------------------------------------------------------------------ layout


def is_repo_folder(path: Path) -> bool:
    return path.name.startswith(REPO_PREFIXES) and (
        (path / "snapshots").is_dir() or (path / "blobs").is_dir())


def repo_id(repo: Path) -> str:
    kind, _, rest = repo.name.partition("--")
    return f"{kind[:-1]}:{rest.replace('--', '/')}"


@dataclass(frozen=True)
class _Link:
    """A snapshot entry of a Hugging Face cache and the repository it belongs to."""

    repo: Path
    revision: str
    rel: str
    entry: Path


def link_target(entry: Path, repo: Path) -> tuple[HubStatus | None, Path | None, str]:
    """Where a snapshot entry leads, judged from the link text alone (never followed).

    Returns ``(None, blob, "")`` for a link into this repository's ``blobs/``,
    else the refusing status, the blob it names when it stays inside (dangling), and why.
    """
    if not entry.is_symlink():
        return "unchecked", None, "a copied file, not a link: its blob name is unknown"
    text = os.readlink(entry)
    # Both sides absolute: a relative entry (a path typed from inside the cache) and an
    # absolute repo (from snapshot_of) name the same blobs/ folder.
    lexical = Path(os.path.abspath(os.path.join(entry.parent, text)))
    blobs = Path(os.path.abspath(repo / "blobs"))
    # huggingface_hub writes an absolute link when a relative one cannot be made.
    inside = lexical.parent == blobs or (
        os.path.isabs(text) and lexical.parent.resolve() == blobs.resolve())
    if not inside or (repo / "blobs").is_symlink():
        return "outside", None, f"link to {text} leaves this repository's blobs/ (not followed)"
    if lexical.is_symlink():
        return "outside", None, f"blob {lexical.name} is itself a link (not followed)"
    if not lexical.is_file():
        return "dangling", lexical, f"blob {lexical.name} is missing"
    return None, lexical, ""


def _snapshot_links(repo: Path, revision: str) -> list[_Link]:
    snap = repo / "snapshots" / revision
    links: list[_Link] = []
    for dirpath, dirnames, filenames in os.walk(snap, followlinks=False):
        base = Path(dirpath)
        for name in [*filenames, *(d for d in dirnames if (base / d).is_symlink())]:
            full = base / name
            links.append(_Link(repo, revision, full.relative_to(snap).as_posix(), full))
    return sorted(links, key=lambda link: link.rel.encode())


def _judge(link: _Link, digests: dict[Path, tuple[str, int] | None],
           plan: dict[Path, tuple[HubStatus | None, Path | None, str]]) -> HubEntry:
    status, blob, why = plan[link.entry]
    rid = repo_id(link.repo)
    if status is not None or blob is None:
        return HubEntry(rid, link.revision, link.rel, status or "unchecked",
                        blob.name if blob else None, detail=why or None)
    algo = blob_algo(blob.name)
    if algo is None:
        return HubEntry(rid, link.revision, link.rel, "unchecked", blob.name,
                        detail="blob name is neither a SHA-256 nor a git SHA-1")
    got = digests.get(blob)
    if got is None:
        return HubEntry(rid, link.revision, link.rel, "dangling", blob.name, algo,
                        detail=f"blob {blob.name} cannot be read")
    status = "ok" if got[0] == blob.name else "damaged"
    return HubEntry(rid, link.revision, link.rel, status, blob.name, algo, got[0], got[1])


def _missing_refs(repo: Path) -> list[HubEntry]:
    refs = repo / "refs"
    entries: list[HubEntry] = []
    if not refs.is_dir() or refs.is_symlink():
        return entries
    for ref in sorted(p for p in refs.rglob("*") if p.is_file() and not p.is_symlink()):
        commit = ref.read_text(encoding="utf-8", errors="replace").strip()
        if not (repo / "snapshots" / commit).is_dir():
            entries.append(HubEntry(repo_id(repo), commit, "", "missing",
                                    detail=f"ref {ref.relative_to(refs).as_posix()} names a "
                                    "revision with no snapshot folder"))
    return entries


def _check_links(links: list[_Link]) -> list[HubEntry]:
    plan = {link.entry: link_target(link.entry, link.repo) for link in links}
    jobs = [(blob, algo) for status, blob, _w in plan.values()
            if status is None and blob is not None and (algo := blob_algo(blob.name)) is not None]
    digests = _hash_all(jobs)
    return [_judge(link, digests, plan) for link in links]


def verify_hub_repo(repo: str | os.PathLike[str], revisions: Iterable[str] | None = None,
                    ) -> HubResult:
    """Every snapshot of a ``models--ORG--NAME`` folder (or the given revisions)."""
    root = Path(repo)
    names = list(revisions) if revisions is not None else _revisions(root)
    links = [link for rev in names for link in _snapshot_links(root, rev)]
    entries = _check_links(links) + (_missing_refs(root) if revisions is None else [])
    kind: Literal["hub-repo", "hub-snapshot"] = "hub-repo" if revisions is None else \
        "hub-snapshot"
    return HubResult(os.fspath(root), kind, tuple(entries))


def verify_hub_cache(cache: str | os.PathLike[str]) -> HubResult:
    """Every repository of a hub cache (``HF_HOME``, ``HF_HOME/hub`` or ``HF_HUB_CACHE``)."""
    root = Path(cache)
    hub = root / "hub" if (root / "hub").is_dir() else root
    repos = sorted(p for p in hub.iterdir() if is_repo_folder(p) and not p.is_symlink())
    links = [link for repo in repos for rev in _revisions(repo)
             for link in _snapshot_links(repo, rev)]
    entries = _check_links(links) + [e for repo in repos for e in _missing_refs(repo)]
    return HubResult(os.fspath(root), "hub-cache", tuple(entries))


def _revisions(repo: Path) -> list[str]:
    snaps = repo / "snapshots"
    if not snaps.is_dir() or snaps.is_symlink():
        return []
    return sorted(p.name for p in snaps.iterdir() if p.is_dir() and not p.is_symlink())


# ------------------------------------------------------------------ local_dir


def _read_record(record: Path) -> tuple[str, str, float] | None:
    try:
        lines = record.read_text(encoding="utf-8").splitlines()
        return lines[0].strip(), lines[1].strip().strip('"'), float(lines[2])
    except (OSError, UnicodeDecodeError, IndexError, ValueError):
        return None


def _local_entry(root: Path, record: Path, downloads: Path) -> tuple[HubEntry, Path | None]:
    rel = record.relative_to(downloads).as_posix().removesuffix(".metadata")
    name = os.fspath(root)
    parsed = _read_record(record)
    if parsed is None:
        return HubEntry(name, "", rel, "unchecked", detail=f"unreadable record {record}"), None
    commit, etag, _ts = parsed
    target = root / rel
    algo = blob_algo(etag)
    real_root = root.resolve()
    if target.is_symlink() or not target.resolve().is_relative_to(real_root):
        return HubEntry(name, commit, rel, "outside", etag, algo,
                        detail="a link, not the downloaded file (not followed)"), None
    if not target.is_file():
        return HubEntry(name, commit, rel, "missing", etag, algo), None
    if algo is None:
        return HubEntry(name, commit, rel, "unchecked", etag,
                        detail="etag is neither a SHA-256 nor a git SHA-1"), None
    return HubEntry(name, commit, rel, "ok", etag, algo), target


def _settle(entry: HubEntry, target: Path | None, got: tuple[str, int] | None,
            timestamp: float | None) -> HubEntry:
    import dataclasses

    if target is None or entry.algo is None:
        return entry
    if got is None:
        return dataclasses.replace(entry, status="missing", detail="cannot be read")
    if got[0] == entry.blob:
        return dataclasses.replace(entry, actual=got[0], size=got[1])
    edited = timestamp is not None and target.stat().st_mtime - 1 > timestamp
    return dataclasses.replace(
        entry, status="changed" if edited else "damaged", actual=got[0], size=got[1],
        detail="modified after the download" if edited else None)


def _check_records(found: list[tuple[Path, Path]]) -> list[HubEntry]:
    """For each ``(local_dir, record)``, the file it records against its etag."""
    pairs = [_local_entry(folder, record, folder / DOWNLOAD_RECORDS) for folder, record in found]
    digests = _hash_all((t, e.algo) for e, t in pairs if t is not None and e.algo)
    stamps = [_read_record(record) for _folder, record in found]
    return [_settle(e, t, digests.get(t) if t else None, stamp[2] if stamp else None)
            for (e, t), stamp in zip(pairs, stamps, strict=True)]


def verify_local_dir(local_dir: str | os.PathLike[str]) -> HubResult:
    """Each file of a ``local_dir`` download against its ``.metadata`` record's etag."""
    root = Path(local_dir)
    downloads = root / DOWNLOAD_RECORDS
    if not downloads.is_dir() or downloads.is_symlink():
        raise InputError(f"{root}: no {DOWNLOAD_RECORDS} records: not a local_dir download",
                         path=root, hint=f"torchverity manifest {shell_path(root)}")
    records = sorted(downloads.rglob("*.metadata"), key=lambda p: os.fspath(p).encode())
    return HubResult(os.fspath(root), "local-dir",
                     tuple(_check_records([(root, record) for record in records])))


# ------------------------------------------------------------------ detection


def hub_target(path: str | os.PathLike[str]) -> str | None:
    """Which hub layout ``path`` is: ``repo``, ``snapshot``, ``cache``, ``local-dir`` or None."""
    p = Path(path)
    if not p.is_dir() or p.is_symlink():
        return None
    if is_repo_folder(p):
        return "repo"
    if p.parent.name == "snapshots" and is_repo_folder(p.parent.parent):
        return "snapshot"
    hub = p / "hub" if (p / "hub").is_dir() else p
    if any(is_repo_folder(c) for c in hub.iterdir() if c.is_dir()):
        return "cache"
    return "local-dir" if (p / DOWNLOAD_RECORDS).is_dir() else None


def verify_hub_path(path: str | os.PathLike[str]) -> HubResult:
    """Verify a hub cache, one repository, one snapshot folder, or a local_dir download."""
    p = Path(path)
    kind = hub_target(p)
    if kind == "repo":
        return verify_hub_repo(p)
    if kind == "snapshot":
        return verify_hub_repo(p.parent.parent, [p.name])
    if kind == "cache":
        return verify_hub_cache(p)
    if kind == "local-dir":
        return verify_local_dir(p)
    raise InputError(f"{p}: not a Hugging Face hub cache, repository, snapshot or local_dir",
                     path=p, hint=f"torchverity verify {shell_path(p)}")


def hub_blob_check(path: str | os.PathLike[str]) -> HubEntry | None:
    """For a file inside a hub snapshot or local_dir download, its check; else None.

    Costs one hash pass over the file, and a few ``stat`` calls for any other path.
    """
    return hub_file_checks([Path(path)])[0]


def hub_file_checks(paths: Sequence[Path]) -> list[HubEntry | None]:
    """:func:`hub_blob_check` of each path, the files hashed once each in parallel threads:
    a snapshot link against its blob's name, a ``local_dir`` file against its download
    record's etag; None for a path that is neither (a plain file in a snapshot, a file with
    no download record)."""
    links: dict[int, _Link] = {}
    local: dict[int, tuple[Path, Path]] = {}
    for i, p in enumerate(paths):
        found = snapshot_of(p)
        if found is not None and p.is_symlink():
            links[i] = _Link(found[0], found[1], found[2], p)
        elif (folder := local_dir_of(p) if p.is_file() else None) is not None:
            local[i] = (folder, _record_of(folder, p))
    got: dict[int, HubEntry] = dict(zip(links, _check_links(list(links.values())),
                                        strict=True))
    got.update(zip(local, _check_records(list(local.values())), strict=True))
    return [got.get(i) for i in range(len(paths))]


def _record_of(folder: Path, path: Path) -> Path:
    """The download record of a file of the ``local_dir`` download ``folder``."""
    rel = Path(os.path.abspath(path)).relative_to(folder).as_posix()
    return folder / DOWNLOAD_RECORDS / f"{rel}.metadata"


def require_hub_blob(path: str | os.PathLike[str]) -> HubEntry | None:
    """:func:`hub_blob_check`, raising :class:`IntegrityError` when the file fails it."""
    entry = hub_blob_check(path)
    if entry is None or entry.ok:
        return entry
    found = snapshot_of(Path(path))
    where = os.fspath(found[0]) if found else os.fspath(path)
    raise IntegrityError(
        f"{path}: hub file {entry.where()} is {entry.status}"
        + (f": {entry.detail}" if entry.detail else "")
        + (f" (named {entry.blob}, content hashes to {entry.actual})" if entry.actual else ""),
        path=os.fspath(path), expected=entry.blob, actual=entry.actual,
        hint="delete the damaged file and download it again (huggingface-cli download "
             "--force-download), then check: torchverity verify "
             + where,
    )


def hub_record(path: str | os.PathLike[str]) -> tuple[str, str, str] | None:
    """``("sha256", name, "hub")`` for a hub file whose name is its SHA-256, for a loader
    that hashes while it reads; other hub files are checked here. None outside hub layouts.

    A snapshot link that leaves its repository's ``blobs/``, or leads nowhere, raises
    :class:`IntegrityError` before anything opens it.
    """
    p = Path(path)
    found = snapshot_of(p)
    if found is not None and p.is_symlink():
        status, blob, why = link_target(p, found[0])
        if status in ("outside", "dangling"):
            raise IntegrityError(f"{p}: hub snapshot entry refused: {why}", path=os.fspath(p),
                                 hint=f"torchverity verify {shell_path(found[0])}")
        if status is None and blob is not None and blob_algo(blob.name) == "sha256":
            return "sha256", blob.name, "hub"
    elif (folder := local_dir_of(p) if p.is_file() else None) is not None:
        entry, _target = _local_entry(folder, _record_of(folder, p), folder / DOWNLOAD_RECORDS)
        if entry.algo == "sha256" and entry.status == "ok" and entry.blob:
            return "sha256", entry.blob, "hub"
    require_hub_blob(p)
    return None
