"""One options object for every batch entry point: ``BatchOptions`` given as ``options=``, or its
fields as keyword arguments (which replace the object's values); bad values are refused when
the object is made, before any file is touched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from torchverity.batch import BatchItem, BatchOptions, run_batch, run_model_batch
from torchverity.errors import BatchError, UsageError


def _reverse(item: BatchItem) -> bytes:
    return item.data[::-1]


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(3):
        (folder / f"item{i}.bin").write_bytes(f"input {i}".encode())
    return folder


def test_options_and_keywords_describe_the_same_job(inputs: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    options = BatchOptions(suffix=".rev", settings={"lang": "en"}, retries=0)
    first = run_batch(inputs, _reverse, out, options)
    assert first.ok and sorted(p.name for p in (out / "data").iterdir()) == [
        "item0.bin.rev", "item1.bin.rev", "item2.bin.rev"]
    again = run_batch(inputs, _reverse, out, suffix=".rev", settings={"lang": "en"}, retries=0)
    assert again.resumed and again.fingerprint == first.fingerprint and again.processed == 0
    with pytest.raises(BatchError, match="differs in: settings"):
        run_batch(inputs, _reverse, out, options, settings={"lang": "de"})


def test_keywords_replace_the_options_values(inputs: Path, tmp_path: Path) -> None:
    options = BatchOptions(suffix=".a", workers=2)
    report = run_batch(inputs, _reverse, tmp_path / "out", options, suffix=".b")
    assert report.ok
    assert {p.suffix for p in (tmp_path / "out/data").iterdir()} == {".b"}
    assert options.suffix == ".a"  # the caller's object is unchanged


def test_run_model_batch_takes_the_same_options(inputs: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "tvopts_model.py").write_text("def build():\n    return lambda item: item.data\n")
    monkeypatch.syspath_prepend(str(code))
    report = run_model_batch(inputs, "tvopts_model:build", tmp_path / "out",
                             BatchOptions(suffix=".copy", workers=2))
    assert report.ok and (tmp_path / "out/data/item1.bin.copy").read_bytes() == b"input 1"


@pytest.mark.parametrize(("fields", "match"), [
    ({"workers": 0}, "workers .* at least 1, not 0"),
    ({"retries": -1}, "retries .* 0 or more, not -1"),
    ({"durability": "sometimes"}, "unknown durability 'sometimes'"),
    ({"engine": "spark"}, "unknown engine 'spark'"),
    ({"suffix": ""}, "output suffix '' cannot work"),
    ({"suffix": "a/b"}, "output suffix 'a/b' cannot work"),
    ({"suffix": ".tvtmp"}, "output suffix '.tvtmp' cannot work"),
])
def test_bad_options_are_refused_when_made(fields: dict[str, Any], match: str, inputs: Path,
                                           tmp_path: Path,
                                           run_cli: Callable[..., Any]) -> None:
    with pytest.raises(UsageError, match=match) as caught:
        BatchOptions(**fields)
    assert caught.value.exit_code == 2
    with pytest.raises(UsageError, match=match):
        run_batch(inputs, _reverse, tmp_path / "out", **fields)
    assert not (tmp_path / "out").exists()
    flag, value = next(iter(fields.items()))
    if flag in ("workers", "retries", "suffix"):
        result = run_cli("batch", "run", "--inputs", str(inputs), "--model", "x:y",
                         "--out", str(tmp_path / "out"), f"--{flag}={value}")
        assert result.code == 2 and "internal error" not in result.err, result.err
        assert not (tmp_path / "out").exists()


def test_options_are_frozen() -> None:
    options = BatchOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.workers = 4  # type: ignore[misc]
    assert dataclasses.replace(options, workers=4).workers == 4
    assert options == BatchOptions() and options.setting_pairs == ()
