"""Atomic, verified checkpoint save and load.

``save`` writes to a temporary file in the target's folder, hashes every byte
as it is written (no second pass over the file), fsyncs, renames over the
target and fsyncs the folder, so a process killed at any moment leaves either
the previous checkpoint or the new one, never a torn file. Next to the file it
writes ``FILE.sha256`` (a ``sha256sum`` line) and ``FILE.meta.json`` (versions,
seed, data digest, fingerprint, keys/shapes/dtypes and the caller's metadata;
see ``docs/formats/checkpoint.md``).

``load`` checks the file digest as it reads the file (once), loads with
``weights_only=True``, compares the content fingerprint with meta.json and,
given a model, checks keys, shapes and dtypes all at once. It never falls back
to ``weights_only=False``: full pickles load only when the caller names the
file's SHA-256 (``trust_sha256=``), and that is logged.

>>> import torch, torchverity
>>> report = torchverity.save({"w": torch.ones(2)}, "model.pt", meta={"step": 10})  # doctest: +SKIP
>>> state = torchverity.load("model.pt")                                          # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import json
import logging
import os
import platform
import secrets
import socket
import stat
import subprocess
import time
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from torchverity import _safetensors as st
from torchverity._hashing_reader import HashingReader
from torchverity.digest import (
    ALGORITHMS,
    DEFAULT_ALGO,
    FASTER_THAN_COPY,
    check_algo,
    digest_file,
    find_sidecar,
    format_sidecar_line,
    fsync_path,
    new_hasher,
    read_sidecar,
    sidecar_path,
)
from torchverity.errors import (
    CheckpointWriteError,
    FormatError,
    InputError,
    IntegrityError,
    StateDictMismatchError,
    UnsafeFileError,
    UsageError,
)
from torchverity.fingerprint import (
    EXACT,
    LEGACY_EXACT,
    Fingerprint,
    TensorDigest,
    dtype_name,
    fingerprint,
    fingerprint_file,
    from_entries,
    iter_leaves,
    layout,
    tensor_hasher,
)

log = logging.getLogger("torchverity.checkpoint")

META_FORMAT = "torchverity-checkpoint-meta"
META_VERSION = 1
META_SUFFIX = ".meta.json"
SidecarPolicy = Literal["warn", "require", "ignore"]
FileFormat = Literal["pt", "pt-legacy", "safetensors"]
_SMALL_WRITE = 1 << 20  # torch.save makes many tiny writes; batch them


class CheckpointWarning(UserWarning):
    """A checkpoint loaded, but something could not be verified (e.g. no sidecar)."""


@dataclass(frozen=True)
class SaveReport:
    """What ``save`` wrote. ``written`` is False on ranks that left writing to rank 0."""

    path: str
    algo: str
    digest: str
    fingerprint: str
    sidecar: str | None
    meta_path: str | None
    size: int = 0
    written: bool = True


@dataclass(frozen=True)
class LoadReport:
    """What ``load`` verified, and how."""

    path: str
    format: str
    algo: str | None
    digest: str | None
    digest_source: str | None  # "sidecar", "meta" or None when nothing was checked
    fingerprint: str | None
    fingerprint_verified: bool
    sidecar_policy: str
    weights_only: bool
    tensors: int
    model_checked: bool = False
    shards: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    # "rehashed": the loaded tensors were hashed and compared with meta.json;
    # "bound": the verified file digest is the one meta.json recorded with it.
    fingerprint_check: str | None = None

    @property
    def verified(self) -> bool:
        return self.digest_source is not None and self.fingerprint_verified


# ================================================================== formats


def meta_path_for(path: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(path)}{META_SUFFIX}")


def file_format(path: str | os.PathLike[str]) -> FileFormat:
    """What kind of checkpoint a file is, from its bytes (never its name alone)."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{p}: is a folder", path=p,
                         hint=f"folders load through their *.index.json: torchverity inspect {p}")
    try:
        size = p.stat().st_size
        with open(p, "rb") as fh:
            head = fh.read(16)
    except FileNotFoundError:
        raise InputError(f"{p}: no such file", path=p, hint="check the path") from None
    except OSError as exc:
        raise InputError(f"{p}: cannot read: {exc.strerror or exc}", path=p) from None
    if size == 0:
        raise FormatError(f"{p}: file is empty (0 bytes): not a checkpoint", path=p,
                          hint="the save that wrote it was probably interrupted; "
                               "restore the previous checkpoint")
    if head.startswith(b"PK\x03\x04"):
        return "pt"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "pt-legacy"
    if st.is_safetensors(p):
        return "safetensors"
    raise FormatError(
        f"{p}: not a checkpoint (neither a PyTorch zip/pickle nor .safetensors; "
        f"starts with {head[:8]!r})", path=p,
        hint=f"check the path; torchverity inspect {p} shows what torchverity sees",
    )


# ================================================================== save


class _StableMemory:
    """Address ranges of the CPU tensors being saved.

    ``save`` holds a reference to every one of them until it returns, so bytes
    inside them stay valid after ``write()`` returns and may be hashed later.
    """

    def __init__(self, payload: Any) -> None:
        ranges = set()
        for _, value in iter_leaves(payload):
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                storage = value.untyped_storage()
                if storage.nbytes():
                    ranges.add((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        self._starts, self._ends = [], []
        for start, end in sorted(ranges):
            self._starts.append(start)
            self._ends.append(end)

    def holds(self, view: memoryview) -> bool:
        import bisect

        import numpy as np

        addr = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
        i = bisect.bisect_right(self._starts, addr) - 1
        return i >= 0 and addr + len(view) <= self._ends[i]


class _HashingWriter:
    """A write-only file object that hashes every byte on its way to disk.

    The hash runs on its own thread, behind the writes, so it overlaps the
    serialization of the next storage instead of stalling it. Bytes inside the
    tensors being saved (see :class:`_StableMemory`) are queued by reference,
    small writes are gathered into buffers this writer owns; only a large
    write of memory owned by torch (e.g. a device tensor's temporary host
    copy, which may be freed when ``write`` returns) waits for its hash.
    One worker thread hashes in submission order.
    """

    def __init__(self, fd: int, hasher: Any, stable: _StableMemory,
                 pool: ThreadPoolExecutor) -> None:
        self._fd = fd
        self._hasher = hasher
        self._stable = stable
        self._pool = pool
        self._last: Future[Any] | None = None
        self._pending = bytearray()
        self.size = 0
        self.error: OSError | None = None  # torch.save replaces our OSError with its own

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        self.size += n
        if n < _SMALL_WRITE:
            self._pending += view
            if len(self._pending) >= _SMALL_WRITE:
                self.flush()
            return n
        self.flush()
        self._emit(view, wait=not self._stable.holds(view))
        return n

    def flush(self) -> None:
        if self._pending:
            owned, self._pending = self._pending, bytearray()
            self._emit(memoryview(owned), wait=False)

    def finish(self) -> None:
        """Write what is buffered and wait until every byte is hashed."""
        self.flush()
        if self._last is not None:
            self._last.result()

    def _emit(self, view: memoryview, wait: bool) -> None:
        self._last = self._pool.submit(self._hasher.update, view)
        try:
            _write_all(self._fd, view)
        except OSError as exc:
            self.error = exc
            raise
        finally:
            if wait:
                self._last.result()


def _write_all(fd: int, view: memoryview) -> None:
    while len(view):
        view = view[os.write(fd, view) :]


@dataclass
class _Staged:
    """A save in progress: the temp file's fd, the small companion files to publish
    and the files that describe the old checkpoint only (removed once it is replaced)."""

    fd: int
    companions: dict[Path, str]
    stale: tuple[Path, ...] = ()
    flushing: Future[None] | None = None  # an fsync of ``fd`` started early (its error counts)


@contextmanager
def _atomic_target(target: Path) -> Iterator[_Staged]:
    """Stage a temp file beside ``target``; on success publish it and its companions.

    Companions (sidecar, meta.json) are fully written and fsynced as
    ``.NAME.pending`` files *before* the checkpoint is renamed, then renamed
    after it. A crash between those renames leaves the new checkpoint with its
    records still pending; ``load`` finds them because they match the file's
    digest (see :func:`_pending_records`).
    """
    folder = target.parent
    if not folder.is_dir():
        raise InputError(f"{folder}: folder does not exist, cannot save {target.name}",
                         path=folder, hint=f"mkdir -p {folder}")
    old_mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else None
    if old_mode is not None:
        _drop_cached_pages(target)
    _sweep_stale_temps(target)
    temps: list[tuple[Path, Path]] = [(_temp_name(target), target)]
    staged = _Staged(-1, {})
    try:
        staged.fd = os.open(temps[0][0], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        yield staged
        if old_mode is not None:
            os.fchmod(staged.fd, old_mode)
        companions = [(pending_name(final), final) for final in staged.companions]
        temps.extend(companions)
        _sync_together(staged.fd, {tmp: staged.companions[final] for tmp, final in companions})
        if staged.flushing is not None:
            staged.flushing.result()  # a write-back error is reported to one fsync only
        os.close(staged.fd)
        staged.fd = -1
        for tmp, final in temps:
            os.replace(tmp, final)
        for old in staged.stale:
            old.unlink(missing_ok=True)
        fsync_path(folder)
    except OSError as exc:
        raise _write_error(target, exc, old_mode is not None) from None
    finally:
        if staged.fd >= 0:
            os.close(staged.fd)
        for tmp, _ in temps:
            tmp.unlink(missing_ok=True)


def _drop_cached_pages(path: Path) -> None:
    """Let the kernel drop the cached pages of the file this save replaces.

    They are freed at the rename anyway; freed first, they hold the new file's
    pages, instead of the page cache growing by a checkpoint's size (evicting
    other files, or on a VM faulting in memory the host had taken back).
    The file itself is untouched: a crash still leaves it intact.
    """
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass  # advice only
    finally:
        os.close(fd)


def _temp_prefix(final: Path) -> str:
    # The host name keeps a save on a shared file system from sweeping another
    # machine's temp file whose pid merely does not exist here.
    return f".{final.name}.tmp-{socket.gethostname()}-"


def _temp_name(final: Path) -> Path:
    return final.with_name(f"{_temp_prefix(final)}{os.getpid()}-{secrets.token_hex(4)}")


def pending_name(final: Path) -> Path:
    """Where a companion waits until the checkpoint is renamed (found by load after a crash)."""
    return final.with_name(f".{final.name}.pending")


def _sync_together(fd: int, companions: dict[Path, str]) -> None:
    """fsync ``fd`` and write and fsync every companion, all at once.

    Concurrent fsyncs share the file system's journal commits instead of
    paying one commit each, one after another.
    """
    with ThreadPoolExecutor(max_workers=1 + len(companions),
                            thread_name_prefix="torchverity-sync") as pool:
        jobs = [pool.submit(os.fsync, fd)]
        jobs += [pool.submit(_write_synced, path, text) for path, text in companions.items()]
        for job in jobs:
            job.result()


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _sweep_stale_temps(target: Path) -> None:
    """Remove temp files of earlier saves whose process died (kill -9, power loss)."""
    prefix = _temp_prefix(target)
    for tmp in target.parent.glob(f"{glob.escape(prefix)}*"):
        pid = tmp.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_error(target: Path, exc: OSError, existed: bool) -> CheckpointWriteError:
    reasons = {
        errno.ENOSPC: "the disk is full",
        errno.EDQUOT: "the disk quota is exceeded",
        errno.EFBIG: "the file is larger than this process may write",
        errno.EROFS: "the file system is read-only",
        errno.EACCES: "permission denied in the folder",
        errno.EPERM: "permission denied in the folder",
    }
    reason = reasons.get(exc.errno or 0, exc.strerror or str(exc))
    previous = (f"the previous {target.name} is intact" if existed
                else f"no file was created at {target}")
    return CheckpointWriteError(
        f"cannot save {target}: {reason}; {previous}", path=target, reason=reason,
        previous_intact=existed,
        hint="free space or fix the folder's permissions, then save again",
    )


def _writing_rank(all_ranks: bool) -> bool:
    dist = torch.distributed
    if all_ranks or not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_rank() == 0


def save(
    obj: Any,
    path: str | os.PathLike[str],
    *,
    meta: Mapping[str, Any] | None = None,
    seed: int | None = None,
    data: str | os.PathLike[str] | None = None,
    algo: str = DEFAULT_ALGO,
    all_ranks: bool = False,
    shard_bytes: int | None = None,
    shard_format: str = "safetensors",
) -> SaveReport:
    """Atomically save ``obj`` (.pt, or .safetensors for flat tensor maps) with sidecar and meta.

    ``meta`` is your own JSON-ready metadata (epoch, step, metrics, config).
    ``data`` names the training data: a file (its digest is recorded) or a
    folder (its manifest root). Under torch.distributed only rank 0 writes
    unless ``all_ranks=True`` (then give each rank its own path). With
    ``shard_bytes`` ``path`` is a folder that receives Hugging Face style
    shards (``shard_format`` safetensors or pt) and an index.
    """
    target = Path(path)
    check_algo(algo)
    user_meta = _json_ready(meta, "meta")
    if not _writing_rank(all_ranks):
        return SaveReport(os.fspath(target), algo, "", "", None, None, written=False)
    if shard_bytes is not None:
        from torchverity._sharded import save_sharded

        return save_sharded(obj, target, shard_bytes=shard_bytes, shard_format=shard_format,
                            meta=meta, seed=seed, data=data, algo=algo)
    fmt = "safetensors" if target.suffix == ".safetensors" else "pt"
    payload = st.check_writable(obj, target) if fmt == "safetensors" else obj
    _check_fingerprintable(payload, target)
    data_record = _data_record(data, algo) if data is not None else None
    sidecar, meta_file = sidecar_path(target, algo), meta_path_for(target)
    hasher = new_hasher(algo)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchverity-fp") as fp_pool, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchverity-hash") as pool, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchverity-sync") as sync_pool, \
            _atomic_target(target) as staged:
        # Three threads: torch serializes and writes, one thread hashes the
        # written bytes behind it, one fingerprints the tensors in memory.
        fp_future = fp_pool.submit(fingerprint, payload, mode="exact", workers=1)
        writer = _HashingWriter(staged.fd, hasher, _StableMemory(payload), pool)
        try:
            if fmt == "safetensors":
                st.write_tensors(payload, writer)
            else:
                torch.save(payload, writer)  # type: ignore[arg-type]
            writer.flush()
        except Exception:
            if writer.error is not None:
                raise writer.error from None
            raise
        # The disk flush starts while the hashes catch up and meta.json is
        # built; the fsync in _atomic_target then finds little left to do.
        staged.flushing = sync_pool.submit(os.fsync, staged.fd)
        writer.finish()
        digest, fp = hasher.hexdigest(), fp_future.result()
        record = meta_record(target, fmt, algo, digest, writer.size, fp, seed, data_record,
                              user_meta)
        staged.companions[sidecar] = format_sidecar_line(digest, target.name)
        staged.companions[meta_file] = json.dumps(record, indent=2) + "\n"
        # A sidecar of another algorithm describes the file being replaced.
        staged.stale = tuple(sidecar_path(target, a) for a in ALGORITHMS if a != algo)
    log.info("saved %s (%s %s, fingerprint %s)", target, algo, digest, fp.root)
    return SaveReport(os.fspath(target), algo, digest, fp.root, os.fspath(sidecar),
                      os.fspath(meta_file), writer.size)


def _check_fingerprintable(payload: Any, target: Path) -> None:
    """Refuse what the fingerprint (and a weights_only load) cannot hold, before writing."""
    whole = _whole_object(payload, "")
    if whole is not None:
        name, kind = whole
        raise FormatError(
            f"cannot save {target}: '{name or '<root>'}' is a whole {kind} object, which only "
            "an unsafe full-pickle load can read back", path=target,
            hint=f"save its state_dict() instead (e.g. {{'{name or 'model'}': "
                 f"{name.rsplit('.', 1)[-1] or 'model'}.state_dict()}})",
        )
    try:
        for _ in iter_leaves(payload):
            pass
    except FormatError as exc:
        raise FormatError(
            f"cannot save {target}: {exc.message}", path=target,
            hint="save tensors, state_dicts and plain values (what torch.load(weights_only="
                 "True) reads back); put other objects in meta=",
        ) from None


def _whole_object(obj: Any, prefix: str) -> tuple[str, str] | None:
    """The first module or optimizer object inside ``obj`` (not its state_dict)."""
    if isinstance(obj, torch.nn.Module):
        return prefix, "torch.nn.Module"
    if isinstance(obj, torch.optim.Optimizer):
        return prefix, "torch.optim.Optimizer"
    if isinstance(obj, Mapping):
        items: Any = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return None
    for key, value in items:
        found = _whole_object(value, f"{prefix}.{key}" if prefix else str(key))
        if found:
            return found
    return None


def _json_ready(value: Any, what: str) -> Any:
    if value is None:
        return None
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{what} must be JSON-ready (numbers, strings, lists, dicts): {exc}",
                         hint="convert tensors with .item() or .tolist() first") from None
    return value


def _data_record(data: str | os.PathLike[str], algo: str) -> dict[str, Any]:
    p = Path(data)
    if p.is_file():
        d = digest_file(p, algo)
        return {"path": os.fspath(p), "kind": "file", "algo": algo, "digest": d.hexdigest,
                "size": d.size}
    if p.is_dir():
        from torchverity.manifest import build_manifest

        m = build_manifest(p, algo)
        return {"path": os.fspath(p), "kind": "manifest", "algo": algo, "digest": m.root,
                "files": len(m.entries)}
    raise InputError(f"data={os.fspath(p)!r}: no such file or folder", path=p,
                     hint="pass the training data file or folder whose digest to record")


def environment() -> dict[str, Any]:
    """Versions and platform recorded in every meta.json."""
    from torchverity import __version__

    cuda = torch.version.cuda
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "torchverity": __version__,
        "torch": torch.__version__,
        "cuda": cuda,
        "cudnn": cudnn,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": _git_commit(os.getcwd()),
    }


@functools.lru_cache(maxsize=8)
def _git_commit(cwd: str) -> str | None:
    """HEAD of the repository around ``cwd``, asked once per folder: a process runs
    the code it imported, whatever later commits do to the checkout."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5, check=False, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def meta_record(target: Path, fmt: str, algo: str, digest: str, size: int, fp: Fingerprint,
                 seed: int | None, data: dict[str, Any] | None, user: Any) -> dict[str, Any]:
    """The ``FILE.meta.json`` document (docs/formats/checkpoint.md); its only writer."""
    return {
        "format": META_FORMAT,
        "version": META_VERSION,
        "file": target.name,
        "file_format": fmt,
        "size": size,
        "digest": {"algo": algo, "hex": digest},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": environment(),
        "seed": seed,
        "data": data,
        "fingerprint": fp.to_dict(),
        "user": user,
    }


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check ``FILE.meta.json`` (pass the checkpoint or the meta file)."""
    p = Path(path)
    return _read_meta_file(p if p.name.endswith(META_SUFFIX) else meta_path_for(p))


def _read_meta_file(mp: Path) -> dict[str, Any]:
    try:
        data = json.loads(mp.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{mp}: no such file", path=mp,
                         hint="torchverity.save writes it next to every checkpoint") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"{mp}: not valid JSON: {exc}", path=mp,
                          hint="restore it from the checkpoint's copy, or re-save the "
                               "checkpoint with torchverity.save") from None
    if not isinstance(data, dict) or data.get("format") != META_FORMAT:
        raise FormatError(f"{mp}: not a torchverity meta.json (no format '{META_FORMAT}')",
                          path=mp, hint="move the foreign file away; torchverity.save writes "
                                        "its own NAME.meta.json")
    if data.get("version") != META_VERSION:
        raise FormatError(f"{mp}: meta.json version {data.get('version')!r} is not supported",
                          path=mp, hint="upgrade torchverity")
    return data


def _meta_fingerprint(meta: Mapping[str, Any], mp: Path) -> Fingerprint:
    try:
        return Fingerprint.from_dict(meta["fingerprint"])
    except (KeyError, FormatError) as exc:
        raise FormatError(f"{mp}: fingerprint record is damaged: {exc}", path=mp,
                          hint="restore meta.json, or re-save the checkpoint") from None


# ================================================================== load


def load(
    path: str | os.PathLike[str],
    *,
    map_location: Any = "cpu",
    model: torch.nn.Module | None = None,
    sidecar: SidecarPolicy = "warn",
    trust_sha256: str | None = None,
    with_report: bool = False,
    mmap: bool = False,
    recheck_tensors: bool = False,
) -> Any:
    """Load a checkpoint (file or HF-style sharded folder) after verifying it.

    Returns the object, or ``(obj, LoadReport)`` with ``with_report=True``.
    With ``model`` the state is checked against it (all problems at once) and
    loaded into it. The file is hashed as it is read (one pass); when its
    digest is the one meta.json recorded with the fingerprint, that digest
    vouches for the content and the tensors are not hashed a second time:
    ``recheck_tensors=True`` hashes them anyway, which also catches a fault in
    this machine's memory during the load.
    """
    if sidecar not in ("warn", "require", "ignore"):
        raise UsageError(f"unknown sidecar policy '{sidecar}'", hint="use warn, require or ignore")
    p = Path(path)
    if p.is_dir():
        from torchverity._sharded import load_sharded

        obj, report = load_sharded(p, map_location=map_location, sidecar=sidecar, mmap=mmap,
                                   recheck_tensors=recheck_tensors)
    else:
        obj, report = _load_file(p, map_location, sidecar, trust_sha256, mmap, recheck_tensors)
    if model is not None:
        check_against_model(obj, model, p)
        report = _replace(report, model_checked=True)
    for text in report.warnings:
        warnings.warn(text, CheckpointWarning, stacklevel=2)
    return (obj, report) if with_report else obj


def _replace(report: LoadReport, **changes: Any) -> LoadReport:
    import dataclasses

    return dataclasses.replace(report, **changes)


def _load_file(p: Path, map_location: Any, policy: SidecarPolicy, trust_sha256: str | None,
               mmap: bool, recheck_tensors: bool = False) -> tuple[Any, LoadReport]:
    notes = []
    expected: tuple[str, str, str] | None
    pending = _pending_records(p) if policy != "ignore" else None
    if pending is not None:
        expected, meta = pending
        notes.append(f"{p}: its save was interrupted after the file was renamed; verified "
                     "against the pending records (the next save replaces them)")
    else:
        meta = read_meta(p) if meta_path_for(p).exists() else None
        expected = _expected_digest(p, meta, policy) if p.is_file() else None
    try:
        fmt = file_format(p)
    except FormatError:
        if p.stat().st_size:  # damage that hit the magic bytes is damage
            _check_digest(p, expected, None)
        raise
    if expected is None and policy == "warn":
        notes.append(f"{p}: no sidecar: the file's bytes were not verified "
                     f"(write one with: torchverity hash --write {p})")
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
    if fp_root is None and policy == "warn":
        notes.append(f"{p}: no meta.json: the content fingerprint was not verified")
    report = LoadReport(
        path=os.fspath(p), format=fmt, algo=expected[0] if expected else None,
        digest=digest, digest_source=expected[2] if expected else None, fingerprint=fp_root,
        fingerprint_verified=fp_root is not None, sidecar_policy=policy,
        fingerprint_check=None if fp_root is None else "bound" if bound else "rehashed",
        weights_only=not full_pickle, tensors=_count_tensors(obj), warnings=tuple(notes),
    )
    return obj, report


def _pending_records(p: Path) -> tuple[tuple[str, str, str], dict[str, Any] | None] | None:
    """The records of an interrupted save, if they describe the file now at ``p``.

    Costs one extra digest pass, and only when ``.NAME.<algo>.pending`` exists.
    """
    for algo in ALGORITHMS:
        side = pending_name(sidecar_path(p, algo))
        if not side.is_file() or not p.is_file():
            continue
        hexd = _first_word(side)
        if hexd is None or digest_file(p, algo).hexdigest != hexd:
            return None  # a save that died before its rename: the old records stand
        mp = pending_name(meta_path_for(p))
        return (algo, hexd, "sidecar"), _read_meta_file(mp) if mp.is_file() else None
    return None


def _first_word(path: Path) -> str | None:
    try:
        words = path.read_text(encoding="utf-8").split()
    except (OSError, UnicodeDecodeError):
        return None
    return words[0].lower() if words else None


def _expected_digest(p: Path, meta: Mapping[str, Any] | None,
                     policy: SidecarPolicy) -> tuple[str, str, str] | None:
    """``(algo, hex, source)`` to check the file against, or None."""
    recorded = meta.get("digest") if meta else None
    side = _sidecar_for(p, recorded) if policy != "ignore" else None
    if side is not None:
        algo, hexd, _ = read_sidecar(side)
        if isinstance(recorded, dict) and recorded.get("algo") == algo \
                and recorded.get("hex") != hexd:
            raise IntegrityError(
                f"{p}: meta.json disagrees with the sidecar {side.name} "
                f"(meta.json records {recorded.get('hex')}, sidecar {hexd}): "
                "one of them belongs to another save", path=p, expected=hexd,
                actual=str(recorded.get("hex")),
                hint=f"torchverity verify {p}; restore the matching checkpoint, sidecar and meta",
            )
        return algo, hexd, "sidecar"
    if policy == "require":
        raise IntegrityError(
            f"{p}: no sidecar ({p.name}.sha256) and sidecar='require': refusing to load "
            "unverified bytes", path=p,
            hint=f"save with torchverity.save, or record the digest: torchverity hash --write {p}",
        )
    if policy != "ignore" and isinstance(recorded, dict) and "hex" in recorded:
        return str(recorded["algo"]), str(recorded["hex"]), "meta"
    return None


def _sidecar_for(p: Path, recorded: Any) -> Path | None:
    """The sidecar of the algorithm meta.json records, else the first one found."""
    algo = recorded.get("algo") if isinstance(recorded, dict) else None
    if algo in ALGORITHMS and sidecar_path(p, algo).is_file():
        return sidecar_path(p, algo)
    return find_sidecar(p)


def _digest_mismatch(p: Path, expected: tuple[str, str, str], actual: str,
                     damaged: list[str]) -> IntegrityError:
    algo, want, source = expected
    where = (f"damaged tensor{'s' if len(damaged) > 1 else ''}: {', '.join(damaged[:10])}"
             if damaged else "the damage could not be tied to a tensor")
    record = f"{p.name}.{algo}" if source == "sidecar" else f"{p.name}{META_SUFFIX}"
    return IntegrityError(
        f"{p}: {algo} digest does not match {record}: the file changed after it was saved "
        f"(expected {want}, got {actual}); {where}",
        path=p, expected=want, actual=actual, tensors=damaged,
        hint=f"restore {p.name} from a verified copy; torchverity diff {p} <good copy> "
             "shows every changed value",
    )


def _check_digest(p: Path, expected: tuple[str, str, str] | None,
                  meta: Mapping[str, Any] | None) -> str | None:
    if expected is None:
        return None
    actual = digest_file(p, expected[0]).hexdigest
    if actual != expected[1]:
        raise _digest_mismatch(p, expected, actual, _locate_pt_damage(p, meta))
    return actual


def _locate_pt_damage(p: Path, meta: Mapping[str, Any] | None) -> list[str]:
    return locate_damage(p, meta) if meta is not None else []


def locate_damage(path: str | os.PathLike[str],
                  meta: Mapping[str, Any] | None = None) -> list[str]:
    """Name the tensors of a damaged checkpoint that differ from its meta.json.

    Used to say *where* a file whose digest no longer matches was hit. Reads
    .safetensors by streaming and .pt through PyTorch's restricted
    ``weights_only`` unpickler with memory-mapped storages, so nothing from
    the file runs. Returns ``[]`` when there is no usable meta.json or the
    damage hit the container itself (then no tensor can be named).
    """
    p = Path(path)
    try:
        meta = meta if meta is not None else read_meta(p)
        recorded = _meta_fingerprint(meta, meta_path_for(p))
        return recorded.differing(fingerprint_file(p, mode=_exact_algo(recorded)))
    except Exception:  # a damaged pickle or header: the file-level verdict stands alone
        return []


def _trusted(p: Path, trust_sha256: str | None) -> bool:
    if trust_sha256 is None:
        return False
    actual = digest_file(p, "sha256").hexdigest
    if actual != trust_sha256.lower():
        raise IntegrityError(
            f"{p}: sha256 is {actual}, not the trusted {trust_sha256}: refusing a full-pickle load",
            path=p, expected=trust_sha256.lower(), actual=actual,
            hint="trust_sha256 must name this exact file; torchverity inspect shows its digest",
        )
    log.warning("loading %s with weights_only=False: caller trusts sha256 %s", p, actual)
    return True


def _load_pt(p: Path, fmt: FileFormat, expected: tuple[str, str, str] | None,
             meta: Mapping[str, Any] | None, map_location: Any, full_pickle: bool,
             mmap: bool) -> tuple[Any, str | None]:
    if expected is not None and fmt == "pt" and not (full_pickle or mmap):
        return _load_while_hashing(p, expected, meta, map_location)
    # A full pickle may run code: its bytes are verified before anything is unpickled.
    digest = _check_digest(p, expected, meta)
    return _torch_load(p, fmt, map_location, full_pickle, mmap and fmt == "pt"), digest


def _load_while_hashing(p: Path, expected: tuple[str, str, str],
                        meta: Mapping[str, Any] | None, map_location: Any) -> tuple[Any, str]:
    """One pass over the file: torch.load reads it through a reader that hashes it.

    The weights_only unpickler runs no code from the file, so it may read the
    bytes before their digest is known; nothing is returned unless it matches,
    and a file that fails to load is reported as damaged when its digest differs.
    """
    failure: Exception | None = None
    obj: Any = None
    inline = expected[0] in FASTER_THAN_COPY
    with (contextlib.nullcontext() if inline else
          ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchverity-load")) as pool:
        reader = HashingReader(p, new_hasher(expected[0], threads=True), pool)
        try:
            obj = torch.load(reader, map_location=map_location,  # type: ignore[arg-type]
                             weights_only=True)
        except Exception as exc:  # judged below, once the digest says whether it is damage
            failure = exc
        finally:
            actual = reader.hexdigest()
            reader.close()
    if actual != expected[1]:
        raise _digest_mismatch(p, expected, actual, _locate_pt_damage(p, meta))
    if failure is not None:
        raise _load_failure(p, "pt", failure) from None
    return obj, actual


def _torch_load(p: Path, fmt: FileFormat, map_location: Any, full_pickle: bool,
                mmap: bool) -> Any:
    try:
        return torch.load(p, map_location=map_location, weights_only=not full_pickle, mmap=mmap)
    except Exception as exc:
        raise _load_failure(p, fmt, exc) from None


def _load_failure(p: Path, fmt: FileFormat, exc: Exception) -> Exception:
    import zipfile

    if fmt == "pt" and not zipfile.is_zipfile(p):
        return FormatError(
            f"{p}: damaged or truncated PyTorch zip archive (its central directory, written "
            "last, is missing: the save was interrupted or the copy is partial)", path=p,
            hint=f"restore a good copy; torchverity verify {p} checks it against its sidecar",
        )
    return _explained_load_error(p, exc)


def _explained_load_error(p: Path, exc: Exception) -> Exception:
    from torchverity.pickles._explain import explain_exception, with_file

    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {first}"
    hint = f"torchverity inspect {p}"
    explanation = explain_exception(exc)
    if explanation is not None:
        explanation = with_file(explanation, os.fspath(p))
        text = f"{text} (likely cause: {explanation.cause.rstrip('.')})"
        hint = f"{explanation.fix.rstrip('.')}; check with: {explanation.command}"
    if "weights_only" in str(exc) or "Unsupported global" in str(exc):
        return UnsafeFileError(
            f"{p}: refused by the weights_only loader: {text}", path=p,
            hint=f"torchverity scan {p}; if you trust this exact file, pass "
                 "trust_sha256=<its sha256> (torchverity inspect shows it)",
        )
    return FormatError(f"{p}: cannot load: {text}", path=p, hint=hint)


def _read_safetensors(p: Path, expected: tuple[str, str, str] | None,
                      meta: Mapping[str, Any] | None, hash_tensors: bool = True,
                      ) -> tuple[dict[str, torch.Tensor], str | None, Fingerprint | None]:
    """One pass: read tensors into place while hashing the file and (``hash_tensors``) each tensor.

    Without meta.json there is no fingerprint to compare with, so none is computed.
    """
    try:
        header = st.read_header(p)
    except FormatError:
        _check_digest(p, expected, None)  # a damaged header is reported as damage
        raise
    file_hasher = new_hasher(expected[0]) if expected else None
    recorded = _meta_fingerprint(meta, meta_path_for(p)) if meta else None
    algo = _exact_algo(recorded) if recorded else EXACT
    tensor_hashers = {e.name: tensor_hasher(e.name, e.dtype, e.shape, algo)
                      for e in header.entries} if hash_tensors and recorded else {}
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchverity-load") as pool:
        pending: list[Future[Any]] = []

        def feed(name: str, chunk: memoryview) -> None:
            # The file digest of a chunk runs on the pool while this thread hashes
            # the tensor and reads the next chunk: two cores, one read. A chunk's
            # view keeps its tensor alive until the pool is done with it.
            for f in pending:
                f.result()
            pending.clear()
            if file_hasher is not None:
                pending.append(pool.submit(file_hasher.update, chunk))
            if name and tensor_hashers:
                tensor_hashers[name].update(chunk)

        tensors = st.read_tensors(p, header, feed)
        for f in pending:
            f.result()
    fp = from_entries(algo, [
        TensorDigest(e.name, dtype_name(e.dtype), e.shape, tensor_hashers[e.name].hexdigest())
        for e in header.entries
    ]) if tensor_hashers else None
    digest = file_hasher.hexdigest() if file_hasher else None
    if expected is not None and digest != expected[1]:
        damaged = (recorded.differing(fp) if recorded and fp
                   else _locate_pt_damage(p, meta))
        raise _digest_mismatch(p, expected, str(digest), damaged)
    return tensors, digest, fp


def _digest_binds_fingerprint(expected: tuple[str, str, str] | None,
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
    return (isinstance(recorded, dict) and recorded.get("algo") == expected[0]
            and recorded.get("hex") == expected[1])


def _check_fingerprint(p: Path, obj: Any, meta: Mapping[str, Any] | None,
                       computed: Fingerprint | None, bound: bool = False) -> str | None:
    if meta is None:
        return None
    recorded = _meta_fingerprint(meta, meta_path_for(p))
    if bound and computed is None:
        _check_layout(p, obj, recorded)
        return recorded.root
    actual = computed or fingerprint(obj, mode=_exact_algo(recorded))
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
             f"torchverity diff {p} <good copy>",
    )


def _exact_algo(recorded: Fingerprint) -> str:
    """The algorithm to rebuild ``recorded`` with on the host (older records say sha256)."""
    return recorded.algo if recorded.algo in (EXACT, LEGACY_EXACT) else EXACT


def _describe(entry: TensorDigest | None) -> str:
    if entry is None:
        return "no such entry"
    digest = f" digest {entry.digest[:16]}..." if entry.digest else ""
    return f"{entry.dtype}{list(entry.shape)}{digest}"


def _count_tensors(obj: Any) -> int:
    try:
        return sum(1 for _, v in iter_leaves(obj) if isinstance(v, torch.Tensor))
    except FormatError:
        return 0


def read_unverified(path: str | os.PathLike[str]) -> Any:
    """Open a checkpoint file or sharded folder for inspection, without verifying it.

    Nothing from the file executes: .pt files go through PyTorch's restricted
    ``weights_only`` unpickler, .safetensors through the strict header parser.
    Storages are memory-mapped where the format allows, so large files are
    read only as far as they are used.
    """
    p = Path(path)
    if p.is_dir():
        from torchverity._sharded import find_index, read_index

        index = find_index(p)
        merged: dict[str, Any] = {}
        for shard in sorted(set(read_index(index).values())):
            if not (p / shard).is_file():
                raise IntegrityError(f"{index}: shard {shard} does not exist", path=index,
                                     hint=f"torchverity inspect {p}")
            merged.update(state_dict_of(read_unverified(p / shard)))
        return merged
    fmt = file_format(p)
    if fmt == "safetensors":
        return st.map_tensors(p, st.read_header(p))
    return _torch_load(p, fmt, "cpu", False, fmt == "pt")


# ================================================================== model check


def state_dict_of(obj: Any) -> Mapping[str, Any]:
    """The model weights inside a checkpoint: the object itself or its
    ``state_dict`` / ``model`` / ``model_state_dict`` entry."""
    if isinstance(obj, Mapping):
        if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            return obj
        for key in ("state_dict", "model_state_dict", "model"):
            inner = obj.get(key)
            if isinstance(inner, Mapping):
                return inner
        return obj
    raise FormatError(f"checkpoint holds a {type(obj).__name__}, not a state_dict",
                      hint="save model.state_dict() instead of the model object")


def check_against_model(obj: Any, model: torch.nn.Module, path: Path) -> None:
    """Report every missing, unexpected, reshaped or retyped key at once, then load."""
    state = state_dict_of(obj)
    want = model.state_dict()
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want))
    mismatched = []
    for name in sorted(set(want) & set(state)):
        w, g = want[name], state[name]
        if not isinstance(g, torch.Tensor):
            mismatched.append({"name": name, "expected": "tensor", "actual": type(g).__name__})
        elif w.shape != g.shape or w.dtype != g.dtype:
            mismatched.append({"name": name,
                               "expected": f"{dtype_name(w.dtype)}{list(w.shape)}",
                               "actual": f"{dtype_name(g.dtype)}{list(g.shape)}"})
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing: {', '.join(missing[:10])}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected: {', '.join(unexpected[:10])}")
        for m in mismatched[:10]:
            parts.append(f"'{m['name']}' is {m['actual']}, model expects {m['expected']}")
        raise StateDictMismatchError(
            f"{path}: checkpoint does not fit {type(model).__name__}: " + "; ".join(parts),
            path=path, missing=missing, unexpected=unexpected, mismatched=mismatched,
            hint=f"check the model config matches the one that saved it; "
                 f"torchverity inspect {path} lists the checkpoint's tensors",
        )
    model.load_state_dict(state, strict=True)
