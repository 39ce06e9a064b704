"""The reader torch.load reads through: one pass, and still a digest of every byte."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from torchverity.checkpoint._hashing_reader import HashingReader
from torchverity.digest import digest_file, new_hasher


@pytest.fixture
def blob(tmp_path: Path) -> Path:
    path = tmp_path / "blob.bin"
    path.write_bytes(random.Random(1).randbytes(5 * (1 << 20) + 123))
    return path


@pytest.mark.parametrize("algo", ["sha256", "blake3", "xxh128"])
@pytest.mark.parametrize("threaded", [True, False])
def test_any_read_order_gives_the_digest_of_the_whole_file(blob: Path, algo: str,
                                                            threaded: bool) -> None:
    data, rng = blob.read_bytes(), random.Random(algo)
    with ThreadPoolExecutor(max_workers=1) as pool:
        reader = HashingReader(blob, new_hasher(algo), pool if threaded else None)
        # Far jumps (left for the end), small gaps (filled), overlaps, re-reads and
        # large reads that cross the hashed prefix, each checked against the file.
        for _ in range(60):
            start = rng.choice([rng.randrange(len(data)), reader.tell()])
            size = rng.choice([1, 30, 4096, 3 << 20])
            reader.seek(start)
            buf = bytearray(size)
            n = reader.readinto(buf)
            assert bytes(buf[:n]) == data[start:start + size]
        digest = reader.hexdigest()
        reader.close()
    assert digest == digest_file(blob, algo).hexdigest


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
