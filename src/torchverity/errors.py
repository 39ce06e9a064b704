"""The exception hierarchy.

Every error torchverity raises derives from :class:`TorchVerityError`. Each
subclass carries the data a caller needs to act on it (``path``, expected,
actual, ...) and renders a message with three parts: what happened, where, and
what to do next (``hint``), ideally the ``torchverity`` command that checks it::

    TorchVerityError                 exit 2: the input could not be checked
    ├── UsageError                   arguments that cannot work
    ├── InputError                   missing or unreadable input
    ├── FormatError                  not the format it claims
    ├── MissingExtraError            an optional package is needed
    ├── CheckpointWriteError         a save could not finish; says if the old one is intact
    ├── BatchError                   a batch job cannot start or go on
    ├── DistributedTimeoutError      a collective did not complete: a rank died or hangs
    ├── ServiceError                 a model service refused a request or is unreachable
    └── CheckFailedError             exit 1: the check ran and the data is wrong
        ├── IntegrityError           bytes or content differ from the record
        │   ├── ManifestMismatchError  a file a model is built from is not the recorded one
        │   └── HubFileMismatchError   a file a model is built from is not the one the hub named
        ├── UnsafeFileError          a file would run code if unpickled
        ├── StateDictMismatchError   a checkpoint does not fit a model
        ├── TrainingAnomalyError     an anomaly under a ``stop`` policy
        └── ReplicaMismatchError     ranks that must agree disagree

``exit_code`` tells the CLI how to end: 1 when a check ran and failed, 2 when the
input could not be checked at all. The CLI ends with 3 only on an internal
error: a bug to report, never a verdict on the input.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3  # a bug in torchverity, never a verdict on the input


class TorchVerityError(Exception):
    """Root of every torchverity error."""

    exit_code: int = EXIT_USAGE
    path: str | None = None  # the file or folder concerned, when there is one

    def __init__(self, message: str, *, hint: str | None = None,
                 path: str | Path | None = None) -> None:
        self.message = message
        self.hint = hint
        if path is not None:
            self.path = str(path)
        super().__init__(self._render())

    def _render(self) -> str:
        if self.hint:
            return f"{self.message}\n  next: {self.hint}"
        return self.message

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description, used by ``--json`` output."""
        data: dict[str, Any] = {"error": type(self).__name__, "message": self.message}
        if self.hint:
            data["hint"] = self.hint
        for key, value in vars(self).items():
            if key in ("message", "hint", "args") or key.startswith("_"):
                continue
            data[key] = str(value) if isinstance(value, Path) else value
        return data


class UsageError(TorchVerityError):
    """The command or call was given arguments that cannot work."""


class InputError(TorchVerityError):
    """An input is missing or cannot be read."""


def shell_path(path: str | os.PathLike[str]) -> str:
    """``path`` as one word of a shell command in a hint (quoted only where it must be)."""
    import shlex

    return shlex.quote(os.fspath(path))


def restore_step(path: str | os.PathLike[str]) -> str:
    """The next step for a file whose bytes are damaged or cut short."""
    return ("restore the file from a good copy or download it again (torchverity verify "
            f"{shell_path(path)} tells a good copy when it has a sidecar or a manifest)")


def missing_path_hint(path: str | os.PathLike[str]) -> str:
    """The next step for a path that does not exist: the listing of the nearest folder
    that does (a dangling link named as one)."""
    p = Path(path)
    if p.is_symlink():
        return (f"it is a link to {os.readlink(p)}, which does not exist: restore that file "
                f"or fix the link (ls -l {shell_path(p)})")
    here = p.absolute().parent
    existing = next((d for d in (here, *here.parents) if d.is_dir()), None)
    if existing is None or existing == here:
        shown = p.parent if existing is not None else Path(".")
        return f"check the path; ls {shell_path(shown)} lists what is there"
    # Shown as given where possible: the nearest existing folder, relative if p was.
    shown = Path(os.path.relpath(existing)) if not p.is_absolute() else existing
    return (f"check the path: there is no folder {shell_path(p.parent)}; ls "
            f"{shell_path(shown)} lists the nearest one that exists")


def unreadable(path: str | Path, exc: OSError) -> InputError:
    """The error for a file that exists but cannot be read, with the step that fits why."""
    quoted = shell_path(path)
    hint = (f"check its permissions (ls -l {quoted}), or run as a user allowed to read it"
            if isinstance(exc, PermissionError) else
            f"check that {quoted} is a regular file on a healthy disk (the kernel log names I/O "
            "errors)")
    return InputError(f"{path}: cannot read: {exc.strerror or exc}", path=path, hint=hint)


def no_such_file(path: str | Path) -> InputError:
    """The error for a path with no file behind it; a symbolic link whose target is gone is
    named as one (an interrupted download leaves a Hugging Face cache entry like that)."""
    try:
        target = os.readlink(path)
    except OSError:  # not a link (or not there at all): nothing more to say
        return InputError(f"{path}: no such file", path=path, hint=missing_path_hint(path))
    return InputError(
        f"{path}: a symbolic link to {target}, which does not exist", path=path,
        hint="the file it points to is missing (an interrupted download or a moved cache): "
             "download it again, or point the link at the real file")


_NOT_REGULAR = {0o010000: "a named pipe (FIFO)", 0o140000: "a socket",
                0o020000: "a character device", 0o060000: "a block device"}


def not_regular(path: str | Path, mode: int) -> InputError:
    """The error for a path that is neither a regular file nor a folder: whatever writes to a
    pipe, socket or device decides its bytes, so no check of them holds, and reading one may
    block or never end."""
    kind = _NOT_REGULAR.get(mode & 0o170000, "not a regular file")
    return InputError(
        f"{path}: {kind}, not a regular file: its bytes come from whatever writes to it, so "
        "they cannot be checked (nothing was read from it)", path=path,
        hint=f"give the path of the file itself (ls -l {shell_path(path)} shows what is there)")


class FormatError(TorchVerityError):
    """A file exists but is not in the format it claims (sidecar, manifest, checkpoint...)."""


class MissingExtraError(TorchVerityError):
    """An optional dependency is needed for this feature."""

    def __init__(self, feature: str, extra: str, module: str) -> None:
        self.feature = feature
        self.extra = extra
        self.module = module
        super().__init__(
            f"{feature} needs the optional package '{module}', which is not installed",
            hint=f"pip install 'torchverity[{extra}]'",
        )


class CheckFailedError(TorchVerityError):
    """Base for errors that mean: the check ran and the data is not what it should be."""

    exit_code = EXIT_CHECK_FAILED


class IntegrityError(CheckFailedError):
    """Bytes or content differ from what was recorded."""

    def __init__(
        self,
        message: str,
        *,
        path: str | Path | None = None,
        expected: str | None = None,
        actual: str | None = None,
        tensors: Sequence[str] = (),
        hint: str | None = None,
    ) -> None:
        self.expected = expected
        self.actual = actual
        self.tensors = list(tensors)
        super().__init__(message, hint=hint, path=path)


class ManifestMismatchError(IntegrityError):
    """A file beside the weights that a model build reads (``config.json``, tokenizer
    files...) differs from its entry in the folder's manifest, or is missing."""

    def __init__(
        self,
        message: str,
        *,
        path: str | Path,
        manifest: str | Path,
        algo: str,
        expected: str,
        actual: str | None,
        hint: str | None = None,
    ) -> None:
        self.manifest = str(manifest)
        self.algo = algo
        self.status = "missing" if actual is None else "mismatched"
        super().__init__(message, path=path, expected=expected, actual=actual, hint=hint)


class HubFileMismatchError(IntegrityError):
    """A file a model build reads (``config.json``, tokenizer files...) in a Hugging Face
    hub snapshot or ``local_dir`` download is not the one the hub named: its content does
    not hash to its blob name or recorded etag, its blob is missing, or its link leaves the
    repository's ``blobs/``."""

    def __init__(
        self,
        message: str,
        *,
        path: str | Path,
        record: str | Path,
        algo: str | None,
        expected: str | None,
        actual: str | None,
        status: str,
        hint: str | None = None,
    ) -> None:
        self.record = str(record)
        self.algo = algo
        self.status = status
        super().__init__(message, path=path, expected=expected, actual=actual, hint=hint)


class UnsafeFileError(CheckFailedError):
    """A file would run code (or reach unknown globals) if unpickled."""

    def __init__(
        self,
        message: str,
        *,
        path: str | Path | None = None,
        globals_found: Sequence[str] = (),
        hint: str | None = None,
    ) -> None:
        self.globals_found = list(globals_found)
        super().__init__(message, hint=hint, path=path)


def require_extra(module: str, *, extra: str, feature: str) -> Any:
    """Import an optional dependency or raise :class:`MissingExtraError` naming the extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(feature, extra, module) from exc


class TrainingAnomalyError(CheckFailedError):
    """Training produced an anomaly under a ``stop`` policy."""

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        kind: str | None = None,
        values: dict[str, Any] | None = None,
        thresholds: dict[str, Any] | None = None,
        suspects: Sequence[str] = (),
        rank: int | None = None,
        hint: str | None = None,
    ) -> None:
        self.step = step
        self.kind = kind
        self.values = dict(values or {})
        self.thresholds = dict(thresholds or {})
        self.suspects = list(suspects)
        self.rank = rank
        super().__init__(message, hint=hint)


class StateDictMismatchError(CheckFailedError):
    """A checkpoint does not fit a model: missing, unexpected, reshaped or retyped entries."""

    def __init__(
        self,
        message: str,
        *,
        path: str | Path | None = None,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        mismatched: Sequence[dict[str, Any]] = (),
        hint: str | None = None,
    ) -> None:
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)
        super().__init__(message, hint=hint, path=path)


class CheckpointWriteError(TorchVerityError):
    """A save could not finish (disk full, read-only folder...); the old file is untouched."""

    def __init__(
        self,
        message: str,
        *,
        path: str | Path | None = None,
        reason: str = "",
        previous_intact: bool = True,
        hint: str | None = None,
    ) -> None:
        self.reason = reason
        self.previous_intact = previous_intact
        super().__init__(message, hint=hint, path=path)


class BatchError(TorchVerityError):
    """A batch job cannot start or go on: its output folder, journal or job fingerprint."""

    def __init__(
        self,
        message: str,
        *,
        out: str | Path | None = None,
        item: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.out = str(out) if out is not None else None
        self.item = item
        super().__init__(message, hint=hint)


class ReplicaMismatchError(CheckFailedError):
    """Ranks that must agree (replica parameters, reduced gradients, replays) disagree."""

    def __init__(
        self,
        message: str,
        *,
        kind: str,
        ranks: Sequence[int] = (),
        tensors: Sequence[str] = (),
        step: int | None = None,
        rank: int | None = None,
        hint: str | None = None,
    ) -> None:
        self.kind = kind
        self.ranks = list(ranks)
        self.tensors = list(tensors)
        self.step = step
        self.rank = rank
        super().__init__(message, hint=hint)


class DistributedTimeoutError(TorchVerityError):
    """A collective did not complete in time: a rank died or is stuck."""

    def __init__(
        self,
        message: str,
        *,
        operation: str,
        rank: int,
        missing_ranks: Sequence[int] = (),
        timeout: float | None = None,
        hint: str | None = None,
    ) -> None:
        self.operation = operation
        self.rank = rank
        self.missing_ranks = list(missing_ranks)
        self.timeout = timeout
        super().__init__(message, hint=hint)


class ServiceError(TorchVerityError):
    """A model service refused a request (problem+json answer) or could not be reached."""

    def __init__(
        self,
        message: str,
        *,
        url: str | None = None,
        status: int | None = None,
        problem_type: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.url = url
        self.status = status
        self.problem_type = problem_type
        super().__init__(message, hint=hint)
