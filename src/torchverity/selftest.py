"""Hardware self-test: does this device compute and store correctly right now?

Fleet operators catch faulty chips with known-answer tests; this module brings
the same idea to one machine, for CPUs (which produce silent errors too) and
accelerators. Each round runs, for matmul, 2-D convolution and reductions in
float32, float16 and bfloat16:

``known-answer``
    Inputs are small integers (-1, 0, 1) and the reduction lengths are at most
    256, so every exact result is an integer that each of these dtypes
    represents exactly: the device must return it bit for bit.
``repeat``
    Random inputs, the same kernel run several times: results must be bitwise
    identical (on CUDA, cuDNN is put in deterministic mode for the test).
``reference``
    Random inputs (rounded to the dtype) against a float64 CPU reference,
    within a dtype-aware bound scaled by the magnitude of the summed terms.

and a ``memory`` pattern test writes and reads back all-zeros, all-ones,
0x55/0xAA and address-derived words in a device buffer.

``run_selftest(seconds=N)`` repeats rounds with fresh inputs while another
round still fits in ``N`` seconds; the first round always runs in full.

:class:`FaultyKernels` is a fault drill: a dispatcher mode that flips one bit
of one element in some results of chosen operators, as a faulty device
would. The tests use it to prove the self-test and consistency checks catch it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from torchverity._tensors import dtype_name
from torchverity.errors import UsageError
from torchverity.golden import bitwise_equal, compare_tensors, device_name, tolerance, unravel

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Integers up to 256 are exact in each of these, which the known-answer tests need.
SUPPORTED_DTYPES = (torch.float64, *DTYPES)
KERNELS = ("matmul", "conv2d", "reduce")
TESTS = ("known-answer", "repeat", "reference")
MEMORY_DTYPE = "int32"
REPEATS = 3
# Reduction length of every kernel: exact integer results stay within 256,
# which bfloat16 (8 significant bits) still represents exactly.
_FAN = 256
_PATTERNS = (0, -1, 0x55555555, -0x55555556)  # -0x55555556 is 0xAAAAAAAA as int32


@dataclass(frozen=True)
class CheckResult:
    """One kernel x dtype x test cell. ``status`` is ``pass``, ``FAIL`` or ``skip``."""

    kernel: str
    dtype: str
    test: str
    status: str
    runs: int
    failures: int
    detail: str


@dataclass(frozen=True)
class SelftestResult:
    """Outcome of :func:`run_selftest`."""

    ok: bool
    device: str
    device_name: str
    seconds: float
    rounds: int
    checks: tuple[CheckResult, ...]

    @property
    def failures(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status == "FAIL"]

    def table(self) -> tuple[list[str], list[list[str]]]:
        """Kernel x dtype grid: ``pass``, ``skip`` or ``FAIL (<tests>)`` per cell."""
        dtypes = list(dict.fromkeys(c.dtype for c in self.checks))
        kernels = list(dict.fromkeys(c.kernel for c in self.checks))
        rows = [[k, *(self._cell(k, d) for d in dtypes)] for k in kernels]
        return ["kernel", *dtypes], rows

    def _cell(self, kernel: str, dtype: str) -> str:
        cells = [c for c in self.checks if c.kernel == kernel and c.dtype == dtype]
        if not cells:
            return "-"
        failed = [c.test for c in cells if c.status == "FAIL"]
        if failed:
            return f"FAIL ({', '.join(failed)})"
        return "skip" if all(c.status == "skip" for c in cells) else "pass"


@dataclass
class _Tally:
    """Runs and failures of one self-test case."""

    runs: int = 0
    failures: int = 0
    skipped: str = ""
    detail: str = ""

    def result(self, key: tuple[str, str, str]) -> CheckResult:
        status = "FAIL" if self.failures else "skip" if self.skipped and not self.runs else "pass"
        detail = self.detail if self.failures else self.skipped
        return CheckResult(*key, status=status, runs=self.runs, failures=self.failures,
                           detail=detail)


@dataclass
class _Round:
    """One round of self-tests on a device, with its generator and tallies."""

    device: torch.device
    number: int
    generator: torch.Generator
    tally: dict[tuple[str, str, str], _Tally] = field(default_factory=dict)

    def add(self, key: tuple[str, str, str], failure: str | None) -> None:
        t = self.tally.setdefault(key, _Tally())
        t.runs += 1
        if failure is not None:
            t.failures += 1
            t.detail = t.detail or f"round {self.number}: {failure}"

    def skip(self, key: tuple[str, str, str], reason: str) -> None:
        self.tally.setdefault(key, _Tally()).skipped = reason


# ------------------------------------------------------------ kernels

_Op = Callable[..., torch.Tensor]


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


def _conv2d(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.conv2d(x, w, padding=1)


def _reduce(x: torch.Tensor) -> torch.Tensor:
    # Contiguous and strided reductions take different code paths.
    return torch.cat([x.sum(dim=-1), x.sum(dim=0)])


def _shapes(kernel: str, number: int) -> list[tuple[int, ...]]:
    rows = 64 + 32 * (number % 4)  # vary sizes between rounds to reach other tilings
    if kernel == "matmul":
        return [(rows, _FAN), (_FAN, 96)]
    if kernel == "conv2d":
        return [(2, 16, 12 + number % 4, 12), (32, 16, 4, 4)]  # fan = 16*4*4 = 256
    return [(_FAN, _FAN)]


_OPS: dict[str, _Op] = {"matmul": _matmul, "conv2d": _conv2d, "reduce": _reduce}


def _integer_inputs(kernel: str, rnd: _Round) -> list[torch.Tensor]:
    return [
        torch.randint(-1, 2, shape, generator=rnd.generator).double()
        for shape in _shapes(kernel, rnd.number)
    ]


def _random_inputs(kernel: str, rnd: _Round, dtype: torch.dtype) -> list[torch.Tensor]:
    # Round to the dtype first, so the float64 reference sees the same inputs.
    return [
        torch.randn(shape, generator=rnd.generator, dtype=torch.float64).to(dtype).double()
        for shape in _shapes(kernel, rnd.number)
    ]


def _on_device(inputs: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype) -> list[
    torch.Tensor
]:
    return [t.to(device=device, dtype=dtype) for t in inputs]


def _first_difference(expected: torch.Tensor, actual: torch.Tensor) -> str:
    cmp = compare_tensors("result", expected, actual, 0.0, 0.0)
    return f"at {list(cmp.worst_index or ())}: expected {cmp.expected!r}, got {cmp.actual!r}"


def _known_answer(kernel: str, dtype: torch.dtype, rnd: _Round) -> str | None:
    inputs = _integer_inputs(kernel, rnd)
    expected = _OPS[kernel](*inputs)
    actual = _OPS[kernel](*_on_device(inputs, rnd.device, dtype)).double().cpu()
    return None if torch.equal(actual, expected) else _first_difference(expected, actual)


def _repeat(kernel: str, dtype: torch.dtype, rnd: _Round) -> str | None:
    args = _on_device(_random_inputs(kernel, rnd, dtype), rnd.device, dtype)
    first = _OPS[kernel](*args)
    for run in range(1, REPEATS):
        again = _OPS[kernel](*args)
        if not bitwise_equal(first, again):
            return f"run {run} differs from run 0 {_first_difference(first, again)}"
    return None


def _reference(kernel: str, dtype: torch.dtype, rnd: _Round) -> str | None:
    inputs = _random_inputs(kernel, rnd, dtype)
    expected = _OPS[kernel](*inputs)
    # Rounding error of a sum grows with the magnitudes of its terms, not its value.
    magnitude = _OPS[kernel](*(t.abs() for t in inputs)) / math.sqrt(_FAN)
    actual = _OPS[kernel](*_on_device(inputs, rnd.device, dtype)).double().cpu()
    rtol, _ = tolerance(dtype, "cross")
    bound = rtol * (expected.abs() + magnitude)
    err = (actual - expected).abs().nan_to_num(nan=math.inf)
    if bool((err <= bound).all()):
        return None
    worst = int(torch.argmax(err - bound))
    return (
        f"at {list(unravel(worst, expected.shape))}: reference {float(expected.view(-1)[worst])!r}"
        f", got {float(actual.view(-1)[worst])!r} (bound {float(bound.view(-1)[worst]):.3g})"
    )


_TEST_FUNCS: dict[str, Callable[[str, torch.dtype, _Round], str | None]] = {
    "known-answer": _known_answer,
    "repeat": _repeat,
    "reference": _reference,
}


def _memory(rnd: _Round, words: int) -> str | None:
    buf = torch.empty(words, dtype=torch.int32, device=rnd.device)
    for pattern in _PATTERNS:
        buf.fill_(pattern)
        bad = torch.nonzero(buf != pattern)
        if bad.numel():
            i = int(bad[0])
            return f"word {i} (byte {4 * i}): wrote {pattern:#x}, read {int(buf[i]):#x}"
    # Address-in-cell, mixed with a per-round key: catches aliased addresses.
    key = int(torch.randint(0, 2**31 - 1, (1,), generator=rnd.generator))
    expected = torch.arange(words, dtype=torch.int32, device=rnd.device) ^ key
    for fill in (expected, ~expected):
        buf.copy_(fill)
        bad = torch.nonzero(buf != fill)
        if bad.numel():
            i = int(bad[0])
            return f"word {i} (byte {4 * i}): wrote {int(fill[i]):#x}, read {int(buf[i]):#x}"
    return None


# ------------------------------------------------------------ running


def resolve_device(device: str | torch.device) -> torch.device:
    """A usable device, or a UsageError saying why not."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("CUDA was asked for but torch sees no CUDA device",
                         hint="run 'torchverity doctor' to see the torch build and drivers")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError("MPS was asked for but is not available on this machine")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"unsupported device '{device}'", hint="use cpu, cuda or mps")
    return dev


@contextmanager
def _deterministic_kernels(device: torch.device) -> Iterator[None]:
    """Pin cuDNN to deterministic algorithms so 'repeat' tests the hardware, not autotuning."""
    if device.type != "cuda":
        yield
        return
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved


def _run_round(rnd: _Round, dtypes: Sequence[torch.dtype], memory_words: int) -> None:
    for kernel in KERNELS:
        for dtype in dtypes:
            for test in TESTS:
                key = (kernel, dtype_name(dtype), test)
                try:
                    rnd.add(key, _TEST_FUNCS[test](kernel, dtype, rnd))
                except (RuntimeError, NotImplementedError) as exc:
                    if not _unsupported(exc):
                        raise
                    rnd.skip(key, f"not supported on {rnd.device.type}: {str(exc)[:120]}")
    if memory_words:
        rnd.add(("memory", MEMORY_DTYPE, "pattern"), _memory(rnd, memory_words))


def _unsupported(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "not implemented" in text or "unsupported" in text or "not supported" in text


def run_selftest(
    device: str | torch.device = "cpu",
    seconds: float | None = None,
    *,
    dtypes: Sequence[torch.dtype] = DTYPES,
    memory_mb: int | None = None,
    seed: int = 0,
) -> SelftestResult:
    """Run self-test rounds on ``device`` for about ``seconds`` (one round when None).

    ``memory_mb`` sizes the pattern-test buffer (default 32 MiB on the CPU,
    256 MiB on accelerators; 0 skips it).
    """
    dev = resolve_device(device)
    unsupported = [dtype_name(d) for d in dtypes if d not in SUPPORTED_DTYPES]
    if unsupported:
        raise UsageError(f"selftest cannot test {', '.join(unsupported)}",
                         hint="use float64, float32, float16 or bfloat16")
    if memory_mb is None:
        memory_mb = 32 if dev.type == "cpu" else 256
    words = memory_mb * (1 << 20) // 4
    generator = torch.Generator().manual_seed(seed)
    tally: dict[tuple[str, str, str], _Tally] = {}
    start = time.perf_counter()
    rounds = 0
    with _deterministic_kernels(dev):
        while True:
            began = time.perf_counter()
            _run_round(_Round(dev, rounds, generator, tally), dtypes, words)
            _sync(dev)
            rounds += 1
            now = time.perf_counter()
            if seconds is None or now + (now - began) > start + seconds:
                break
    checks = tuple(t.result(key) for key, t in tally.items())
    return SelftestResult(
        ok=not any(c.status == "FAIL" for c in checks),
        device=str(dev),
        device_name=device_name(dev),
        seconds=time.perf_counter() - start,
        rounds=rounds,
        checks=checks,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------ fault drill


_FLIP_BIT = {
    torch.float32: 21, torch.float64: 50, torch.float16: 8, torch.bfloat16: 5, torch.int32: 13,
}
_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


class FaultyKernels(TorchDispatchMode):
    """Fault drill: a simulated faulty device.

    Inside ``with FaultyKernels(...)``, every ``every``-th call of the named
    aten operators (``mm``, ``addmm``, ``bmm``, ``convolution``, ``sum`` by
    default; in-place ones such as ``fill_`` simulate stuck memory bits) gets
    one bit of one element of its floating-point or int32 result flipped.
    ``bit`` picks the bit (default: a high mantissa bit, a change of 6-25%);
    ``hits`` records ``(operator, call number, flat index)`` of every flip.
    """

    def __init__(
        self,
        ops: Sequence[str] = ("mm", "addmm", "bmm", "convolution", "sum"),
        every: int = 3,
        bit: int | None = None,
    ) -> None:
        super().__init__()
        if every < 1:
            raise UsageError(f"FaultyKernels(every={every}) must be at least 1")
        self.ops = frozenset(ops)
        self.every = every
        self.bit = bit
        self.calls = 0
        self.hits: list[tuple[str, int, int]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in self.ops and isinstance(out, torch.Tensor) and self._corruptible(out):
            self.calls += 1
            if self.calls % self.every == 0:
                self._flip(name, out)
        return out

    @staticmethod
    def _corruptible(t: torch.Tensor) -> bool:
        return t.dtype in _FLIP_BIT and t.numel() > 0 and t.is_contiguous()

    def _flip(self, name: str, out: torch.Tensor) -> None:
        index = (self.calls * 7919) % out.numel()
        bit = _FLIP_BIT[out.dtype] if self.bit is None else self.bit
        words = out.view(-1).view(_INT_VIEW[out.element_size()])
        words[index] ^= 1 << bit
        self.hits.append((name, self.calls, index))
