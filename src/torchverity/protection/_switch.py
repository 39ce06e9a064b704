"""Turning the switch on and off: which functions are replaced, where, and how they come back.

``protect()`` replaces the watched functions in their own modules and the
names other loaded modules bound to safetensors' functions (``from safetensors
import safe_open`` at the top of a library), and records each replacement so
``unprotect()`` puts back the very same objects. A library imported later
than the switch is patched as soon as it has been imported (a finder on
``sys.meta_path`` watches for torch and safetensors), so turning the switch on
imports neither.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from torchverity.errors import CheckFailedError, InputError, UsageError
from torchverity.protection import _session
from torchverity.protection._failures import Swallowed
from torchverity.protection._state import POLICIES, Event, Policy, SignatureCache, Trust

_OWN_PREFIX = "torchverity.protection"


@dataclass(frozen=True)
class _Patch:
    """One function protect replaced, and the original to put back."""

    owner: Any
    name: str
    original: Any


_patches: list[_Patch] = []
_wrappers: dict[int, Any] = {}  # id(original) -> its wrapper
_finder: _AfterImport | None = None
_atexit_registered = False


def _wrapper_for(original: Any, make: Callable[[Any], Any]) -> Any:
    wrapper = _wrappers.get(id(original))
    if wrapper is None:
        wrapper = _wrappers[id(original)] = make(original)
    return wrapper


def _replace(owner: Any, name: str, make: Callable[[Any], Any]) -> Any:
    from torchverity.protection._watch_load import MARK

    original = getattr(owner, name, None)
    if original is None or hasattr(original, MARK):
        return None
    wrapper = _wrapper_for(original, make)
    setattr(owner, name, wrapper)
    _patches.append(_Patch(owner, name, original))
    return original


def _patch_torch(torch: ModuleType) -> None:
    from torchverity.protection import _watch_load as wl
    from torchverity.protection import _watch_save as ws

    _replace(torch, "load", wl.watch_torch_load)
    _replace(torch.serialization, "load", wl.watch_torch_load)
    _replace(torch, "save", ws.watch_torch_save)
    _replace(torch.serialization, "save", ws.watch_torch_save)
    _replace(torch.nn.Module, "load_state_dict", wl.watch_load_state_dict)


def _patch_safetensors(module: ModuleType) -> None:
    from torchverity.protection import _watch_load as wl
    from torchverity.protection import _watch_save as ws

    def opener(api: str) -> Callable[[Any], Any]:
        return lambda original: wl.watch_safetensors_open(original, api)

    _replace(module, "safe_open", opener("safetensors.safe_open"))
    if module.__name__ == "safetensors.torch":
        _replace(module, "load_file", opener("safetensors.torch.load_file"))
        _replace(module, "save_file", ws.watch_save_file)


def _patch_checkpoint_io(module: ModuleType) -> None:
    """Lightning's checkpoint writer (``lightning`` and the standalone ``lightning_fabric``)."""
    from torchverity.protection import _watch_save as ws

    io_class = getattr(module, "TorchCheckpointIO", None)
    if io_class is not None:
        _replace(io_class, "save_checkpoint", ws.watch_checkpoint_io_save)
        _replace(io_class, "remove_checkpoint", ws.watch_checkpoint_io_remove)


_PATCHERS: dict[str, Callable[[ModuleType], None]] = {
    "torch": _patch_torch,
    "safetensors": _patch_safetensors,
    "safetensors.torch": _patch_safetensors,
    "lightning.fabric.plugins.io.torch_io": _patch_checkpoint_io,
    "lightning_fabric.plugins.io.torch_io": _patch_checkpoint_io,
}


def _rebind_imported_names() -> None:
    """Point other modules' ``from safetensors... import NAME`` bindings at the wrappers.

    Only public names bound to safetensors' functions are touched: libraries
    call torch through ``torch.load``, and a private name (``_orig_load``) or
    the main script's variables are someone's deliberate reference to the
    original.
    """
    originals = {id(p.original): p.original for p in _patches
                 if getattr(p.owner, "__name__", "").startswith("safetensors")}
    for mod_name, module in list(sys.modules.items()):
        if mod_name.startswith((_OWN_PREFIX, "safetensors", "__main__")) \
                or not isinstance(module, ModuleType):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            original = originals.get(id(value))
            if original is not None and value is original and not name.startswith("_"):
                namespace[name] = _wrappers[id(original)]
                _patches.append(_Patch(module, name, original))


class _AfterImport:
    """A ``sys.meta_path`` finder that patches a watched library right after its first import.

    Finders and loaders are duck-typed: not subclassing ``importlib.abc`` keeps its
    imports (pathlib, importlib.resources) off the interpreter-start hook.
    """

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> Any:
        patcher = _PATCHERS.get(fullname)
        if patcher is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader, patcher)  # type: ignore[assignment]  # duck-typed
        return spec


class _PatchingLoader:
    def __init__(self, loader: Any, patcher: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._patcher = patcher

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        if _session.current() is not None:
            self._patcher(module)

    def __getattr__(self, name: str) -> Any:  # resource readers and the like
        return getattr(self._loader, name)


def is_protected() -> bool:
    """Whether the switch is on in this process."""
    return _session.current() is not None


def _trust(public_key: str | os.PathLike[str] | None,
           certificate_chain: Sequence[str | os.PathLike[str]]) -> Trust:
    if public_key is not None and certificate_chain:
        raise UsageError("give model signatures one thing to trust: public_key or "
                         "certificate_chain, not both",
                         hint="protect(public_key='pub.pem') for key-signed models")
    trust = Trust(Path(public_key) if public_key is not None else None,
                  tuple(Path(c) for c in certificate_chain))
    for path in [trust.public_key, *trust.certificate_chain]:
        if path is not None and not path.is_file():
            raise InputError(f"{path}: no such key or certificate file", path=path,
                             hint="give the PEM file the model's publisher gave you")
    return trust


def protect(policy: Policy = "warn", *, log: str | os.PathLike[str] | None = None,
            public_key: str | os.PathLike[str] | None = None,
            certificate_chain: Sequence[str | os.PathLike[str]] = ()) -> None:
    """Watch every checkpoint load and save in this process (see docs/protect.md).

    ``policy="refuse"`` raises on a file that does not match its record and
    makes the process exit with status 1 when a load failure was swallowed;
    ``"warn"`` reports both. ``log`` names a JSONL file that receives every
    event. ``public_key`` (PEM), or ``certificate_chain`` (CA certificates),
    is what OpenSSF model signatures found beside loaded files must verify
    with. Calling it again changes the policy, log and trust of the running
    session.
    """
    if policy not in POLICIES:
        raise UsageError(f"unknown protect policy '{policy}'", hint="use warn or refuse")
    log_path = Path(log) if log is not None else None
    trust = _trust(public_key, certificate_chain)
    existing = _session.current()
    if existing is not None:
        existing.policy, existing.log_path = policy, log_path
        if existing.trust != trust:
            existing.trust, existing.signatures = trust, SignatureCache()
        return
    session = _session.start(policy, log_path)
    session.trust = trust
    _install(session)


def _install(session: _session.Session) -> None:
    global _finder, _atexit_registered
    session.ledger.install_hooks()
    for name, patcher in _PATCHERS.items():
        module = sys.modules.get(name)
        if module is not None:
            patcher(module)
    _rebind_imported_names()
    _finder = _AfterImport()
    sys.meta_path.insert(0, _finder)
    if not _atexit_registered:
        atexit.register(_at_exit)
        _atexit_registered = True
    argv = list(getattr(sys, "argv", []))  # not set yet when the startup hook runs early
    session.emit(Event("started", "protect",
                       f"protecting this process (policy {session.policy})",
                       detail={"policy": session.policy, "argv": argv,
                               "public_key": session.trust.public_key,
                               "certificate_chain": list(session.trust.certificate_chain)}),
                 loud=False)


def unprotect() -> list[Swallowed]:
    """Put every replaced function back; returns (and prints) the swallowed load failures."""
    global _finder
    session = _session.current()
    if session is None:
        return []
    swallowed = _session.summarize(session, final=False)
    for patch in reversed(_patches):
        setattr(patch.owner, patch.name, patch.original)
    _patches.clear()
    _wrappers.clear()
    if _finder is not None and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None
    session.ledger.remove_hooks()
    _session.stop()
    return swallowed


@contextmanager
def protected(policy: Policy = "warn", *, log: str | os.PathLike[str] | None = None,
              public_key: str | os.PathLike[str] | None = None,
              certificate_chain: Sequence[str | os.PathLike[str]] = ()) -> Iterator[None]:
    """``with protected(): ...``: the switch on for the block, everything restored after.

    Under ``refuse``, load failures swallowed inside the block raise
    :class:`~torchverity.errors.CheckFailedError` when it ends.
    """
    if _session.current() is not None:
        raise UsageError("torchverity protect is already on in this process",
                         hint="call torchverity.unprotect() first, or drop the inner protect")
    protect(policy, log=log, public_key=public_key, certificate_chain=certificate_chain)
    try:
        yield
    except BaseException as exc:
        session = _session.current()
        if session is not None:
            session.ledger.mark_escaped(exc)
        raise
    finally:
        swallowed = unprotect()
    if policy == "refuse" and swallowed:
        raise CheckFailedError(
            f"{len(swallowed)} checkpoint load failure(s) were caught and not re-raised inside "
            f"the protected block: {swallowed[0].sentence()}",
            hint="fix the load or re-raise its error; the summary above lists every one",
        )


def _at_exit() -> None:
    session = _session.current()
    if session is None:
        return
    # A program that already asked for a failing status keeps it.
    failing = session.policy == "refuse" and session.ledger.exit_status in (None, 0)
    swallowed = _session.summarize(session, final=failing)
    if failing and swallowed:
        # atexit cannot set the exit status; flush what is buffered and leave with 1.
        import logging

        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with suppress(OSError, ValueError):
                stream.flush()
        os._exit(1)
