"""Reading a checkpoint's tensors without verifying it (inspect, fingerprint), never running
its pickle.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from torchverity._formats import FileFormat, file_format, joblib_file_error
from torchverity._tensors import iter_leaves
from torchverity.checkpoint._model_fit import state_dict_of
from torchverity.errors import (
    FormatError,
    IntegrityError,
    TorchVerityError,
    UnsafeFileError,
    restore_step,
    shell_path,
)
from torchverity.pickles._file_format import checkpoint_format


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
    from torchverity.checkpoint._folders import resolve

    target = resolve(path)
    if target.index is not None:
        from torchverity.checkpoint._index import read_index

        index, folder = target.index, target.folder
        merged: dict[str, Any] = {}
        for shard in sorted(set(read_index(index).values())):
            if not (folder / shard).is_file():
                raise IntegrityError(f"{index}: shard {shard} does not exist", path=index,
                                     hint=f"copy it from the source, then torchverity verify "
                                          f"{folder}")
            merged.update(state_dict_of(read_unverified(folder / shard)))
        return merged
    from torchverity.pickles._limits import check_limits

    p = target.file
    check_limits(p)  # the scan's bounds, before any reader parses the file
    fmt = checkpoint_format(p)
    if fmt == "safetensors":
        import torchverity.checkpoint._safetensors as st

        return st.map_tensors(p, st.read_header(p))
    if fmt == "pickle":
        from torchverity.pickles._extract import inert_tensors
        from torchverity.pickles._scan import scan_file

        scan = scan_file(p)
        if scan.format != "torch-legacy":  # torch.load fails on it whatever it holds
            return inert_tensors(p, scan)
    try:
        return _torch_load(p, fmt, "cpu", False, fmt == "pt")
    except UnsafeFileError:
        # weights_only refuses its classes: read the tensors inertly (nothing runs either way)
        from torchverity.pickles._extract import inert_tensors

        return inert_tensors(p)


# What torch warns before weights_only refuses a file: that it would hand a TorchScript
# archive to torch.jit.load (it does not under weights_only) and that a pickle is protocol 4.
# The refusal says what the file is; the warnings only add misleading noise.
_REFUSAL_NOISE = ("'torch.load' received a zip file that looks like a TorchScript archive",
                  "Detected pickle protocol")


def _torch_load(p: Path, fmt: FileFormat, map_location: Any, full_pickle: bool,
                mmap: bool) -> Any:
    try:
        with warnings.catch_warnings():
            if not full_pickle:
                for text in _REFUSAL_NOISE:
                    warnings.filterwarnings("ignore", message=re.escape(text))
            return torch.load(p, map_location=map_location, weights_only=not full_pickle,
                              mmap=mmap)
    except Exception as exc:
        raise _load_failure(p, fmt, exc) from None


def _load_failure(p: Path, fmt: FileFormat, exc: Exception) -> Exception:
    import zipfile

    if fmt == "pt" and not zipfile.is_zipfile(p):
        return FormatError(
            f"{p}: damaged or truncated PyTorch zip archive (its central directory, written "
            "last, is missing: the save was interrupted or the copy is partial)", path=p,
            hint=restore_step(p),
        )
    return joblib_error(p) or _malformed_error(p) or _explained_load_error(p, exc)


def _malformed_error(p: Path) -> FormatError | None:
    """The scan's reason for a file it finds malformed (where its pickle breaks, at which
    offset), or None: torch's own error for such a file is often a bare EOFError."""
    from torchverity.pickles._scan import scan_file

    try:
        scan = scan_file(p)
    except TorchVerityError:
        return None
    if scan.verdict != "malformed":
        return None
    return FormatError(f"{p}: cannot read its pickle: {scan.reason}", path=p,
                       hint=restore_step(p))


def joblib_error(p: Path) -> FormatError | None:
    """The error naming a joblib file (a plain pickle of numpy arrays), or None: a scan tells
    them apart from other pickles, so only refusals and failures pay for it."""
    from torchverity.pickles._scan import scan_file

    try:
        if file_format(p) != "pickle" or scan_file(p).format != "joblib":
            return None
    except TorchVerityError:
        return None
    return joblib_file_error(p)


def _explained_load_error(p: Path, exc: Exception) -> Exception:
    from torchverity.pickles._explain import explain_exception, strip_ansi, with_file

    refused = "weights_only" in str(exc) or "Unsupported global" in str(exc)
    # torch names the first global it refused and guesses a custom class; a file whose
    # globals run commands needs other advice than "trust it".
    unsafe = unsafe_file_error(p) if refused else None
    if unsafe is not None:
        return unsafe
    message = strip_ansi(str(exc)).strip()  # torch bolds part of its weights_only message
    first = message.splitlines()[0] if message else ""
    text = f"{type(exc).__name__}: {first}"
    hint = f"torchverity inspect {shell_path(p)}"
    explanation = explain_exception(exc)
    if explanation is not None:
        explanation = with_file(explanation, os.fspath(p))
        # torch's own words go on to suggest weights_only=False: the cause replaces them.
        text = f"{type(exc).__name__}: {explanation.cause.rstrip('.')}"
        hint = f"{explanation.fix.rstrip('.')}; check with: {explanation.command}"
    if explanation is not None and explanation.key == "torchscript-weights-only":
        return UnsafeFileError(
            f"{p}: refused by the weights_only loader: {text}", path=p,
            hint=f"extract its tensors without running its code: {explanation.command} (then "
                 "load the new file); torch.jit.load runs the archive's code, and so does "
                 "trust_sha256, which hands the file to it",
        )
    if refused:
        return UnsafeFileError(
            f"{p}: refused by the weights_only loader: {text}", path=p,
            hint=f"torchverity scan {shell_path(p)} names what would run; {TRUST_STEP}",
        )
    return FormatError(f"{p}: cannot load: {text}", path=p, hint=hint)


# The digest to trust comes from whoever vouches for the file, never from the file itself.
TRUST_STEP = ("if its publisher vouches for this exact file, pass trust_sha256=<the SHA-256 they "
              "list> (torchverity hash --algo sha256 FILE prints this copy's, to compare)")


def plain_pickle_error(p: Path) -> TorchVerityError | None:
    """The refusal of a plain pickle (pickle.dump, joblib.dump): torch.load reads its first
    pickle as torch's magic number and fails ("Invalid magic number"), having run that
    pickle in a full load. Unsafe, joblib and other pickles each get their own; None for
    a file the scan reads as torch's legacy format (its magic number spelled unusually)."""
    from torchverity.pickles._scan import scan_file

    try:
        scan = scan_file(p)
    except TorchVerityError:
        return None
    if scan.format not in ("pickle", "joblib"):
        return None
    if scan.format == "joblib":
        return joblib_file_error(p)
    unsafe = unsafe_file_error(p, scan)
    if unsafe is not None:
        return unsafe
    path = shell_path(p)
    return FormatError(
        f"{p}: a plain pickle (pickle.dump), not a torch.save checkpoint: torch.load takes its "
        "first pickle for torch's magic number and fails ('Invalid magic number'), with or "
        "without weights_only", path=p,
        hint=f"torchverity inspect {path} lists its tensors and values without running it; "
             f"torchverity migrate {path} NEW.safetensors writes them to a file load reads "
             f"(torchverity scan {path} says what pickle.load would run)")


def torch_cannot_read_error(p: Path) -> FormatError | None:
    """The refusal of a torch file that no torch.load reads, weights_only or not (its
    persistent ids pickled as text, at protocol 0): trust_sha256 cannot help, migrate can.
    None for any other file, and for one the scan finds unsafe or malformed (their own
    errors say more)."""
    from torchverity.pickles._scan import scan_file

    try:
        scan = scan_file(p)
    except TorchVerityError:
        return None
    if scan.plan is None or not scan.plan.torch_cannot_read or not scan.ok:
        return None
    path = shell_path(p)
    return FormatError(
        f"{p}: torch.load cannot read this file, so trust_sha256 cannot help either: "
        f"{scan.plan.torch_cannot_read}", path=p,
        hint=f"torchverity migrate {path} NEW.safetensors converts it without running it (then "
             f"load the new file); torchverity inspect {path} lists its tensors")


def unsafe_file_error(p: Path, scan: Any = None) -> UnsafeFileError | None:
    """The refusal of a file the scan finds unsafe, naming its code-running globals, with
    the inert route as the next step; None for any other file. ``scan``: its scan, when
    the caller has made it."""
    from torchverity.pickles._dangerous import dangerous_globals, describe_globals, rescue_step
    from torchverity.pickles._scan import scan_file

    try:
        scan = scan or scan_file(p)
    except TorchVerityError:
        return None
    if scan.verdict != "unsafe":
        return None
    found = dangerous_globals(scan)
    return UnsafeFileError(
        f"{p}: refused by the weights_only loader: it names globals that run code or touch "
        f"the system: {describe_globals(found) or scan.reason}; a full load (trust_sha256) "
        "would run them", path=p, globals_found=list(found),
        hint=f"{rescue_step(scan)} (then load the new file); torchverity inspect "
             f"{shell_path(p)} lists them first",
    )
