"""Helpers for the protect tests: damaged files and fresh interpreters."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def flip_tensor_bit(path: Path, bit: int = 0) -> None:
    """Flip one bit inside the first tensor's bytes of a .pt zip or .safetensors file."""
    data = bytearray(path.read_bytes())
    if data[:4] == b"PK\x03\x04":
        with zipfile.ZipFile(path) as zf:
            info = next(i for i in zf.infolist() if "/data/" in i.filename and i.file_size)
        with open(path, "rb") as fh:
            fh.seek(info.header_offset + 26)
            name_len, extra_len = (int.from_bytes(fh.read(2), "little") for _ in range(2))
        offset = info.header_offset + 30 + name_len + extra_len
    else:
        from torchverity.checkpoint._safetensors import read_header

        offset = next(e.begin for e in read_header(path).entries if e.nbytes)
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def run_python(code: str, *, python: str = sys.executable, cwd: Path | None = None,
               env: dict[str, str] | None = None, args: tuple[str, ...] = (),
               timeout: int = 240) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", **(env or {})}
    for name in ("TORCHVERITY_PROTECT", "TORCHVERITY_PROTECT_LOG"):
        if env is None or name not in env:
            full.pop(name, None)
    return subprocess.run([python, "-c", textwrap.dedent(code), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=full)
