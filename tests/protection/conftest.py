"""Fixtures for the protect tests: damaged files, fresh interpreters with the startup hook."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from protect_helpers import SRC

ROOT = SRC.parent
# Keys, certificates and model folders are made as the provenance tests make them.
sys.path.append(str(Path(__file__).parents[1] / "provenance"))


@pytest.fixture
def off_after() -> Iterator[None]:
    """Whatever a test turns on is off again after it."""
    yield
    from torchverity.protection import is_protected, unprotect

    if is_protected():
        unprotect()


@pytest.fixture(scope="session")
def built_wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The package built as users get it: a wheel and an editable wheel (PEP 517)."""
    out = tmp_path_factory.mktemp("wheels")
    tree = tmp_path_factory.mktemp("source-tree")
    for name in ("pyproject.toml", "MANIFEST.in", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / "build_backend", tree / "build_backend",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(SRC, tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    # The backend pyproject.toml names, called as a PEP 517 front end calls it.
    code = ("import importlib, sys, tomllib; s = tomllib.load(open('pyproject.toml', 'rb'))"
            "['build-system']; sys.path[:0] = s.get('backend-path', []); "
            "b = importlib.import_module(s['build-backend']); "
            f"w = b.build_wheel({str(out)!r}); "
            f"e = b.build_editable({str(out)!r}); print('WHEELS', w, e)")
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    _, wheel, editable = next(
        line for line in done.stdout.splitlines() if line.startswith("WHEELS ")).split()
    return {"wheel": out / wheel, "editable": out / editable}


@pytest.fixture(scope="session")
def hooked_python(tmp_path_factory: pytest.TempPathFactory,
                  built_wheels: dict[str, Path]) -> str:
    """A fresh virtual environment whose site-packages holds the wheel's startup .pth.

    Torch and the other libraries come from this interpreter's site-packages
    and torchverity from the sources under test, through a plain path .pth.
    """
    venv = tmp_path_factory.mktemp("hooked-venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())
    shared = sysconfig.get_paths()["purelib"]
    (site / "shared-libraries.pth").write_text(f"{SRC}\n{shared}\n")
    with zipfile.ZipFile(built_wheels["wheel"]) as zf:
        (site / "torchverity-protect.pth").write_bytes(zf.read("torchverity-protect.pth"))
    return str(python)
