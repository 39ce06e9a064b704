"""Where a path sits in a Hugging Face hub layout, from its name and a few ``stat`` calls:
a cache snapshot (``models--ORG--NAME/snapshots/REV/...``) or a ``local_dir`` download
(``.cache/huggingface/download/PATH.metadata`` above it). Standard library only, so a
command can ask cheaply before it loads the hub checks.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath

REPO_PREFIXES = ("models--", "datasets--", "spaces--")
DOWNLOAD_RECORDS = Path(".cache") / "huggingface" / "download"
_BLOB_NAME = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")  # git blob SHA-1, SHA-256


def snapshot_of(p: Path) -> tuple[Path, str, str] | None:
    """``(repo, revision, rel)`` for a path under ``models--X/snapshots/REV/``, lexically."""
    parts = Path(os.path.abspath(p)).parts
    for i in range(len(parts) - 3, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith(REPO_PREFIXES):
            return Path(*parts[:i]), parts[i + 1], "/".join(parts[i + 2:])
    return None


def local_dir_of(p: Path) -> Path | None:
    absolute = Path(os.path.abspath(p))
    for folder in absolute.parents:
        rel = absolute.relative_to(folder).as_posix()
        if (folder / DOWNLOAD_RECORDS / f"{rel}.metadata").is_file():
            return folder
    return None


def in_hub_layout(p: Path) -> bool:
    """Whether ``p`` is a hub snapshot entry or a file of a ``local_dir`` download."""
    return snapshot_of(p) is not None or (p.is_file() and local_dir_of(p) is not None)


def blob_link(root: Path, rel: str) -> bool:
    """Whether ``root/rel`` is a hub cache snapshot's entry as the hub writes it: a link to
    a blob of its own repository's ``blobs/`` folder, reached from ``root`` through no
    other link. Whatever such a link leads to is the repository's own content, named by
    its digest, so a manifest may vouch for it."""
    path = root / rel
    found = snapshot_of(path)
    if found is None or not path.is_symlink():
        return False
    if path.parent.resolve() != root.resolve() / PurePosixPath(rel).parent:
        return False
    target = path.resolve()
    return (target.parent == found[0].resolve() / "blobs"
            and _BLOB_NAME.match(target.name) is not None)
