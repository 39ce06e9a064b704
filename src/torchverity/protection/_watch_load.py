"""Watched reads: torch.load, safetensors load_file / safe_open, load_state_dict.

Each wrapper calls the real function with the caller's own arguments and
returns what it returned. Around the call it checks the file against its
record (see :mod:`._records`): a weights_only zip load is hashed as torch
reads it (one read, as in ``torchverity.load``); anything that may run code
from the file, and safetensors files (memory-mapped, read lazily), are hashed
before the real call. A mismatch raises under ``refuse`` and is reported under
``warn``. Every exception the call raises is recorded with the calling line
before it propagates unchanged.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchverity.errors import FormatError, IntegrityError, TorchVerityError
from torchverity.protection._failures import describe
from torchverity.protection._records import (
    Record,
    check_bytes,
    find_record,
    load_hashing,
    unrecorded,
)
from torchverity.protection._session import Session, active
from torchverity.protection._signatures import signature_record
from torchverity.protection._state import Event, caller_site, inside

MARK = "__torchverity_protect__"  # set on every wrapper: the function it wraps
_NAMED_ARGS = ("f", "map_location", "pickle_module", "weights_only", "mmap")
_PLAIN = frozenset(_NAMED_ARGS)  # calls without extra unpickler arguments


def source_path(f: Any) -> Path | None:
    """The local file a load reads: a path, or an open file object still at its start."""
    if isinstance(f, (str, os.PathLike)):
        return Path(os.path.abspath(os.fspath(f)))
    name = getattr(f, "name", None) or getattr(f, "path", None)
    if not isinstance(name, str) or not os.path.isfile(name):
        return None
    try:
        return Path(os.path.abspath(name)) if f.tell() == 0 else None
    except (AttributeError, OSError, ValueError):
        return None


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "y", "yes", "true")


def effective_weights_only(arguments: dict[str, Any]) -> bool:
    """Whether torch.load will use its restricted unpickler for these arguments."""
    if _flag("TORCH_FORCE_WEIGHTS_ONLY_LOAD"):
        return True
    chosen = arguments.get("weights_only")
    if chosen is not None:
        return bool(chosen)
    if arguments.get("pickle_module") is not None:
        return False
    return not _flag("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")


def gate(session: Session, exc: TorchVerityError, api: str, path: Path | None,
         where: str | None) -> None:
    """A file that does not match its record: raise under refuse, report under warn."""
    target = os.fspath(path) if path else None
    if session.policy == "refuse":
        session.emit(Event("refused", api, f"refused {api}: {exc.message}", target, where),
                     loud=True)
        raise exc
    session.emit(Event("mismatch", api, f"{api} (called at {where}) read a file that does not "
                       f"match its record, loaded anyway under policy warn: {exc.message}",
                       target, where), loud=True)


def _record_or_gate(session: Session, api: str, path: Path | None,
                    where: str | None) -> Record | None:
    if path is None or unrecorded(os.fspath(path)):  # no sidecar, manifest or signature near
        return None
    try:
        record = find_record(path)
    except TorchVerityError as exc:  # contradictory or unreadable records
        gate(session, exc, api, path, where)
        record = None
    try:
        return signature_record(session, path, record)
    except TorchVerityError as exc:  # a signature that does not verify, or leaves the file out
        gate(session, exc, api, path, where)
        return record


def _failed(session: Session, exc: BaseException, api: str, path: Path | None,
            where: str | None, weights_only: bool | None) -> None:
    target = os.fspath(path) if path else None
    session.ledger.record(exc, api, target, where, weights_only)
    session.emit(Event("load-failure", api, f"{api} of {target} raised {describe(exc)}",
                       target, where, {"error": describe(exc), "weights_only": weights_only}),
                 loud=False)


def _verified(session: Session, api: str, record: Record, where: str | None) -> None:
    session.emit(Event("verified", api, f"{api}: {record.path} matches {record.record}",
                       os.fspath(record.path), where, {"source": record.source}), loud=False)


# ------------------------------------------------------------------ torch.load


def watch_torch_load(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load(*args: Any, **kwargs: Any) -> Any:
        session = active()
        if session is None:
            return original(*args, **kwargs)
        arguments = _arguments(args, kwargs)
        if arguments is None:  # torch's own error for a bad call
            return original(*args, **kwargs)
        return _torch_load(session, original, args, kwargs, arguments)

    setattr(load, MARK, original)
    return load


def _arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """torch.load's arguments by name (``inspect.Signature.bind`` costs more than the rest)."""
    if len(args) > 3 or not (args or "f" in kwargs):
        return None
    named = dict(zip(_NAMED_ARGS[:3], args, strict=False))
    for key, value in kwargs.items():
        if key in named:
            return None
        named[key] = value
    return named


def _torch_load(session: Session, original: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any], arguments: dict[str, Any]) -> Any:
    where = caller_site()
    safe = effective_weights_only(arguments)
    path = source_path(arguments.get("f"))
    if not safe:
        _unsafe_load(session, path, where)
    with inside():
        try:
            record = _record_or_gate(session, "torch.load", path, where)
            if record is None:
                return original(*args, **kwargs)
            return _torch_load_verified(session, original, args, kwargs, arguments, record,
                                        safe, where)
        except Exception as exc:
            _failed(session, exc, "torch.load", path, where, safe)
            raise


def _unsafe_load(session: Session, path: Path | None, where: str | None) -> None:
    target = os.fspath(path) if path else None
    earlier = session.ledger.failed_safe_load(target) if target else None
    if earlier is not None:
        earlier.retried_at = where
        session.emit(Event(
            "fallback", "torch.load",
            f"torch.load of {target} failed under weights_only=True ({earlier.error}, called at "
            f"{earlier.where}) and was retried with weights_only=False at {where}: the file's "
            "pickle runs with full trust", target, where, {"first_error": earlier.error}),
            loud=True)
        return
    session.emit(Event("unsafe-load", "torch.load",
                       f"torch.load(weights_only=False) of {target or 'a stream'} at {where}: "
                       "any code in the file's pickle runs", target, where), loud=True, once=True)


def _torch_load_verified(session: Session, original: Callable[..., Any], args: tuple[Any, ...],
                         kwargs: dict[str, Any], arguments: dict[str, Any], record: Record,
                         safe: bool, where: str | None) -> Any:
    plain = set(arguments) <= _PLAIN and not arguments.get("mmap")
    if safe and plain and _is_zip(record.path):
        def read(reader: Any) -> Any:
            return original(reader, *args[1:], **{k: v for k, v in kwargs.items() if k != "f"})

        obj, failure, bad = load_hashing(record, read)
        if bad is not None:
            gate(session, bad, "torch.load", record.path, where)
        if failure is not None:
            raise failure
    else:
        # A full pickle may run code: its bytes are checked before anything is unpickled.
        bad = check_bytes(record)
        if bad is not None:
            gate(session, bad, "torch.load", record.path, where)
        obj = original(*args, **kwargs)
    if bad is None:
        _check_content(session, "torch.load", record, obj, where)
    return obj


def _is_zip(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == b"PK\x03\x04"


def _check_content(session: Session, api: str, record: Record, obj: Any,
                   where: str | None) -> None:
    """Keys, shapes and dtypes (and tensor hashes unless the digest vouches) against meta.json."""
    from torchverity.checkpoint._load_file import _check_fingerprint

    if record.meta is not None:
        try:
            _check_fingerprint(record.path, obj, record.meta, None, record.bound)
        except IntegrityError as exc:
            gate(session, exc, api, record.path, where)
            return
        except FormatError:  # an object torchverity cannot fingerprint: the digest stands alone
            pass
    _verified(session, api, record, where)


# ------------------------------------------------------------------ safetensors


def watch_safetensors_open(original: Callable[..., Any], api: str) -> Callable[..., Any]:
    """``safe_open`` / ``load_file``: the file is hashed before the real call maps it."""

    @functools.wraps(original)
    def opened(filename: Any, *args: Any, **kwargs: Any) -> Any:
        session = active()
        if session is None:
            return original(filename, *args, **kwargs)
        where = caller_site()
        path = source_path(filename)
        with inside():
            try:
                record = _record_or_gate(session, api, path, where)
                bad = check_bytes(record) if record is not None else None
                if bad is not None:
                    gate(session, bad, api, path, where)
                obj = original(filename, *args, **kwargs)
                if record is not None and bad is None:
                    if api.endswith("load_file"):
                        _check_content(session, api, record, obj, where)
                    else:
                        _verified(session, api, record, where)
                return obj
            except Exception as exc:
                _failed(session, exc, api, path, where, None)
                raise

    setattr(opened, MARK, original)
    return opened


# ------------------------------------------------------------------ load_state_dict


def watch_load_state_dict(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def load_state_dict(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        session = active()
        if session is None:
            return result
        strict = signature.bind(*args, **kwargs).arguments.get("strict", True)
        missing = list(getattr(result, "missing_keys", ()))
        unexpected = list(getattr(result, "unexpected_keys", ()))
        if not strict and (missing or unexpected):
            _partial(session, type(args[0]).__name__, missing, unexpected, caller_site())
        return result

    setattr(load_state_dict, MARK, original)
    return load_state_dict


def _partial(session: Session, model: str, missing: list[str], unexpected: list[str],
             where: str | None) -> None:
    def keys(names: list[str]) -> str:
        shown = ", ".join(names[:10])
        return shown + (f" and {len(names) - 10} more" if len(names) > 10 else "")

    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key(s) left at their initial values: {keys(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s) ignored: {keys(unexpected)}")
    session.emit(Event(
        "partial-load", "load_state_dict",
        f"{model}.load_state_dict(strict=False) at {where}: {'; '.join(parts)}", None, where,
        {"missing_keys": missing, "unexpected_keys": unexpected}), loud=True, once=True)
