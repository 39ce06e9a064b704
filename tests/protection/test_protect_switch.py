"""The switch: off means the original objects, on means wrappers that keep signatures."""

from __future__ import annotations

import inspect
import sys
import threading
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from protect_helpers import run_python

import torchverity
from torchverity.errors import CheckFailedError, UsageError
from torchverity.protection import is_protected, protect, protected, unprotect

ORIGINALS = {
    "torch.load": torch.load,
    "torch.save": torch.save,
    "torch.serialization.load": torch.serialization.load,
    "Module.load_state_dict": torch.nn.Module.load_state_dict,
    "safetensors.safe_open": safetensors.safe_open,
    "safetensors.torch.load_file": safetensors.torch.load_file,
    "safetensors.torch.save_file": safetensors.torch.save_file,
}


def _current() -> dict[str, object]:
    return {
        "torch.load": torch.load,
        "torch.save": torch.save,
        "torch.serialization.load": torch.serialization.load,
        "Module.load_state_dict": torch.nn.Module.load_state_dict,
        "safetensors.safe_open": safetensors.safe_open,
        "safetensors.torch.load_file": safetensors.torch.load_file,
        "safetensors.torch.save_file": safetensors.torch.save_file,
    }


def test_off_means_the_original_function_objects() -> None:
    assert not is_protected()
    assert all(_current()[name] is obj for name, obj in ORIGINALS.items())


def test_protect_wraps_and_unprotect_restores_the_same_objects(off_after: None) -> None:
    hooks = (sys.excepthook, threading.excepthook, sys.exit)
    protect()
    assert sys.excepthook is not hooks[0]
    now = _current()
    assert all(now[name] is not obj for name, obj in ORIGINALS.items())
    assert torch.serialization.load is torch.load  # one wrapper for one function
    assert inspect.signature(torch.load) == inspect.signature(ORIGINALS["torch.load"])
    assert inspect.signature(torch.nn.Module.load_state_dict) == inspect.signature(
        ORIGINALS["Module.load_state_dict"])
    assert torch.load.__name__ == "load" and torch.load.__doc__ == ORIGINALS["torch.load"].__doc__
    unprotect()
    assert all(_current()[name] is obj for name, obj in ORIGINALS.items())
    assert (sys.excepthook, threading.excepthook, sys.exit) == hooks


def test_a_hook_the_program_installs_meanwhile_is_kept(off_after: None) -> None:
    before = sys.excepthook

    def program_hook(*args: object) -> None:
        before(*args)  # type: ignore[arg-type]

    protect()
    sys.excepthook = program_hook
    try:
        unprotect()
        assert sys.excepthook is program_hook
    finally:
        sys.excepthook = before


def test_the_context_manager_restores_even_when_the_block_raises() -> None:
    with pytest.raises(ZeroDivisionError), protected():
        assert torch.load is not ORIGINALS["torch.load"]
        _ = 1 / 0
    assert torch.load is ORIGINALS["torch.load"] and not is_protected()


def test_wrapped_calls_return_what_the_real_ones_return(tmp_path: Path, off_after: None) -> None:
    model = torch.nn.Linear(3, 2)
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    expected = ORIGINALS["torch.load"](tmp_path / "plain.pt")
    protect()
    got = torch.load(tmp_path / "plain.pt")
    assert type(got) is type(expected) and list(got) == list(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    result = model.load_state_dict(got)
    assert type(result).__name__ == "_IncompatibleKeys" and not result.missing_keys


def test_root_package_exports_the_switch() -> None:
    assert torchverity.protect is protect and torchverity.unprotect is unprotect
    assert torchverity.protected is protected


def test_bad_policy_and_nested_blocks_are_usage_errors(off_after: None) -> None:
    with pytest.raises(UsageError, match="unknown protect policy"):
        protect("strict")  # type: ignore[arg-type]
    with protected(), pytest.raises(UsageError, match="already on"), protected():
        pass


def test_refuse_block_raises_when_a_load_failure_was_swallowed(tmp_path: Path) -> None:
    with pytest.raises(CheckFailedError, match="caught and not re-raised"), protected("refuse"):
        try:  # noqa: SIM105 (the users' pattern under test)
            torch.load(tmp_path / "missing.pt")
        except FileNotFoundError:
            pass
    assert not is_protected()


def test_importing_torchverity_patches_nothing_and_the_switch_imports_no_torch() -> None:
    done = run_python("""
        import sys
        import torch
        original = torch.load
        import torchverity
        from torchverity.protection import protect, unprotect
        for name in torchverity.__all__:
            getattr(torchverity, name)
        assert torch.load is original, "importing torchverity patched torch.load"
        assert not hasattr(torch.save, "__torchverity_protect__")
        print("ok")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    done = run_python("""
        import sys
        from torchverity.protection import protect, unprotect
        protect()
        assert "torch" not in sys.modules, "protect() imported torch"
        import torch
        assert hasattr(torch.load, "__torchverity_protect__"), "torch not patched on import"
        unprotect()
        assert not hasattr(torch.load, "__torchverity_protect__")
        print("ok")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_library_names_bound_before_the_switch_are_rebound_and_restored(off_after: None) -> None:
    import transformers.modeling_utils as mu

    original = mu.safe_open
    assert original is ORIGINALS["safetensors.safe_open"]
    protect()
    assert mu.safe_open is safetensors.safe_open is not original
    unprotect()
    assert mu.safe_open is original
