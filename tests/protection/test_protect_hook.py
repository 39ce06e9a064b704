"""The startup hook as installed: in both wheels, inert unless TORCHVERITY_PROTECT is set."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
from protect_helpers import SRC, flip_tensor_bit, run_python

import torchverity


@pytest.mark.parametrize("kind", ["wheel", "editable"])
def test_both_wheels_install_the_pth_into_site_packages(
        built_wheels: dict[str, Path], kind: str) -> None:
    with zipfile.ZipFile(built_wheels[kind]) as zf:
        names = zf.namelist()
        assert "torchverity-protect.pth" in names  # the wheel's root is site-packages
        line = zf.read("torchverity-protect.pth")
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        assert b"torchverity-protect.pth," in zf.read(record)  # pip uninstall removes it
    assert line == (SRC / "torchverity-protect.pth").read_bytes()
    assert line.startswith(b"import os; os.environ.get(\"TORCHVERITY_PROTECT\") and ")


def test_without_the_variable_the_hook_imports_nothing(hooked_python: str) -> None:
    done = run_python("""
        import sys
        import torch
        print("torchverity" in sys.modules, hasattr(torch.load, "__torchverity_protect__"))
    """, python=hooked_python)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]


def test_refuse_from_the_environment_refuses_a_damaged_checkpoint(
        hooked_python: str, tmp_path: Path) -> None:
    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    state = {"w": torch.arange(256, dtype=torch.float32)}
    torchverity.save(state, good)
    torchverity.save(state, bad)
    flip_tensor_bit(bad, bit=5)
    done = run_python("""
        import sys, torch
        from torchverity.errors import IntegrityError
        assert hasattr(torch.load, "__torchverity_protect__")
        assert torch.equal(torch.load(sys.argv[1])["w"], torch.arange(256.0))
        try:
            torch.load(sys.argv[2])
        except IntegrityError as exc:
            print("refused", exc.tensors)
            sys.exit(3)
    """, python=hooked_python, env={"TORCHVERITY_PROTECT": "refuse"}, args=(str(good), str(bad)))
    assert done.returncode == 3, done.stderr
    assert done.stdout.strip() == "refused ['w']"
    assert f"torchverity protect: refused torch.load: {bad}: sha256 digest does not match" \
        in done.stderr


def test_an_unknown_value_protects_with_warn_and_says_so(hooked_python: str) -> None:
    done = run_python("""
        from torchverity.protection import is_protected
        print(is_protected())
    """, python=hooked_python, env={"TORCHVERITY_PROTECT": "yes"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
    assert "TORCHVERITY_PROTECT='yes' is not a policy" in done.stderr
