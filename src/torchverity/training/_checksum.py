"""Per-tensor device checksums for the guard's at-rest check, about two passes over the data.

The guard checksums every parameter and optimizer-state tensor twice per step
(after the update, before the next one), so the cost must stay near a copy.
Each tensor's bytes are read as 32-bit words ``w`` and two sums modulo 2**32
are taken, both with native int32 wrap-around arithmetic:

* ``s1 = sum(w)``: any change confined to one word changes it, so every
  single-bit flip, in any dtype, is always caught;
* ``s2 = sum(w[i] * m[i mod 2**20] * q[i div 2**20])`` with fixed random odd
  multipliers ``m`` and ``q`` (opt-in, ``rest_weighted=True``): position-dependent,
  so swapped elements and several changes that cancel in ``s1`` (the same bit
  set in one word and cleared in another) still show, except by a ~2**-32
  coincidence. It costs a multiply and a temporary per tensor.

The weighting of all tensors up to 2**20 words is one fused ``_foreach_mul``;
no tensor is copied (except 2-byte-aligned odd cases). Both the record and
the verification are computed here; the values are not comparable with
:func:`torchverity.checkpoint.device_checksum`. No host-device synchronisation.

:class:`WordSums` serves the per-step check: the word views of a fixed list of
tensors are built once, and the small tensors (biases, norms, optimizer step
counters) are summed together in a handful of launches instead of one each, so
a model with hundreds of small tensors costs little more than its bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Generic, TypeVar

import torch

from torchverity._tensors import byte_view

_SPAN = 1 << 20  # words with distinct multipliers
_MAX_CHUNKS = 1 << 16  # chunk multipliers: tensors up to 2**36 words (256 GiB)
_multipliers: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Odd int32 multipliers, generated once per device from a fixed seed."""
    if device not in _multipliers:
        gen = torch.Generator().manual_seed(0x7E57AB1E)
        m = torch.randint(-(2**31), 2**31, (_SPAN,), dtype=torch.int64, generator=gen) | 1
        q = torch.randint(-(2**31), 2**31, (_MAX_CHUNKS,), dtype=torch.int64, generator=gen) | 1
        _multipliers[device] = (m.to(torch.int32).to(device), q.to(torch.int32).to(device))
    return _multipliers[device]


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int32 words (zero-padded to a multiple of 4 bytes)."""
    flat = byte_view(tensor)
    pad = -flat.numel() % 4
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    try:
        return flat.view(torch.int32)
    except RuntimeError:  # a view whose byte offset is not 4-aligned
        return flat.clone().view(torch.int32)


def checksums(tensors: Sequence[torch.Tensor], *, weighted: bool = True) -> torch.Tensor:
    """``[n, 2]`` int32 checksums ``(s1, s2)`` of each tensor, computed on its device.

    ``weighted=False`` computes ``s1`` only (``[n, 1]``): one read of each tensor
    and no temporary, still catching every change confined to one 32-bit word.
    """
    if not tensors:
        return torch.zeros(0, 2 if weighted else 1, dtype=torch.int32)
    words = [_words(t) for t in tensors]
    plain = torch.stack([w.sum(dtype=torch.int32) for w in words])
    if not weighted:
        return plain.unsqueeze(1)
    return torch.stack([plain, _weighted(words)], dim=1)


def _weighted(words: Sequence[torch.Tensor]) -> torch.Tensor:
    """``s2`` of each word tensor."""
    small = [i for i, w in enumerate(words) if w.numel() <= _SPAN]
    out: list[torch.Tensor | None] = [None] * len(words)
    if small:
        m, _ = _tables(words[small[0]].device)
        ws = [words[i] for i in small]
        for i, p in zip(small, torch._foreach_mul(ws, [m[: w.numel()] for w in ws]), strict=True):
            out[i] = p.sum(dtype=torch.int32)
    for i, w in enumerate(words):
        if out[i] is None:
            out[i] = _weighted_large(w)
    return torch.stack([o for o in out if o is not None])


def _weighted_large(words: torch.Tensor) -> torch.Tensor:
    m, q = _tables(words.device)
    full, rest = divmod(words.numel(), _SPAN)
    per_chunk = (words[: full * _SPAN].view(full, _SPAN) * m).sum(dim=1, dtype=torch.int32)
    s2 = (per_chunk * q[:full]).sum(dtype=torch.int32)
    if rest:
        tail = (words[full * _SPAN:] * m[:rest]).sum(dtype=torch.int32)
        s2 = s2 + tail * q[full]
    return s2


_GROUP = 1 << 12  # words: tensors up to this size are summed together


class WordSums:
    """:func:`checksums` of a fixed list of tensors, with the per-call work cut to the bytes.

    The int32 word views are built once (again if a tensor's storage moves,
    e.g. ``p.data = ...``); tensors of at most ``_GROUP`` words are gathered
    into one buffer and summed per tensor by one prefix sum, which gives the
    same guarantee as separate sums: a change in one tensor's words shifts the
    prefix sums at both of its ends alike for every later tensor.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], *, weighted: bool) -> None:
        self.tensors = list(tensors)
        self.weighted = weighted
        self._build()

    def _build(self) -> None:
        self._ptrs = [t.data_ptr() for t in self.tensors]
        words = [_words(t) for t in self.tensors]
        # A padded or realigned tensor got a copy: it must be re-read on every call.
        self._fresh = [w.data_ptr() != t.data_ptr() or w.numel() * 4 != _nbytes(t)
                       for w, t in zip(words, self.tensors, strict=True)]
        self._words = words
        devices = {w.device for w in words}
        # Empty tensors stay out: a group's segments must each end on a word.
        small = ([i for i, w in enumerate(words) if 0 < w.numel() <= _GROUP]
                 if len(devices) == 1 else [])
        self._small = small if len(small) > 1 else []
        self._large = [i for i in range(len(words)) if i not in set(self._small)]
        if self._small:
            dev = words[self._small[0]].device
            sizes = [words[i].numel() for i in self._small]  # host ints: no device read
            # Built once, in the first steps; non_blocking keeps even that free of a sync.
            self._ends = (torch.tensor(sizes).cumsum(0) - 1).to(dev, non_blocking=True)
            self._buf = torch.empty(sum(sizes), dtype=torch.int32, device=dev)
            self._zero = torch.zeros(1, dtype=torch.int32, device=dev)
            order = self._small + self._large
            self._perm = torch.tensor(sorted(range(len(order)), key=order.__getitem__)).to(
                dev, non_blocking=True)

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        """The same tensor objects, in the same order, with the same storage."""
        return len(tensors) == len(self.tensors) and all(
            a is b for a, b in zip(tensors, self.tensors, strict=True)
        ) and [t.data_ptr() for t in tensors] == self._ptrs

    def __call__(self) -> torch.Tensor:
        """``[n, 1]`` (``[n, 2]`` when weighted) int32 checksums, as :func:`checksums`."""
        if not self.tensors:
            return torch.zeros(0, 2 if self.weighted else 1, dtype=torch.int32)
        if [t.data_ptr() for t in self.tensors] != self._ptrs:
            self._build()
        words = [_words(t) if fresh else w
                 for w, t, fresh in zip(self._words, self.tensors, self._fresh, strict=True)]
        plain = self._plain(words)
        if not self.weighted:
            return plain.unsqueeze(1)
        return torch.stack([plain, _weighted(words)], dim=1)

    def _plain(self, words: list[torch.Tensor]) -> torch.Tensor:
        large = [words[i].sum(dtype=torch.int32) for i in self._large]
        if not self._small:
            return torch.stack(large)
        torch.cat([words[i] for i in self._small], out=self._buf)
        ends = self._buf.cumsum(0, dtype=torch.int32).index_select(0, self._ends)
        grouped = torch.diff(ends, prepend=self._zero)
        return torch.cat([grouped, torch.stack(large)] if large else [grouped])[self._perm]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class PairedSums:
    """:class:`WordSums` of a fixed list, with ``split`` in two halves of about equal bytes
    so a helper thread can sum one half while the calling thread sums the other.

    Rows come back in the order of ``tensors`` whichever thread summed them. Unsplit,
    it is one :class:`WordSums` (each half groups its own small tensors: more launches).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], *, weighted: bool,
                 split: bool = True) -> None:
        self.tensors = list(tensors)
        self.weighted = weighted
        cut = balanced_cut([_nbytes(t) for t in self.tensors]) if split else len(self.tensors)
        self._first = WordSums(self.tensors[:cut], weighted=weighted)
        self._second = WordSums(self.tensors[cut:], weighted=weighted) if cut < len(
            self.tensors) else None

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        """The same tensor objects, in the same order, with the same storage."""
        if self._second is None:
            return self._first.matches(tensors)
        cut = len(self._first.tensors)
        return self._first.matches(tensors[:cut]) and self._second.matches(tensors[cut:])

    def __call__(self, pool: Executor | None = None) -> torch.Tensor:
        """As :meth:`WordSums.__call__`; with ``pool``, the second half is summed there."""
        if self._second is None:
            return self._first()
        first, second = run_beside(pool, self._first, self._second)
        return torch.cat([first, second])


def balanced_cut(sizes: Sequence[int]) -> int:
    """The index that splits ``sizes`` into two runs of the nearest totals."""
    total, run, best, cut = sum(sizes), 0, None, len(sizes)
    for i, size in enumerate(sizes):
        gap = abs(total - 2 * run)
        if best is None or gap < best:
            best, cut = gap, i
        run += size
    return max(cut, 1) if sizes else 0


A = TypeVar("A")
B = TypeVar("B")


def run_beside(pool: Executor | None, here: Callable[[], A], there: Callable[[], B]
               ) -> tuple[A, B]:
    """``(here(), there())``, with ``there`` offered to ``pool``'s thread meanwhile.

    If that thread has not started it by the time ``here`` is done (the other core
    busy with another process), this thread runs it itself: on a loaded machine the
    pair costs what running both here would, never a wait for a descheduled thread.
    """
    if pool is None:
        return here(), there()
    job: _Claimable[B] = _Claimable(there)
    pool.submit(job.run)
    first = here()
    return first, job.result()


class _Claimable(Generic[B]):
    """A call that whichever thread claims first runs; the other waits for its result."""

    def __init__(self, fn: Callable[[], B]) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._claimed = False
        self._done = threading.Event()
        self._value: B | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        with self._lock:
            if self._claimed:
                return
            self._claimed = True
        try:
            with torch.no_grad():  # grad mode is per thread, on in a new one
                self._value = self._fn()
        except BaseException as exc:  # re-raised on the thread that asks for the result
            self._error = exc
        finally:
            self._done.set()

    def result(self) -> B:
        self.run()
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]
