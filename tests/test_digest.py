"""Streaming digests and sidecars against real files and real coreutils."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import blake3
import pytest
import xxhash

from torchverity.digest import (
    READ_SIZE,
    digest_file,
    digest_files,
    read_sidecar,
    sidecar_path,
    write_sidecar,
)
from torchverity.errors import FormatError, InputError, UsageError


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "weights.bin"
    # Spans several read buffers plus a partial one.
    path.write_bytes(bytes(range(256)) * (2 * READ_SIZE // 256) + b"tail")
    return path


def _reference(algo: str, data: bytes) -> str:
    if algo == "xxh128":
        return xxhash.xxh3_128(data).hexdigest()
    return (hashlib.sha256(data) if algo == "sha256" else blake3.blake3(data)).hexdigest()


@pytest.mark.parametrize("algo", ["sha256", "blake3", "xxh128"])
def test_digest_matches_reference_implementations(data_file: Path, algo: str) -> None:
    data = data_file.read_bytes()
    got = digest_file(data_file, algo)
    assert (got.hexdigest, got.size, got.algo) == (_reference(algo, data), len(data), algo)


@pytest.mark.parametrize("algo", ["sha256", "blake3", "xxh128"])
def test_empty_file_digest(tmp_path: Path, algo: str) -> None:
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert digest_file(empty, algo).hexdigest == _reference(algo, b"")


def test_xxh128_is_the_canonical_form_xxh128sum_prints(tmp_path: Path) -> None:
    # Printed by xxh128sum (xxHash 0.8) for this content: byte order is part of the format.
    path = tmp_path / "hello.bin"
    path.write_bytes(b"hello" * 100_000)
    assert digest_file(path, "xxh128").hexdigest == "c8e019839f20d918089c4491cab68cb4"
    sidecar = write_sidecar(path, digest_file(path, "xxh128"))
    assert sidecar.name == "hello.bin.xxh128"
    assert read_sidecar(sidecar) == ("xxh128", "c8e019839f20d918089c4491cab68cb4", "hello.bin")
    if shutil.which("xxh128sum"):
        ok = subprocess.run(["xxh128sum", "-c", sidecar.name], cwd=tmp_path, capture_output=True)
        assert ok.returncode == 0, ok.stdout + ok.stderr


def test_parallel_digests_equal_serial(tmp_path: Path) -> None:
    paths = []
    for i in range(20):
        p = tmp_path / f"f{i}"
        p.write_bytes(bytes([i]) * (i * 10_000 + 1))
        paths.append(p)
    serial = [digest_file(p).hexdigest for p in paths]
    assert [d.hexdigest for d in digest_files(paths, workers=2)] == serial


def test_sidecar_is_accepted_by_real_sha256sum(data_file: Path) -> None:
    sidecar = write_sidecar(data_file, digest_file(data_file, "sha256"))
    assert sidecar == sidecar_path(data_file, "sha256")
    assert sidecar.read_text() == f"{digest_file(data_file, 'sha256').hexdigest}  weights.bin\n"
    ok = subprocess.run(
        ["sha256sum", "-c", sidecar.name], cwd=data_file.parent, capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    with open(data_file, "r+b") as fh:
        fh.write(b"\xff")
    bad = subprocess.run(
        ["sha256sum", "-c", sidecar.name], cwd=data_file.parent, capture_output=True, text=True
    )
    assert bad.returncode != 0


def test_sidecar_written_by_sha256sum_is_read(tmp_path: Path, data_file: Path) -> None:
    line = subprocess.run(
        ["sha256sum", "-b", data_file.name],
        cwd=data_file.parent,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    sidecar = sidecar_path(data_file, "sha256")
    sidecar.write_text(line)
    algo, hexdigest, name = read_sidecar(sidecar)
    assert (algo, hexdigest, name) == ("sha256", digest_file(data_file, "sha256").hexdigest,
                                       "weights.bin")


@pytest.mark.parametrize(
    "content",
    [
        "",
        "abc  weights.bin\n",
        "g" * 64 + "  weights.bin\n",
        "a" * 64 + "\n",
        "a" * 64 + "  x\n" + "b" * 64 + "  y\n",
        "a" * 63 + "  weights.bin\n",
    ],
    ids=["empty", "short-hex", "non-hex", "no-name", "two-lines", "63-digits"],
)
def test_malformed_sidecar_is_a_format_error(data_file: Path, content: str) -> None:
    sidecar = sidecar_path(data_file, "sha256")
    sidecar.write_text(content)
    with pytest.raises(FormatError) as info:
        read_sidecar(sidecar)
    assert "not a valid sha256 sidecar" in str(info.value)
    assert f"torchverity hash --algo sha256 --write {data_file}" in str(info.value)


def test_the_default_sidecar_is_blake3_and_b3sum_reads_it(data_file: Path) -> None:
    import blake3

    sidecar = write_sidecar(data_file, digest_file(data_file))
    assert sidecar == data_file.with_name("weights.bin.blake3")
    want = blake3.blake3(data_file.read_bytes()).hexdigest()
    assert read_sidecar(sidecar) == ("blake3", want, "weights.bin")
    if shutil.which("b3sum"):
        ok = subprocess.run(["b3sum", "-c", sidecar.name], cwd=data_file.parent,
                            capture_output=True)
        assert ok.returncode == 0, ok.stdout + ok.stderr


def test_unknown_algorithm_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="unknown digest algorithm 'md5'"):
        digest_file(tmp_path, "md5")
    with pytest.raises(InputError, match="no such file"):
        digest_file(tmp_path / "nope")
    with pytest.raises(InputError, match="is a directory"):
        digest_file(tmp_path)
