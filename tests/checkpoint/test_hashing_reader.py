"""The reader torch.load reads through: one pass, and still a digest of every byte."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import pytest
import torch

from torchverity.checkpoint._hashing_reader import Balance, HashingReader, load_reader
from torchverity.digest import digest_file, new_hasher


@pytest.fixture
def blob(tmp_path: Path) -> Path:
    path = tmp_path / "blob.bin"
    path.write_bytes(random.Random(1).randbytes(21 * (1 << 20) + 123))
    return path


Mode = Literal["inline", "hash-beside", "split-read"]


def _reader(path: Path, algo: str, mode: Mode, pool: ThreadPoolExecutor) -> HashingReader:
    return HashingReader(path, new_hasher(algo), None if mode == "inline" else pool,
                         split=mode == "split-read")


@pytest.mark.parametrize("algo", ["sha256", "blake3", "xxh128"])
@pytest.mark.parametrize("mode", ["inline", "hash-beside", "split-read"])
def test_any_read_order_gives_the_digest_of_the_whole_file(blob: Path, algo: str,
                                                            mode: Mode) -> None:
    data, rng = blob.read_bytes(), random.Random(algo)
    with ThreadPoolExecutor(max_workers=1) as pool:
        reader = _reader(blob, algo, mode, pool)
        # Far jumps (left for the end), small gaps (filled), overlaps, re-reads, reads
        # past the end and large reads (several split chunks) that cross the hashed
        # prefix, each checked against the file.
        for _ in range(60):
            start = rng.choice([rng.randrange(len(data)), reader.tell()])
            size = rng.choice([1, 30, 4096, 3 << 20, 17 << 20])
            reader.seek(start)
            buf = bytearray(size)
            n = reader.readinto(buf)
            assert bytes(buf[:n]) == data[start:start + size]
        digest = reader.hexdigest()
        reader.close()
    assert digest == digest_file(blob, algo).hexdigest


@pytest.mark.parametrize("mode", ["hash-beside", "split-read"])
def test_a_read_past_the_end_returns_what_the_file_holds(blob: Path, mode: Mode) -> None:
    data = blob.read_bytes()
    with ThreadPoolExecutor(max_workers=1) as pool:
        reader = _reader(blob, "blake3", mode, pool)
        for start in (len(data) - (9 << 20), len(data) - (3 << 20) - 5):
            reader.seek(start)
            buf = bytearray(12 << 20)
            n = reader.readinto(buf)
            assert n == len(data) - start and bytes(buf[:n]) == data[start:]
            assert reader.tell() == len(data)
        assert reader.hexdigest() == digest_file(blob, "blake3").hexdigest
        reader.close()


def test_load_reader_matches_the_file_for_every_algorithm(tmp_path: Path) -> None:
    state = {"big": torch.randn(3 << 20), "small": torch.arange(10)}
    path = tmp_path / "m.pt"
    torch.save(state, path)
    for algo in ("sha256", "blake3", "xxh128"):
        reader = load_reader(path, algo)
        loaded = torch.load(reader, weights_only=True)  # type: ignore[arg-type]
        assert reader.hexdigest() == digest_file(path, algo).hexdigest
        reader.close()
        assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_sequential_reads_hash_from_the_callers_buffer(blob: Path) -> None:
    with ThreadPoolExecutor(max_workers=1) as pool:
        reader = HashingReader(blob, new_hasher("xxh128"), pool)
        assert reader.read() == blob.read_bytes()
        assert reader.hexdigest() == digest_file(blob, "xxh128").hexdigest
        reader.close()


def test_torch_load_through_the_reader(tmp_path: Path) -> None:
    # 12 storages: file order and first-use order agree, the reader covers the file once.
    state = {f"t{i}": torch.randn(300 + i, 70) for i in range(12)}
    path = tmp_path / "m.pt"
    torch.save(state, path)
    with ThreadPoolExecutor(max_workers=1) as pool:
        reader = HashingReader(path, new_hasher("blake3"), pool)
        loaded = torch.load(reader, weights_only=True)  # type: ignore[arg-type]
        digest = reader.hexdigest()
        reader.close()
    assert digest == digest_file(path, "blake3").hexdigest
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_reader_sees_the_flip_torch_load_ignores(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torch.save({"w": torch.ones(1000)}, path)
    before = digest_file(path, "xxh128").hexdigest
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    with ThreadPoolExecutor(max_workers=1) as pool:
        reader = HashingReader(path, new_hasher("xxh128"), pool)
        loaded = torch.load(reader, weights_only=True)  # type: ignore[arg-type]
        assert not torch.equal(loaded["w"], torch.ones(1000))  # torch itself noticed nothing
        assert reader.hexdigest() != before
        reader.close()


def test_the_worker_share_follows_the_measured_copy_and_hash_speeds() -> None:
    balance = Balance()
    balance.copied(3.0, 1 << 30)  # a copy that faults in fresh memory: 3x the hash's time
    balance.hashed(1.0, 1 << 30)
    assert balance.share == pytest.approx(2 / 3)
    a, m, b = balance.split(1 << 20, 5 << 20)
    assert (a, b) == (1 << 20, 5 << 20) and m % 4096 == 0
    assert (m - a) == pytest.approx((b - a) / 3, abs=4096)  # this thread reads a third
    balance.copied(29.0, 15 << 30)  # memory the allocator reuses: the copy is as fast as the hash
    balance.hashed(31.0, 15 << 30)
    assert balance.share == 1.0 and balance.split(0, 4 << 20)[1] == 0  # the worker reads all
