"""Shared fixtures. Golden files change only with ``pytest --update-golden``."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

GOLDEN_DIR = Path(__file__).parent / "golden"

# Set before any test imports torch: the crash tests fork the test process, and a fork taken
# while torch's OpenMP pool has threads can deadlock the child in its first tensor op. One
# thread per xdist worker also fits the two cores the suite runs on.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden", action="store_true", help="rewrite golden files from current output"
    )


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def run_cli() -> Callable[..., CliResult]:
    """Run ``torchverity ARGS`` in-process and capture exit code, stdout and stderr."""
    from torchverity.cli import main

    def _run(*args: str) -> CliResult:
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = main([str(a) for a in args])
        return CliResult(code, out.getvalue(), err.getvalue())

    return _run


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> Callable[[str, str], None]:
    """``golden(name, text)`` compares text with tests/golden/NAME."""
    update = request.config.getoption("--update-golden")

    def _check(name: str, text: str) -> None:
        path = GOLDEN_DIR / name
        if update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        assert path.exists(), f"golden file {path} is missing; create it with --update-golden"
        assert text == path.read_text(encoding="utf-8")

    return _check


@pytest.fixture(scope="module")
def recorded_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``save_pretrained`` BERT folder (config, tokenizer, ``.gitattributes``) with its
    manifest, built once per test module."""
    from torch_zip_artifacts import bert_folder
    from torchverity.manifest import write_manifest

    folder = bert_folder(tmp_path_factory.mktemp("hf") / "bert")
    write_manifest(folder)
    return folder
