"""Content fingerprints of tensors, state_dicts and nested checkpoints.

A fingerprint depends only on content: each tensor's digest covers its name,
dtype, shape and raw bytes in a canonical layout (C-contiguous, native
little-endian), and the root covers the entries sorted by name. The same
tensors saved as .pt or .safetensors, loaded with or without ``mmap=True``,
contiguous or not, in any key order, give the same fingerprint. Every dtype
works (bfloat16, float8, bool...): bytes are read through a ``uint8`` view,
never through ``tensor.numpy()`` on the tensor's own dtype, and without copies
for contiguous CPU tensors.

Two algorithms, recorded in every fingerprint so they are never mixed:

``blake3`` (exact host mode)
    BLAKE3 of the entry header and the canonical bytes. Cryptographic: equal
    digests mean equal bytes. BLAKE3 is about 2.5x faster than SHA-256 per
    core and spreads one large tensor over every core. Accelerator tensors are
    copied to the host to compute it. Records written before BLAKE3 became
    the exact mode say ``sha256`` (same layout, SHA-256 per tensor); they still
    verify: pass the recorded algorithm as ``mode`` to rebuild one.

``tvsum64x2`` (device mode)
    Computed where the tensor lives, without copying it to the host. The
    tensor's bytes are read as unsigned words of its element size and two
    position-weighted sums modulo 2**64 are taken, each word multiplied by a
    distinct odd multiplier per position. Because an odd multiplier is
    invertible modulo 2**64, *any* change confined to one element (every
    single-bit flip, whatever the bit) always changes both sums. Unrelated
    changes in several elements collide with probability about 2**-64 per sum
    for random errors. It is not cryptographic: someone who wants a collision
    can construct one, so use ``blake3`` against adversaries.

Plain values (ints, strings...) and the root over the sorted entries are
SHA-256 in both modes: a few bytes each, with the algorithm name hashed into
the root.

>>> import torch, torchverity
>>> fp = torchverity.fingerprint({"w": torch.ones(3), "b": torch.zeros(2)})
>>> len(fp.root)
64
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from torchverity._tensors import byte_view, dtype_name, host_bytes, iter_leaves, numel_bytes
from torchverity.checkpoint._fp_record import (
    DEVICE,
    EXACT,
    FINGERPRINT_VERSION,
    LEGACY_EXACT,
    Fingerprint,
    Mode,
    TensorDigest,
    _header,
    from_entries,
    plain_tensor_hasher,
    value_digest,
)
from torchverity.checkpoint._hashing_reader import cpu_count
from torchverity.errors import FormatError, UsageError

__all__ = ["DEVICE", "EXACT", "FINGERPRINT_VERSION", "LEGACY_EXACT", "Fingerprint",
           "TensorDigest", "from_entries"]


_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# Bounds the device temporaries (a few int64 vectors of this length).
_DEVICE_CHUNK = 1 << 22


_K1, _K2, _K3, _K4 = 0x9E3779B97F4A7C15, 0x632BE59BD9B4E019, 0x5851F42D4C957F2D, 0x14057B7EF767814F


_THREAD_MIN_BYTES = 1 << 20


# Below this a tensor is hashed on one core: spreading it costs more than it saves.
_SPREAD_MIN_BYTES = 4 << 20


def _signed64(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def tensor_hasher(name: str, dtype: torch.dtype, shape: Sequence[int], algo: str = EXACT,
                  *, threads: bool = False) -> Any:
    """A hash of ``algo`` primed with the entry header: feed it the canonical bytes.

    Lets file readers fingerprint tensors while streaming them from disk.
    ``threads`` lets one blake3 hash spread a large input over every core.
    """
    return plain_tensor_hasher(name, dtype_name(dtype), shape, numel_bytes(shape, dtype), algo,
                               threads=threads)


def _exact_digest(name: str, value: Any, algo: str = EXACT, spread: bool = False) -> TensorDigest:
    if isinstance(value, torch.Tensor):
        data = host_bytes(value)
        h = tensor_hasher(name, value.dtype, value.shape, algo,
                          threads=spread and len(data) >= _SPREAD_MIN_BYTES)
        h.update(data)
        return TensorDigest(name, dtype_name(value.dtype), tuple(value.shape), h.hexdigest())
    return value_digest(name, value)


def layout(obj: Any) -> dict[str, TensorDigest]:
    """Entries of ``obj`` without reading tensor data: a tensor's digest is ``""``.

    Plain values (epoch, lr, flags) are tiny, so they get their full digest.
    Compare with a recorded fingerprint when something else vouches for the
    tensors' bytes (e.g. a verified file digest).
    """
    return {
        name: (TensorDigest(name, dtype_name(v.dtype), tuple(v.shape), "")
               if isinstance(v, torch.Tensor) else value_digest(name, v))
        for name, v in iter_leaves(obj)
    }


def device_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """Two position-weighted sums mod 2**64 (int64, shape [2]) on the tensor's device.

    Enqueues work only: no host-device synchronisation.
    """
    flat = byte_view(tensor)
    size = min(tensor.element_size(), 8)  # complex128 reads as int64 pairs
    words = flat.view(_WORD_DTYPES[size])
    mask = (1 << (8 * size)) - 1 if size < 8 else None
    total = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), _DEVICE_CHUNK):
        chunk = words[start : start + _DEVICE_CHUNK].to(torch.int64)
        if mask is not None:
            chunk = chunk & mask
        idx = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=flat.device)
        m1 = (idx * _signed64(_K1) + _signed64(_K2)) | 1
        m2 = ((idx ^ _signed64(_K3)) * _signed64(_K4)) | 1
        total[0] += (chunk * m1).sum()
        total[1] += (chunk * m2).sum()
    return total


def checksum_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stack :func:`device_checksum` of each tensor: an ``[n, 2]`` int64 tensor, no sync."""
    if not tensors:
        return torch.zeros(0, 2, dtype=torch.int64)
    return torch.stack([device_checksum(t) for t in tensors])


def _device_digests(leaves: list[tuple[str, Any]]) -> list[TensorDigest]:
    tensor_items = [(n, v) for n, v in leaves if isinstance(v, torch.Tensor)]
    sums = [device_checksum(v) for _, v in tensor_items]
    host = [s.cpu().tolist() for s in sums]  # one transfer of 16 bytes per tensor
    by_name: dict[str, TensorDigest] = {}
    for (name, value), (s1, s2) in zip(tensor_items, host, strict=True):
        dtype, shape = dtype_name(value.dtype), tuple(value.shape)
        payload = _header("tvsum", name, dtype, shape, value.numel() * value.element_size())
        payload += (s1 & ((1 << 64) - 1)).to_bytes(8, "little")
        payload += (s2 & ((1 << 64) - 1)).to_bytes(8, "little")
        by_name[name] = TensorDigest(name, dtype, shape, hashlib.sha256(payload).hexdigest())
    return [by_name[n] if n in by_name else value_digest(n, v) for n, v in leaves]


def _resolve_mode(mode: str, leaves: list[tuple[str, Any]]) -> str:
    if mode == "exact":
        return EXACT
    if mode == "device":
        return DEVICE
    if mode in (EXACT, LEGACY_EXACT, DEVICE):
        return mode
    if mode != "auto":
        raise UsageError(f"unknown fingerprint mode '{mode}'",
                         hint=f"use auto, exact or device (or a recorded algorithm: {EXACT}, "
                              f"{LEGACY_EXACT}, {DEVICE})")
    on_device = any(isinstance(v, torch.Tensor) and v.device.type != "cpu" for _, v in leaves)
    return DEVICE if on_device else EXACT


def fingerprint(obj: Any, *, mode: Mode | str = "auto",
                workers: int | None = None) -> Fingerprint:
    """Fingerprint a tensor, module, optimizer, state_dict or nested checkpoint.

    ``mode="auto"`` uses exact BLAKE3 when every tensor is on the CPU and the
    device checksum when any lives on an accelerator; pass ``mode="exact"`` to
    force the cryptographic host mode, or a recorded ``Fingerprint.algo`` to
    rebuild a record the way it was made (``fingerprint(obj, mode=old.algo)``).
    ``workers=1`` keeps the work on the calling thread.
    """
    leaves = list(iter_leaves(obj))
    names = [n for n, _ in leaves]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise FormatError(f"cannot fingerprint: names occur twice after flattening: {dup[:5]}")
    algo = _resolve_mode(mode, leaves)
    entries = (_device_digests(leaves) if algo == DEVICE
               else _exact_digests(leaves, algo, workers))
    return from_entries(algo, entries)


def _exact_digests(leaves: list[tuple[str, Any]], algo: str,
                   workers: int | None) -> list[TensorDigest]:
    if workers == 1:
        return [_exact_digest(n, v, algo) for n, v in leaves]
    if algo == EXACT:
        # One blake3 hash already fills every core (for tensors worth spreading),
        # so tensors go one after another: no oversubscribed threads.
        return [_exact_digest(n, v, algo, spread=True) for n, v in leaves]
    big = sum(
        1 for _, v in leaves
        if isinstance(v, torch.Tensor) and v.numel() * v.element_size() >= _THREAD_MIN_BYTES
    )
    if big < 2:
        return [_exact_digest(n, v, algo) for n, v in leaves]
    # hashlib releases the GIL on large buffers, so threads use every core.
    with ThreadPoolExecutor(max_workers=workers or min(big, cpu_count())) as pool:
        return list(pool.map(lambda item: _exact_digest(item[0], item[1], algo), leaves))


def fingerprint_tensor(tensor: torch.Tensor, name: str = "", *,
                       mode: Mode | str = "auto") -> str:
    """The digest of one tensor (its entry digest, including ``name``)."""
    return fingerprint({name: tensor} if name else tensor, mode=mode).entries[0].digest


def exact_algo(recorded: Fingerprint) -> str:
    """The algorithm to rebuild ``recorded`` with on the host (older records say sha256)."""
    return recorded.algo if recorded.algo in (EXACT, LEGACY_EXACT) else EXACT
