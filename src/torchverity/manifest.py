"""Directory manifests: every regular file's relative path, size and digest.

Two on-disk forms (docs/formats.md):

``torchverity.manifest.json``
    Format name and version, the algorithm and its parameters, sorted entries
    and a root digest over the entries, so hand edits are detected and a
    verifier can rebuild every value.
``manifest-sha256.txt``
    ``<hex>  <path>`` lines, as BagIt and ``sha256sum -c`` use them.

Symlinks are never followed: writing skips them (and reports them), and
verifying rejects any manifest path that is absolute, contains ``..``, or
resolves through a link to a place outside the folder.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from torchverity.digest import (
    ALGORITHMS,
    DEFAULT_ALGO,
    HEX_LENGTH,
    atomic_write_text,
    check_algo,
    digest_files,
    format_sidecar_line,
    new_hasher,
)
from torchverity.errors import FormatError, InputError, shell_path
from torchverity.provenance._hub_paths import blob_link

MANIFEST_NAME = "torchverity.manifest.json"
SHA256SUM_NAME = "manifest-sha256.txt"
# The manifest's own JSON (MANIFEST_NAME), or sha256sum lines (SHA256SUM_NAME).
ManifestFormat = Literal["json", "sha256sum"]
FORMAT_NAME = "torchverity-manifest"
FORMAT_VERSION = 1
PARAMS = {"scope": "whole-file", "paths": "relative-posix", "order": "utf8-bytes"}
MANIFEST_FILES = frozenset({MANIFEST_NAME, SHA256SUM_NAME})
_HEX = re.compile(r"^[0-9a-f]+$")


@dataclass(frozen=True)
class ManifestEntry:
    """One file of a manifest: its path below the root, size and digest."""

    path: str
    size: int
    digest: str


@dataclass(frozen=True)
class Manifest:
    """A folder's recorded content. ``root`` is derived from the entries."""

    algo: str
    entries: tuple[ManifestEntry, ...]
    params: dict[str, str] = field(default_factory=lambda: dict(PARAMS))
    skipped: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()  # the tools' folders found at the top (TOOL_FOLDERS)

    @property
    def root(self) -> str:
        return root_digest(self.algo, self.entries)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "algorithm": self.algo,
            "params": self.params,
            "root": self.root,
            "files": [{"path": e.path, "size": e.size, "digest": e.digest} for e in self.entries],
        }


def root_digest(algo: str, entries: Iterable[ManifestEntry]) -> str:
    """Digest over ``<digest>  <size>  <path>`` lines of the sorted entries."""
    h = new_hasher(algo)
    h.update(f"{FORMAT_NAME}-v{FORMAT_VERSION}\n".encode())
    for e in sorted(entries, key=lambda e: e.path.encode()):
        h.update(f"{e.digest}  {e.size}  {e.path}\n".encode())
    return h.hexdigest()


# ------------------------------------------------------------ listing


def walk_files(root: Path, skip: Callable[[str], bool]) -> tuple[list[str], list[str]]:
    """Regular files under ``root`` as relative POSIX paths in UTF-8 byte order, and the
    symlinks, listed and never followed; a path ``skip`` accepts is left out (a folder
    with everything in it)."""
    files: list[str] = []
    links: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        base = Path(dirpath)
        for name in [*dirnames, *filenames]:
            full = base / name
            rel = full.relative_to(root).as_posix()
            if skip(rel):
                continue
            if full.is_symlink():
                links.append(rel)
            elif name in filenames and full.is_file():
                files.append(rel)
        dirnames[:] = [d for d in dirnames if not skip((base / d).relative_to(root).as_posix())]
    return sorted(files, key=str.encode), sorted(links, key=str.encode)


# The records of the tools that fetched a folder, not its content: version control keeps
# its own (and rewrites them on every command, `git status` included), and the hub's
# local_dir downloads keep theirs (rewritten on every download).
TOOL_FOLDERS = (".git", ".hg", ".svn", ".cache/huggingface")
_VCS = frozenset(TOOL_FOLDERS[:3])


def tool_records(rel: str) -> bool:
    """Whether a relative path lies in version control's folders (at any depth) or in the
    hub download records at the top."""
    hub = TOOL_FOLDERS[3]
    return (rel == hub or rel.startswith(hub + "/")
            or not _VCS.isdisjoint(rel.split("/")))


def list_files(root: Path) -> tuple[list[str], list[str]]:
    """Regular files under ``root`` but the manifests themselves and the tools' records,
    and skipped symlinks."""
    return walk_files(root, lambda rel: rel in MANIFEST_FILES or tool_records(rel))


def build_manifest(
    directory: str | os.PathLike[str],
    algo: str = DEFAULT_ALGO,
    *,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Hash every regular file under ``directory`` (threads; blake3 uses its own too)."""
    root = _existing_dir(directory)
    check_algo(algo)
    files, links = list_files(root)
    if not files:
        raise InputError(
            f"{root}: no regular files to record",
            path=root,
            hint="point torchverity manifest at the folder that holds your files",
        )
    digests = digest_files([root / f for f in files], algo, workers=workers, progress=progress)
    pairs = zip(files, digests, strict=True)
    entries = tuple(ManifestEntry(f, d.size, d.hexdigest) for f, d in pairs)
    left_out = tuple(t for t in TOOL_FOLDERS if os.path.lexists(root / t))
    return Manifest(algo=algo, entries=entries, skipped=tuple(links), left_out=left_out)


def write_manifest(
    directory: str | os.PathLike[str],
    algo: str | None = None,
    *,
    fmt: ManifestFormat = "json",
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Build and atomically write the manifest into ``directory``; ``algo`` defaults to
    BLAKE3, or SHA-256 for the sha256sum format."""
    algo = algo or ("sha256" if fmt == "sha256sum" else DEFAULT_ALGO)
    if fmt == "sha256sum" and algo != "sha256":
        raise InputError("the sha256sum format holds sha256 digests only", hint="drop --algo")
    manifest = build_manifest(directory, algo, progress=progress)
    root = Path(directory)
    if fmt == "json":
        atomic_write_text(root / MANIFEST_NAME, json.dumps(manifest.to_dict(), indent=2) + "\n")
    else:
        atomic_write_text(root / SHA256SUM_NAME, format_sha256sum(manifest.entries))
    return manifest


def format_sha256sum(entries: Sequence[ManifestEntry]) -> str:
    """``<hex>  <path>`` lines; paths percent-encode CR, LF and % as BagIt (RFC 8493) requires."""
    return "".join(format_sidecar_line(e.digest, bagit_encode(e.path)) for e in entries)


def bagit_encode(path: str) -> str:
    return path.replace("%", "%25").replace("\n", "%0A").replace("\r", "%0D")


def bagit_decode(path: str) -> str:
    return re.sub(r"%(25|0A|0D)", lambda m: chr(int(m[1], 16)), path, flags=re.IGNORECASE)


# ------------------------------------------------------------ reading


def find_manifest(directory: str | os.PathLike[str]) -> Path:
    root = _existing_dir(directory)
    for name in (MANIFEST_NAME, SHA256SUM_NAME):
        if (root / name).is_file():
            return root / name
    raise InputError(
        f"{root}: no manifest ({MANIFEST_NAME} or {SHA256SUM_NAME}) in this folder",
        path=root,
        hint=f"record one first: torchverity manifest {shell_path(root)}",
    )


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read either manifest form; a folder means the manifest inside it."""
    p = Path(path)
    if p.is_dir():
        p = find_manifest(p)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{p}: cannot read manifest: {exc}", path=p) from None
    if p.name == SHA256SUM_NAME or p.suffix == ".txt":
        return _parse_sha256sum(p, text)
    return _parse_json(p, text)


def _bad(p: Path, what: str) -> FormatError:
    return FormatError(
        f"{p}: invalid manifest: {what}",
        path=p,
        hint=f"re-create it from trusted files: torchverity manifest {shell_path(p.parent)}",
    )


def _parse_json(p: Path, text: str) -> Manifest:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _bad(p, f"not JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise _bad(p, "nested too deeply to be a manifest") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise _bad(p, f"'format' is not '{FORMAT_NAME}'")
    if type(data.get("version")) is not int or data["version"] != FORMAT_VERSION:
        raise _bad(p, f"unsupported version {data.get('version')!r}")
    algo = data.get("algorithm")
    if algo not in ALGORITHMS:
        raise _bad(p, f"unknown algorithm {algo!r} (known: {', '.join(ALGORITHMS)})")
    if data.get("params") != PARAMS:
        raise _bad(p, f"unsupported params {data.get('params')!r}")
    files = data.get("files")
    if not isinstance(files, list):
        raise _bad(p, "'files' is not a list")
    entries = tuple(_json_entry(p, algo, item) for item in files)
    _check_unique(p, entries)
    manifest = Manifest(algo=algo, entries=entries)
    if data.get("root") != manifest.root:
        raise _bad(p, "'root' does not match its entries (was the file edited?)")
    return manifest


def _json_entry(p: Path, algo: str, item: Any) -> ManifestEntry:
    try:
        path, size, digest = item["path"], item["size"], item["digest"]
    except (TypeError, KeyError):
        raise _bad(p, f"entry {item!r} lacks path/size/digest") from None
    if not isinstance(size, int) or size < 0 or not isinstance(path, str):
        raise _bad(p, f"entry {item!r} has a bad path or size")
    _check_hex(p, algo, digest, path)
    return ManifestEntry(check_relative_path(p, path), size, digest)


# Relative, normalized, no drive, backslash or NUL, no empty, "." or ".." part: a path
# check_relative_path's full test accepts as it is.
_PLAIN_PATH = re.compile(r"^(?![A-Za-z]:)[^/\\\0]+(?:/[^/\\\0]+)*$")
_UNNORMAL = re.compile(r"(?:^|/)\.\.?(?:/|$)")


def _parse_sha256sum(p: Path, text: str) -> Manifest:
    entries = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        digest, sep, path = line.partition("  ")
        if not sep:
            digest, sep, path = line.partition(" *")
        if not sep:
            raise _bad(p, f"line {n} is not '<hex>  <path>'")
        path = bagit_decode(path)
        _check_hex(p, "sha256", digest, path)
        entries.append(ManifestEntry(check_relative_path(p, path), -1, digest))
    if not entries:
        raise _bad(p, "no entries")
    _check_unique(p, entries)
    return Manifest(algo="sha256", entries=tuple(entries))


def _check_hex(p: Path, algo: str, digest: Any, path: str) -> None:
    if not isinstance(digest, str) or len(digest) != HEX_LENGTH[algo] or not _HEX.match(digest):
        raise _bad(p, f"digest for '{path}' is not {HEX_LENGTH[algo]} lowercase hex digits")


def _check_unique(p: Path, entries: Sequence[ManifestEntry]) -> None:
    seen: set[str] = set()
    for e in entries:
        if e.path in seen:
            raise _bad(p, f"'{e.path}' is listed twice")
        seen.add(e.path)


def check_relative_path(manifest: Path, path: str) -> str:
    """Reject paths that could leave the manifest's folder."""
    if _PLAIN_PATH.match(path) and not _UNNORMAL.search(path):
        return path  # what nearly every entry is, without a PurePosixPath per entry
    pure = PurePosixPath(path)
    if (
        not path
        or "\\" in path
        or "\0" in path
        or pure.is_absolute()
        or ".." in pure.parts
        or path != pure.as_posix()
        or re.match(r"^[A-Za-z]:", path)
    ):
        raise FormatError(
            f"{manifest}: path '{path}' escapes the folder or is not a normalized relative path",
            path=manifest,
            hint="manifests hold relative paths inside their folder; re-create it with "
            f"torchverity manifest {shell_path(manifest.parent)}",
        )
    return path


def resolve_inside(root: Path, rel: str, manifest: Path) -> Path:
    """``root/rel``, refusing any path that passes through a symlink, except a Hugging
    Face hub cache snapshot's own links into its repository's blobs (the hub stores every
    file of a download that way)."""
    real_root = root.resolve()
    real = (root / rel).resolve()
    if real != real_root / rel and not blob_link(root, rel):
        where = "inside" if real.is_relative_to(real_root) else "out of"
        raise FormatError(
            f"{manifest}: path '{rel}' goes through a symlink that leads {where} the folder; "
            "torchverity never follows links",
            path=manifest,
            hint="replace the link with the real file, then run torchverity manifest again",
        )
    return root / rel


def _existing_dir(directory: str | os.PathLike[str]) -> Path:
    root = Path(directory)
    if not root.exists():
        raise InputError(f"{root}: no such directory", path=root)
    if not root.is_dir():
        raise InputError(f"{root}: not a "
                         f"directory", path=root, hint=f"torchverity hash {shell_path(root)}")
    return root
