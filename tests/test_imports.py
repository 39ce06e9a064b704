"""Every module imports on a base install; heavy extras load lazily with a clear error."""

from __future__ import annotations

import subprocess
import sys
import textwrap

EXTRAS = (
    "fastapi",
    "starlette",
    "uvicorn",
    "httpx",
    "ray",
    "lightning",
    "pytorch_lightning",
    "transformers",
    "accelerate",
    "onnx",
    "onnxruntime",
    "onnxscript",
    "matplotlib",
    "pynvml",
    "safetensors",
    "sklearn",
    "schemathesis",
)

BLOCKER = f"""
import importlib.abc, sys
BLOCKED = {EXTRAS!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is blocked: base install")
sys.meta_path.insert(0, Block())
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_module_and_public_name_loads_without_extras() -> None:
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
    """)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) >= 10


def test_missing_extra_names_the_extra_to_install() -> None:
    result = _run("""
        from torchverity.errors import MissingExtraError, require_extra
        try:
            require_extra("fastapi", extra="serve", feature="torchverity serve")
        except MissingExtraError as exc:
            print(str(exc))
    """)
    assert result.returncode == 0, result.stderr
    assert "torchverity serve needs the optional package 'fastapi'" in result.stdout
    assert "pip install 'torchverity[serve]'" in result.stdout


def test_function_names_survive_submodule_imports() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import torchverity.fingerprint, torchverity.verify, torchverity\n"
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
