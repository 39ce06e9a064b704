"""Every module imports on a base install; heavy extras load lazily with a clear error."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

# Top-level names of the optional extras (and dev tools) that a base install lacks.
EXTRAS = frozenset({
    "fastapi", "starlette", "uvicorn", "httpx", "pydantic", "ray", "lightning",
    "pytorch_lightning", "lightning_fabric", "lightning_utilities", "transformers",
    "accelerate", "onnx", "onnxruntime", "onnxscript", "matplotlib", "pynvml", "safetensors",
    "sklearn", "scikit_learn", "schemathesis", "model_signing", "sigstore", "openssl",
    "pyopenssl", "in_toto_attestation",
})
SRC = Path(__file__).resolve().parent.parent / "src"


@pytest.fixture(scope="module")
def base_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A site-packages view without the extras: what ``pip install torchverity`` gives.

    Each installed entry is linked in except the extras', so a missing extra
    behaves exactly as on a base install (``importlib.util.find_spec`` is None).
    """
    site = tmp_path_factory.mktemp("base-site")
    purelib = Path(sysconfig.get_paths()["purelib"])
    for entry in purelib.iterdir():
        top = entry.name.split("-")[0].split(".")[0].lower().replace("-", "_")
        if top not in EXTRAS and not entry.name.startswith("__editable__"):
            (site / entry.name).symlink_to(entry)
    return site


def _run(code: str, site: Path, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    # -S: no site-packages and no .pth files; only the base view and our sources.
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{SRC}"}
    return subprocess.run([sys.executable, "-S", "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_every_module_and_public_name_loads_without_extras(base_site: Path) -> None:
    result = _run("""
        import importlib, pkgutil, torchverity
        from torchverity.errors import MissingExtraError
        # A trainer integration is nothing but its extra: importing it names the extra.
        INTEGRATIONS = {"torchverity.integrations.lightning": "lightning",
                        "torchverity.integrations.hf": "hf"}
        names = [m.name for m in pkgutil.walk_packages(torchverity.__path__, "torchverity.")]
        for name in names:
            if name in INTEGRATIONS:
                try:
                    importlib.import_module(name)
                except MissingExtraError as exc:
                    assert f"torchverity[{INTEGRATIONS[name]}]" in str(exc), str(exc)
                    continue
                raise AssertionError(f"{name} imported without its extra")
            importlib.import_module(name)
        for name in torchverity.__all__:
            getattr(torchverity, name)
        from torchverity.cli import build_parser
        build_parser()
        print(len(names))
    """, base_site)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) >= 10


def test_missing_extra_names_the_extra_to_install(base_site: Path) -> None:
    result = _run("""
        import importlib.util
        from torchverity.errors import MissingExtraError, require_extra
        assert importlib.util.find_spec("fastapi") is None  # the view really lacks extras
        assert importlib.util.find_spec("safetensors") is None
        try:
            require_extra("fastapi", extra="serve", feature="torchverity serve")
        except MissingExtraError as exc:
            print(str(exc))
    """, base_site)
    assert result.returncode == 0, result.stderr
    assert "torchverity serve needs the optional package 'fastapi'" in result.stdout
    assert "pip install 'torchverity[serve]'" in result.stdout


def test_function_names_survive_submodule_imports() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import torchverity.checkpoint._fingerprint, torchverity.verify, torchverity\n"
                "from torchverity import fingerprint\n"
                "assert callable(torchverity.fingerprint)\n"
                "assert fingerprint is torchverity.fingerprint\n"
                "print('ok')"
            ),
        ],
        capture_output=True,
        text=True,
    )
    assert result.stdout.strip() == "ok", result.stderr


def test_package_docstring_examples_work() -> None:
    import doctest

    import torchverity

    result = doctest.testmod(torchverity, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 6 and result.failed == 0


def test_demo_without_its_extras_fails_unless_asked_to_skip(base_site: Path) -> None:
    """A base install lacks the serve extra (``make demo`` installs it): the serve step then
    fails with the install command, and passes only when skipped by name."""
    result = _run("""
        import sys
        from torchverity.cli import main
        print("rc", main(["demo", "--only", "serve"]))
        print("rc", main(["demo", "--only", "files,serve", "--skip", "serve"]))
    """, base_site, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = result.stdout.split("rc 1\n")
    assert "failed   serve" in first and "pip install 'torchverity[serve]'" in first
    assert "torchverity demo --skip serve" in first
    assert "demo finished: 1 of 2 steps passed, 1 skipped" in second and second.endswith("rc 0\n")
