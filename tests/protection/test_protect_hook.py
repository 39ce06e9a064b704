"""The startup hook as installed: in both wheels, inert unless TORCHVERITY_PROTECT is set."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import sysconfig
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
        listed = [r for r in zf.read(record).decode().splitlines()
                  if r.startswith("torchverity-protect.pth,")]
        assert len(names) == len(set(names))
    digest = base64.urlsafe_b64encode(hashlib.sha256(line).digest()).rstrip(b"=").decode()
    # pip checks the hash as it installs and removes the file on uninstall.
    assert listed == [f"torchverity-protect.pth,sha256={digest},{len(line)}"]
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
    assert f"torchverity protect: refused torch.load: {bad}: blake3 digest does not match" \
        in done.stderr


def test_an_unknown_value_protects_with_warn_and_says_so(hooked_python: str) -> None:
    done = run_python("""
        from torchverity.protection import is_protected
        print(is_protected())
    """, python=hooked_python, env={"TORCHVERITY_PROTECT": "yes"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
    assert "TORCHVERITY_PROTECT='yes' is not a policy" in done.stderr


def test_pip_editable_install_into_a_fresh_venv_protects_from_the_environment(
        built_wheels: dict[str, Path], tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())
    (site / "shared-libraries.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                           "--no-deps", "--no-index", str(built_wheels["editable"])],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (site / "torchverity-protect.pth").is_file()
    check = subprocess.run(
        [str(python), "-c", "import torchverity.protection as p; print(p.is_protected(), "
         "p.__file__)"], capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "TORCHVERITY_PROTECT": "refuse"})
    assert check.returncode == 0, check.stderr
    protected, where = check.stdout.split()
    assert protected == "True"
    assert "source-tree" in where  # imported from the tree the editable wheel points at
