"""Turn a legacy full-pickle checkpoint into a clean state_dict without running its code.

``migrate`` scans the file first (:mod:`torchverity.pickles._scan`), then
unpickles it with the *inert* reader of :mod:`torchverity.pickles._inert`: only
torch's weights_only allowlist and a few data types are resolved; every other
global becomes an inert placeholder. Storages are rebuilt from the archive's
raw records by that reader; neither ``torch.load`` nor ``torch.jit.load`` is
ever called, nested archives and TorchScript archives included. omegaconf
hyper-parameters come out as plain JSON (:mod:`torchverity.pickles._unwrap`).

The tensors come out as a flat state_dict: whole ``nn.Module`` objects give
the names ``model.state_dict()`` would, optimizer state is named after the
parameters it belongs to, and all other non-tensor data (epoch, config,
hyperparameters, Namespace) goes to meta.json as JSON, with tensors referred
to by name. The output is written by :func:`torchverity.save` (sidecar,
fingerprint, meta.json) and every tensor is read back and compared bit for bit.

A file the scan finds unsafe (globals that run commands, import or evaluate) is
migrated the same way: the reader never resolves those globals, so they stay
placeholders and never run; the result and the meta name them, so the output's
record says what the source would have run. Only malformed files are refused.
``trust_sha256`` (the file's SHA-256), when given, refuses any other bytes.
"""

from __future__ import annotations

import os
import shlex
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchverity.digest import DEFAULT_ALGO, check_sha256_hex
from torchverity.errors import (
    FormatError,
    InputError,
    IntegrityError,
    UsageError,
    restore_step,
    shell_path,
)
from torchverity.pickles._dangerous import MIGRATABLE, dangerous_globals
from torchverity.pickles._extract import Extractor, inert_load, inert_read
from torchverity.pickles._inert import Inert
from torchverity.pickles._scan import MALFORMED, ScanResult, next_step, scan_file

__all__ = ["Inert", "MigrateResult", "inert_load", "migrate"]

_BYTES_IN_META = 1 << 16


# ------------------------------------------------------------ checks


def _check_archive_crcs(path: Path) -> int:
    """CRC-32 of every stored tensor record against the archive (torch.load never checks)."""
    checked = 0
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if "/data/" not in info.filename or info.filename.endswith(".pkl"):
                    continue
                with archive.open(info) as fh:
                    # zipfile checks the CRC when the entry has been read to its end.
                    while fh.read(1 << 22):
                        pass
                checked += 1
    except (zipfile.BadZipFile, UnicodeDecodeError, EOFError) as exc:
        raise IntegrityError(
            f"{path}: tensor data in the archive is damaged: {exc}", path=path,
            hint=restore_step(path),
        ) from None
    return checked


def _writable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views and shared storages become compact copies (safetensors needs that); others stay."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        storage = t.untyped_storage()
        compact = (t.is_contiguous() and t.storage_offset() == 0
                   and storage.nbytes() == t.numel() * t.element_size())
        key = storage.data_ptr()
        out[name] = t if compact and key not in seen else t.contiguous().clone()
        seen.add(key)
    return out


def _verify_output(target: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    from torchverity._tensors import byte_view
    from torchverity.checkpoint._load import load

    loaded = load(target, sidecar="require")
    missing = sorted(set(tensors) - set(loaded))
    differ = [
        name for name, t in tensors.items()
        if name in loaded and (loaded[name].dtype != t.dtype or loaded[name].shape != t.shape
                               or not torch.equal(byte_view(loaded[name]), byte_view(t)))
    ]
    if missing or differ:
        raise IntegrityError(
            f"{target}: migrated tensors differ from the source: {(missing + differ)[:5]}",
            path=target, tensors=missing + differ,
            hint="the output is not trustworthy: delete it and report this",
        )


# ------------------------------------------------------------ public API


@dataclass(frozen=True)
class MigrateResult:
    """What ``migrate`` wrote and how it got there."""

    source: str
    target: str
    mode: str  # always "inert": nothing from the file ran
    tensors: int
    placeholders: tuple[str, ...]
    digest: str
    fingerprint: str
    sidecar: str | None
    meta_path: str | None
    verified: bool
    crc_checked: int = 0
    skipped: tuple[str, ...] = ()
    scan_verdict: str = ""
    # The source's globals that run code or touch the system, with why: never run here.
    dangerous: Mapping[str, str] = field(default_factory=dict)


_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _folder_source(src: Path, dst: Path) -> InputError:
    """migrate reads one file: name the folder's checkpoint file when there is one."""
    # A diffusers pipeline keeps each component's weights one folder down (unet/, vae/).
    files = sorted(f for f in (*src.glob("*"), *src.glob("*/*"))
                   if f.is_file() and f.suffix in _PICKLE_SUFFIXES)
    if len(files) == 1:
        hint = (f"migrate its checkpoint file: torchverity migrate "
                f"{shlex.quote(os.fspath(files[0]))} {shlex.quote(os.fspath(dst))}")
    elif files:
        hint = "name one checkpoint file in it: " + ", ".join(
            f.relative_to(src).as_posix() for f in files[:5])
    elif safetensors := sorted((*src.glob("*.safetensors"), *src.glob("*/*.safetensors"))):
        hint = (f"its weights are .safetensors already, with nothing to migrate: torchverity "
                f"inspect {shell_path(safetensors[0])} lists them")
    else:
        hint = (f"it holds no torch checkpoint ({', '.join(_PICKLE_SUFFIXES)}): "
                f"ls {shlex.quote(os.fspath(src))}")
    return InputError(f"{src}: is a folder; migrate reads one checkpoint file", path=src,
                      hint=hint)


def _refuse(scan: ScanResult, path: Path) -> None:
    if scan.verdict == MALFORMED:
        raise FormatError(f"{path}: cannot be migrated: {scan.reason}", path=path,
                          hint=next_step(scan))
    if scan.format not in MIGRATABLE:
        raise UsageError(f"{path}: {scan.format} files are not migrated (no torch checkpoint)",
                         hint=f"torchverity scan {shell_path(path)} checks it for code; "
                              "migrate reads torch .pt/.pth/.bin/.ckpt files (TorchScript "
                              "included) and plain pickles")


# torchverity.save writes these: safetensors for flat tensor maps, torch.save for the rest.
TARGET_SUFFIXES = (".safetensors", ".pt", ".pth")


def _suggested(src: Path, dst: Path, suffix: str) -> Path:
    """``dst`` with ``suffix``, or beside it under another name when that is the source."""
    wanted = dst.with_suffix(suffix)
    return dst.with_name(f"{dst.stem}.migrated{suffix}") if wanted.resolve() == src.resolve() \
        else wanted


def _check_target(src: Path, dst: Path, nested: bool) -> None:
    if src.resolve() == dst.resolve():
        raise UsageError("migrate writes a new file: give a different target path")
    # Exact suffixes: save() picks the format by them, so X.SAFETENSORS would be a pickle.
    suffix = dst.suffix
    if nested and suffix != ".pt":
        raise UsageError(f"{dst}: a nested output (model + optimizer) is written as .pt",
                         hint=f"torchverity migrate {shell_path(src)} "
                              f"{shell_path(_suggested(src, dst, '.pt'))} --nested")
    if suffix not in TARGET_SUFFIXES:
        accepted = f"{', '.join(TARGET_SUFFIXES[:-1])} or {TARGET_SUFFIXES[-1]}"
        raise UsageError(
            f"{dst}: migrate writes {accepted} files, not {suffix or 'a name without a suffix'}",
            hint=f"torchverity migrate {shell_path(src)} "
                 f"{shell_path(_suggested(src, dst, '.safetensors'))}")


def _check_trust(path: Path, trust_sha256: str) -> None:
    from torchverity.digest import require_sha256

    require_sha256(path, trust_sha256, refusing="refusing to migrate other bytes",
                   hint="--trust-sha256 must name this exact file (sha256sum shows it)")


def migrate(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    *,
    trust_sha256: str | None = None,
    algo: str = DEFAULT_ALGO,
    nested: bool = False,
) -> MigrateResult:
    """Write ``target`` (.safetensors, .pt or .pth) with the tensors of ``source`` and a meta.json.

    Nothing from the file runs, whatever it holds: TorchScript archives, nested archives
    and files naming code-running globals (listed in the result's ``dangerous``) are read
    by the same inert reader. ``trust_sha256`` (the file's SHA-256), when given, refuses
    any other bytes. ``nested=True`` (``.pt`` only) writes ``{"model": state_dict,
    "optimizer": optimizer state_dict}`` instead of one flat state dict."""
    from torchverity.checkpoint._save import save

    src, dst = Path(source), Path(target)
    _check_target(src, dst, nested)
    if trust_sha256 is not None:
        check_sha256_hex(trust_sha256, src)
    if src.is_dir():
        raise _folder_source(src, dst)
    scan = scan_file(src)
    if trust_sha256 is not None:
        _check_trust(src, trust_sha256)
    _refuse(scan, src)
    dangerous = dangerous_globals(scan)
    zipped = scan.format in ("torch-zip", "torchscript")
    crc_checked = _check_archive_crcs(src) if zipped else 0
    obj, placeholders = inert_read(src, scan)
    extractor, meta_tree = _extract(src, obj)
    meta = {"source": src.name, "mode": "inert", "placeholders": placeholders,
            "dangerous": dangerous, "content": meta_tree, "skipped": extractor.skipped}
    if nested:
        report, count = _save_nested(obj, extractor, src, dst, meta, algo)
    else:
        tensors = _writable(extractor.tensors)
        report, count = save(tensors, dst, meta=meta, algo=algo), len(tensors)
        _verify_output(dst, tensors)
    return MigrateResult(
        os.fspath(src), os.fspath(dst), "inert", count, tuple(placeholders), report.digest,
        report.fingerprint, report.sidecar, report.meta_path, True, crc_checked,
        tuple(extractor.skipped), scan.verdict, dangerous,
    )


def _extract(src: Path, obj: Any) -> tuple[Extractor, Any]:
    extractor = Extractor()
    try:
        meta_tree = extractor.value(obj, "")
    except RecursionError:
        raise FormatError(f"{src}: the object nests too deeply to migrate", path=src) from None
    if not extractor.tensors:
        raise FormatError(f"{src}: no tensors found to migrate", path=src)
    return extractor, meta_tree


def _no_model(obj: Any, src: Path, dst: Path) -> UsageError:
    keys = ", ".join(map(str, list(obj)[:8])) if isinstance(obj, Mapping) else type(obj).__name__
    return UsageError(
        f"{src}: no model state dict or optimizer found for a nested output (keys: {keys})",
        hint=f"migrate it without --nested, which keeps every tensor: torchverity migrate "
             f"{shell_path(src)} {shell_path(_suggested(src, dst, '.safetensors'))}")


def _save_nested(obj: Any, extractor: Extractor, src: Path, dst: Path,
                 meta: dict[str, Any], algo: str) -> tuple[Any, int]:
    from torchverity.checkpoint._load import load
    from torchverity.checkpoint._save import save
    from torchverity.pickles._nested_out import nested_checkpoint, same_tree, tensor_paths

    out = nested_checkpoint(obj, extractor.tensors, extractor.names)
    if out is None:
        raise _no_model(obj, src, dst)
    paths = tensor_paths(out)
    # The model part holds the extractor's detached copies, the optimizer part the tensors
    # as unpickled: a name is found through either object.
    name_of = {**extractor.names, **{id(t): n for n, t in extractor.tensors.items()}}
    located = {name_of[i]: path for i, path in paths.items() if i in name_of}
    meta["locations"] = located
    extractor.skipped.extend(
        f"{name}: tensor not in the nested output, which holds the model and optimizer "
        "state only (migrate without --nested keeps every tensor)"
        for name in extractor.tensors if name not in located)
    report = save(out, dst, meta=meta, algo=algo)
    if not same_tree(load(dst, sidecar="require"), out):
        raise IntegrityError(f"{dst}: the nested checkpoint read back differs", path=dst,
                             hint="the output is not trustworthy: delete it and report this")
    return report, len(paths)
