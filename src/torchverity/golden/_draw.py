"""Golden inputs drawn from a seed: normal values for a float dtype, valid token ids for an
integer one.

Floats are ``torch.randn`` from a generator seeded with ``seed``, cast to the dtype.
Integers (and bools) are ``torch.randint(low, high)`` from the same generator: ids in
``[0, vocab_size)`` when the model's config gives a vocabulary size (``config.vocab_size``
as transformers names it, or its text config's), else in ``[0, DEFAULT_ID_HIGH)``; never
beyond what the dtype holds. Every parameter that changes the values is recorded in the
golden file (``inputs.drawn``, docs/formats/golden.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from torchverity.errors import UsageError

# The ids drawn for an integer dtype when the model names no vocabulary size: small enough
# for any embedding table of ten rows or more.
DEFAULT_ID_HIGH = 10

Distribution = Literal["normal", "integers"]
# Where the upper bound of drawn ids came from.
HighFrom = Literal["config.vocab_size", "default", "dtype"]


@dataclass(frozen=True)
class InputDraw:
    """Seeded random golden inputs; ``record`` draws them and writes these parameters with
    them. ``low``/``high`` (``integers`` only): ids in ``[low, high)``."""

    shape: tuple[int, ...]
    dtype: str
    seed: int
    distribution: Distribution
    low: int | None = None
    high: int | None = None
    high_from: HighFrom | None = None

    def tensor(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed)
        dtype = getattr(torch, self.dtype)
        if self.distribution == "normal":
            return torch.randn(self.shape, generator=generator).to(dtype)
        assert self.low is not None and self.high is not None
        return torch.randint(self.low, self.high, self.shape, generator=generator, dtype=dtype)

    def to_dict(self) -> dict[str, Any]:
        drawn: dict[str, Any] = {"distribution": self.distribution, "shape": list(self.shape),
                                 "dtype": self.dtype, "seed": self.seed}
        if self.distribution == "integers":
            drawn.update(low=self.low, high=self.high, high_from=self.high_from)
        return drawn

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> InputDraw:
        """The parameters as :meth:`to_dict` wrote them (``ValueError`` otherwise)."""
        shape, dtype, seed = tuple(int(s) for s in data["shape"]), str(data["dtype"]), data["seed"]
        if not isinstance(seed, int):
            raise ValueError(f"seed {seed!r} is not an integer")
        if data["distribution"] == "normal":
            return cls(shape, dtype, seed, "normal")
        if data["distribution"] != "integers":
            raise ValueError(f"unknown distribution {data['distribution']!r}")
        return cls(shape, dtype, seed, "integers", int(data["low"]), int(data["high"]),
                   _high_from(data["high_from"]))


def draw_inputs(shape: Sequence[int], dtype: str = "float32", *, seed: int = 0,
                model: Any = None) -> InputDraw:
    """The seeded inputs ``golden record --shape`` uses: for an integer dtype, ids below
    ``model.config.vocab_size`` when the model has one (``UsageError`` for a dtype torch
    does not name)."""
    found = getattr(torch, dtype, None)
    if not isinstance(found, torch.dtype):
        raise UsageError(f"unknown dtype '{dtype}'", hint="for example float32 or int64")
    if found.is_floating_point or found.is_complex:
        return InputDraw(tuple(shape), dtype, seed, "normal")
    vocab = vocab_size(model)
    high, source = DEFAULT_ID_HIGH, "default"
    if vocab is not None:
        high, source = vocab, "config.vocab_size"
    top = 2 if found == torch.bool else torch.iinfo(found).max + 1
    if high > top:
        high, source = top, "dtype"
    return InputDraw(tuple(shape), dtype, seed, "integers", 0, high, _high_from(source))


def _high_from(text: object) -> HighFrom:
    for known in get_args(HighFrom):
        if text == known:
            return known
    raise ValueError(f"unknown high_from {text!r}")


def vocab_size(model: Any) -> int | None:
    """``config.vocab_size`` of a transformers model (its text config's, for a multimodal
    one), else None."""
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", None)
    if callable(text):
        config = text()
    size = getattr(config, "vocab_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None
