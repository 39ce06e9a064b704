"""Exact device-side undo of an optimizer update: one copy before it, one select after it.

Non-fused optimizers update in place and cannot be told to skip without the
host reading a flag, so the guard keeps a copy of every parameter and
optimizer-state tensor and, after the update, keeps either the new or the old
bits with ``where(applied, new, old)``. Both passes run on the widest integer
view of each tensor's bytes: the result is bit-exact whatever the dtype (NaN
payloads and signed zeros included) and, on CPU, ``where`` on int64 words runs
about twice as fast as on float32 elements. Views are built once per set of
tensors and rebuilt when a tensor's storage moves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _widest(tensor: torch.Tensor) -> torch.Tensor:
    """A flat integer view of the tensor's bytes (int64 when size and offset allow)."""
    t = tensor.detach()
    if not t.is_contiguous():
        return t
    flat = t.reshape(-1).view(torch.uint8)
    for dtype in (torch.int64, torch.int32, torch.int16):
        try:
            return flat.view(dtype)
        except RuntimeError:  # byte count or offset not a multiple of the word size
            continue
    return flat


def _like(copy: torch.Tensor, live: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """The ``empty_like`` buffer ``copy`` of ``live``, viewed as ``live``'s ``words`` are."""
    if not live.is_contiguous():  # same strides (empty_like preserves them): elementwise
        return copy
    # A fresh buffer is aligned, so the live tensor's word size always fits it.
    return copy.reshape(-1).view(torch.uint8).view(words.dtype)


class Snapshot:
    """Copies of the tensors covered by an undo, kept in preallocated buffers."""

    def __init__(self) -> None:
        self.live: list[torch.Tensor] = []
        self.copies: list[torch.Tensor] = []
        self._ptrs: list[int] = []
        self._live_words: list[torch.Tensor] = []
        self._copy_words: list[torch.Tensor] = []

    def take(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``tensors`` (one fused copy); buffers are reused while the tensors stay."""
        ptrs = [t.data_ptr() for t in tensors]
        if ptrs != self._ptrs or not self.same(tensors):
            self.live, self._ptrs = list(tensors), ptrs
            self.copies = [torch.empty_like(t) for t in tensors]
            self._live_words = [_widest(t) for t in tensors]
            self._copy_words = [_like(c, t, w) for c, t, w in zip(
                self.copies, tensors, self._live_words, strict=True)]
        torch._foreach_copy_(self._copy_words, self._live_words)

    def keep_if(self, applied: torch.Tensor | bool) -> None:
        """Keep the updated bits where ``applied`` (0-dim bool, or known on the host) is
        true, else the copy's."""
        if isinstance(applied, bool):  # decided on the host: nothing, or one fused copy back
            if not applied:
                torch._foreach_copy_(self._live_words, self._copy_words)
            return
        # The output aliases an input exactly: one pass, no temporary.
        for cur, old in zip(self._live_words, self._copy_words, strict=True):
            torch.where(applied, cur, old, out=cur)

    def copies_of(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The copies of ``tensors`` if they lead the copied list, else None."""
        n = len(tensors)
        if n > len(self.live) or not all(a is b for a, b in zip(tensors, self.live[:n],
                                                                 strict=True)):
            return None
        return self.copies[:n]

    def same(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` are exactly the tensors copied, in order."""
        return len(tensors) == len(self.live) and all(
            a is b for a, b in zip(tensors, self.live, strict=True))
