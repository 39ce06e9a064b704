"""The at-rest check in the optimizer's own pass, on the CPU: one loop that reads, sums,
updates, sums and writes each block of every parameter and state tensor.

``torch.compile`` cannot give that loop on a CPU: the C++ it generates sums what an
in-place update is about to overwrite in loops of its own, before the update's, which
costs about half the update again in memory traffic. This module compiles a small C
file (``_native_update.c``, with the system's C compiler, once per machine, into the
user's cache) that does SGD, Adam and AdamW on dense float32 tensors with the same
arithmetic as torch's eager kernels, so the update is bit for bit what
``optimizer.step()`` computes, eagerly. That claim is not taken on trust: before a guard
uses the kernel, :func:`agrees` runs the optimizer itself and the kernel side by side
on tensors of every length class (vector bodies, scalar tails, thread splits) with the
optimizer's own settings, and any differing bit sends the guard to the compiled update.

Nothing from a checkpoint or a model reaches the compiler: the source is this package's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.optim.optimizer as _optim

from torchverity.training._fused import FusedUpdate, word_sums

log = logging.getLogger("torchverity.training")

_SOURCE = Path(__file__).with_name("_native_update.c")
# -fno-math-errno: sqrtf becomes the vector instruction (errno is never read here).
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared")
_SLOTS = 5  # p, first state, second state, max second state, step


class _Item(ctypes.Structure):
    _fields_ = [("p", ctypes.c_void_p), ("g", ctypes.c_void_p), ("m", ctypes.c_void_p),
                ("v", ctypes.c_void_p), ("vmax", ctypes.c_void_p), ("step", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("slot", ctypes.c_int32 * _SLOTS),
                ("group", ctypes.c_int32), ("neg_step_size", ctypes.c_float),
                ("bc2_sqrt", ctypes.c_float)]


class _Group(ctypes.Structure):
    _fields_ = [("adam", ctypes.c_int32), ("maximize", ctypes.c_int32),
                ("has_wd", ctypes.c_int32), ("decoupled", ctypes.c_int32),
                ("amsgrad", ctypes.c_int32), ("lerp_small", ctypes.c_int32),
                ("has_momentum", ctypes.c_int32), ("nesterov", ctypes.c_int32),
                ("compiled", ctypes.c_int32),
                ("p_mul", ctypes.c_float), ("wd", ctypes.c_float), ("w1", ctypes.c_float),
                ("w1_minus_1", ctypes.c_float), ("beta1f", ctypes.c_float),
                ("lrf", ctypes.c_float),
                ("beta2", ctypes.c_float), ("c2", ctypes.c_float), ("eps", ctypes.c_float),
                ("momentum", ctypes.c_float), ("one_minus_dampening", ctypes.c_float),
                ("neg_lr", ctypes.c_float), ("lr", ctypes.c_double), ("beta1", ctypes.c_double),
                ("beta2d", ctypes.c_double), ("sqrt", ctypes.c_void_p),
                ("vector", ctypes.c_int64)]


# ---------------------------------------------------------------- building the kernel

def _cache_dir() -> Path:
    root = os.environ.get("TORCHVERITY_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torchverity")
    return Path(root) / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _build(compiler: str) -> Path:
    """The shared library, compiled once per source, compiler and machine."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True, timeout=30).stdout
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(_FLAGS).encode(),
                                     platform.machine().encode()])).hexdigest()[:16]
    target = _cache_dir() / f"native_update-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(out), "-lm"],
                       capture_output=True, text=True, check=True, timeout=120)
        os.replace(out, target)  # whole or absent, whichever process finishes first
    return target


def _vsqrt() -> int | None:
    """The address of MKL's ``vsSqrt`` inside torch: what ATen's float32 sqrt calls."""
    lib_dir = Path(torch.__file__).parent / "lib"
    for path in sorted(lib_dir.glob("libtorch_cpu.*")):
        try:
            fn = ctypes.CDLL(str(path)).vsSqrt
        except (OSError, AttributeError):
            continue
        return ctypes.cast(fn, ctypes.c_void_p).value
    return None


@functools.cache
def _kernel() -> tuple[ctypes.CDLL, int] | str:
    """``(library, vsSqrt address)``, or why there is none on this machine."""
    if sys.platform != "linux":
        return f"the native update is built on Linux only (this is {sys.platform})"
    sqrt = _vsqrt()
    if sqrt is None:
        return "this torch build does not take its float32 sqrt from MKL"
    compiler = _compiler()
    if compiler is None:
        return "no C compiler (cc, gcc or clang) on PATH"
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        return f"compiling the native update failed: {str(detail).strip()[:300]}"
    lib.tv_prepare.argtypes = [ctypes.POINTER(_Item), ctypes.c_int64, ctypes.POINTER(_Group),
                               ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.tv_run.argtypes = [ctypes.POINTER(_Item), ctypes.c_int64, ctypes.POINTER(_Group),
                           ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.tv_prepare.restype = lib.tv_run.restype = None
    return lib, sqrt


# ---------------------------------------------------------------- which optimizers

def _group_reason(optimizer: torch.optim.Optimizer, group: dict[str, Any],
                  compiled: bool) -> str | None:
    if type(optimizer) not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        return f"{type(optimizer).__name__} has no native update"
    for flag in ("capturable", "differentiable") + (("fused",) if compiled else ()):
        if group.get(flag):
            return f"{flag}=True"
    if any(isinstance(b, torch.Tensor) for b in group.get("betas", ())):
        return "tensor betas"
    lr = group["lr"]
    if not compiled and isinstance(lr, torch.Tensor):
        return "a tensor lr"
    # The compiled step reads a tensor lr; a float one is baked into the graph.
    if compiled and not (isinstance(lr, torch.Tensor) and lr.dtype == torch.float32
                         and lr.device.type == "cpu" and lr.dim() == 0):
        return "a float lr (torch.compile bakes it into the graph: foreach=True groups)"
    for p in group["params"]:
        if p.dtype != torch.float32 or p.device.type != "cpu" or not _dense(p):
            return "parameters other than dense float32 on the CPU"
        if group.get("fused") and not p.is_contiguous():
            return "fused=True with parameters in another memory format than contiguous"
    return None


def unsupported(optimizer: torch.optim.Optimizer, compiled: bool = False) -> str | None:
    """Why the native update cannot run this optimizer (with the arithmetic of
    ``torch.compile(optimizer.step)``: ``compiled``); None when it can."""
    for group in optimizer.param_groups:
        reason = _group_reason(optimizer, group, compiled)
        if reason is not None:
            return reason
    kernel = _kernel()
    return kernel if isinstance(kernel, str) else None


def _fill_group(out: _Group, optimizer: torch.optim.Optimizer, group: dict[str, Any],
                sqrts: tuple[int, int], compiled: bool, vector: int) -> None:
    """The group's scalars, each rounded to float as torch's kernels receive it; its sqrt
    (``sqrts``: MKL's for the eager ops, a correctly rounded one for fused=True and for
    the compiled step) and, for fused=True, the vector width that leaves a scalar tail in
    torch's kernel on this CPU (``vector``). ``compiled``: the constants inductor bakes
    into the compiled step (the Python floats' own arithmetic, rounded once to float)."""
    lr, wd = float(group["lr"]), float(group["weight_decay"])
    fused = bool(group.get("fused"))
    out.compiled, out.lrf = compiled, lr
    out.sqrt = sqrts[1] if fused or compiled else sqrts[0]
    out.vector = vector if fused else 0
    out.maximize, out.has_wd = bool(group["maximize"]), wd != 0
    out.wd, out.lr = wd, lr
    if isinstance(optimizer, torch.optim.Adam):
        beta1, beta2 = (float(b) for b in group["betas"])
        out.adam, out.amsgrad = 1, bool(group["amsgrad"])
        out.decoupled = bool(group.get("decoupled_weight_decay")) or isinstance(
            optimizer, torch.optim.AdamW)
        out.p_mul = 1 - lr * wd
        out.w1, out.w1_minus_1, out.beta1f = 1 - beta1, (1 - beta1) - 1, beta1
        # ATen's test, on the weight as a float; the compiled graph's, on the Python float.
        out.lerp_small = abs(1 - beta1 if compiled else out.w1) < 0.5
        out.beta2, out.c2, out.eps = beta2, 1 - beta2, float(group["eps"])
        out.beta1, out.beta2d = beta1, beta2
    else:
        momentum = float(group["momentum"])
        out.adam, out.has_momentum = 0, momentum != 0
        out.momentum, out.one_minus_dampening = momentum, 1 - float(group["dampening"])
        out.nesterov, out.neg_lr = bool(group["nesterov"]), -lr


# ---------------------------------------------------------------- the update

# Floats per ATen vector, by the kernels torch dispatched to on this CPU.
_VECTOR = {"AVX512": 16, "AVX2": 8, "DEFAULT": 8}

_STATE_KEYS = {True: ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"),
               False: ("momentum_buffer", None, None, None)}


class NativeUpdate:
    """``optimizer.step()`` on the CPU with the word sums of ``tensors`` before and after,
    in one pass (``compiled``: the step ``torch.compile(optimizer.step)`` computes);
    :meth:`__call__` returns None when the step must run another way (state not created
    yet, a tensor in a layout the kernel does not take)."""

    def __init__(self, optimizer: torch.optim.Optimizer, compiled: bool = False) -> None:
        kernel = _kernel()
        assert not isinstance(kernel, str)
        self._lib, mkl = kernel
        exact = ctypes.cast(self._lib.tv_sqrt, ctypes.c_void_p).value
        assert exact is not None
        self._sqrts = (mkl, exact)
        self.optimizer = optimizer
        self.compiled = compiled
        self._key: list[int] | None = None
        self._usable = False
        self._items: Any = None
        self._grads: list[tuple[int, torch.Tensor, bool, bool]] = []
        self._vector = _VECTOR.get(torch.backends.cpu.get_cpu_capability(), 8)
        self._total = 0
        self._groups = (_Group * len(optimizer.param_groups))()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_of = (0, 0)  # the process and thread count the pool was made for
        self._proven = _branches(optimizer)  # what agrees() was run with
        self.declined: str | None = None  # why the settings now in place are not proven

    def __call__(self, tensors: Sequence[torch.Tensor], ptrs: list[int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The update; ``ptrs``: the tensors' ``data_ptr()``, when the caller has them."""
        if _has_hooks(self.optimizer) or _scaled(self.optimizer):
            return None  # hooks, or a gradient scaler's found_inf: the optimizer's own step
        if not self._still_proven():
            return None
        key = ptrs if ptrs is not None else [t.data_ptr() for t in tensors]
        if key != self._key:  # built once per set of tensors and storage, usable or not
            self._key, self._usable = key, self._layout(tensors)
        if not self._usable or not self._point_grads():
            return None
        for out, group in zip(self._groups, self.optimizer.param_groups, strict=True):
            _fill_group(out, self.optimizer, group, self._sqrts, self.compiled, self._vector)
        n = len(tensors)
        threads = self._threads()
        sums = torch.zeros(2, threads, max(n, 1), dtype=torch.int32)
        old, new = sums[0], sums[1]
        self._lib.tv_prepare(self._items, len(self._items), self._groups, len(self._groups),
                             old[0].data_ptr(), new[0].data_ptr())
        self._run(threads, old, new)
        if threads == 1:  # one row already holds the sums: no reduction to dispatch
            return old[0, :n], new[0, :n]
        before, after = old.sum(0, dtype=torch.int32), new.sum(0, dtype=torch.int32)
        return before[:n], after[:n]

    def _still_proven(self) -> bool:
        """Whether the optimizer's settings take the paths the proof took. A change (a
        group added, weight decay turned on, a tensor lr) is proven again, once; what
        fails to prove steps the optimizer's own way from then on, with the sums in
        passes of their own."""
        branches = _branches(self.optimizer)
        if branches != self._proven:
            self._proven = branches
            self.declined = (unsupported(self.optimizer, self.compiled)
                             or agrees(self.optimizer, self.compiled))
            if self.declined is not None:
                log.warning("torchverity: the optimizer's settings changed and the native "
                            "update no longer reproduces its step (%s); %s", self.declined,
                            "the compiled update runs it" if self.compiled else
                            "the optimizer steps itself, the at-rest sums are taken in passes")
            self._groups = (_Group * len(self.optimizer.param_groups))()
            self._key = None
        return self.declined is None

    def _threads(self) -> int:
        total = self._total
        return max(1, min(torch.get_num_threads(), total >> 16))

    def _run(self, threads: int, old: torch.Tensor, new: torch.Tensor) -> None:
        total, run = self._total, self._lib.tv_run
        cuts = [total * t // threads for t in range(threads + 1)]
        calls = [(self._items, len(self._items), self._groups, cuts[t], cuts[t + 1],
                  old[t].data_ptr(), new[t].data_ptr()) for t in range(threads)]
        if threads == 1:
            run(*calls[0])
            return
        # A forked child has the pool but not its threads: it starts its own.
        if self._pool is None or self._pool_of != (os.getpid(), threads):
            self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="torchverity-update")
            self._pool_of = (os.getpid(), threads)
        futures = [self._pool.submit(run, *c) for c in calls[1:]]  # ctypes drops the GIL
        run(*calls[0])
        for f in futures:
            f.result()

    def _layout(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Build the per-tensor descriptors; False when some tensor is not one the kernel
        takes (then this update runs eagerly)."""
        slot = {id(t): i for i, t in enumerate(tensors)}
        adam = isinstance(self.optimizer, torch.optim.Adam)
        placed: set[int] = set()
        items: list[tuple[list[int | None], int, list[int], int]] = []
        grads: list[tuple[int, torch.Tensor, bool, bool]] = []
        for g, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                state = self.optimizer.state.get(p, {})
                parts = [p] + [state.get(k) if k else None for k in _STATE_KEYS[adam]]
                if any(t is not None and not _takes(t, p) for t in parts):
                    return False
                # State the optimizer creates in the first update with a gradient.
                fresh = not state if adam else (parts[1] is None and group["momentum"] != 0)
                placed.update(id(t) for t in parts if t is not None)
                grads.append((len(items), p, fresh, p.is_contiguous()))
                items.append(([t.data_ptr() if t is not None else None for t in parts],
                              p.numel(), [slot.get(id(t), -1) if t is not None else -1
                                          for t in parts], g))
        if any(id(t) not in placed for t in tensors):
            return False  # a covered tensor the update does not touch: sums in passes
        arr = (_Item * len(items))()
        for it, (ptrs, n, slots, g) in zip(arr, items, strict=True):
            it.p, it.m, it.v, it.vmax, it.step = ptrs
            it.n, it.group = n, g
            it.slot[:] = slots
        self._items, self._grads = arr, grads
        self._total = sum(n for _, n, _, _ in items)
        return True

    def _point_grads(self) -> bool:
        """Each item's gradient pointer for this update (None: the update skips it);
        False when a gradient is in a layout the kernel does not take, or meets a
        parameter whose state the optimizer has yet to create."""
        items = self._items
        for i, p, fresh, contiguous in self._grads:
            grad = p.grad
            if grad is None:
                items[i].g = None
            elif fresh or grad.is_sparse or not (_plain(grad, contiguous) or _takes(grad, p)):
                return False
            else:
                items[i].g = grad.data_ptr()
        return True


def _takes(t: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether the kernel reads ``t`` beside ``param``: float32 on the CPU in the same dense
    layout, so that the i-th word of each in memory is the same element (or a scalar: Adam's
    step counter)."""
    return (t.dtype == torch.float32 and t.is_cpu and _dense(t)
            and (t.dim() == 0 or t.stride() == param.stride()))


def _plain(grad: torch.Tensor, contiguous: bool) -> bool:
    """``_takes`` for the common case, cheaper: a gradient has its parameter's shape (torch
    checks), so beside a ``contiguous`` parameter a contiguous float32 one lines up."""
    return contiguous and grad.dtype == torch.float32 and grad.is_cpu and grad.is_contiguous()


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers one block of memory, each element once, in some order of its
    dimensions (contiguous, channels_last, ...): an elementwise update may run through it
    in memory order."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True)
                               if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _branches(optimizer: torch.optim.Optimizer) -> tuple[tuple[object, ...], ...]:
    """What decides which operations each group's update runs (the values themselves
    only pass through the same roundings)."""
    def of(g: dict[str, Any]) -> tuple[object, ...]:
        betas = g.get("betas", (0.0, 0.0))
        return (isinstance(g["lr"], torch.Tensor), any(isinstance(b, torch.Tensor) for b in betas),
                abs(1 - float(betas[0])) < 0.5, float(g["weight_decay"]) != 0,
                float(g.get("momentum", 0.0)) != 0,
                *(bool(g.get(k)) for k in ("maximize", "amsgrad", "nesterov", "foreach", "fused",
                                            "capturable", "differentiable",
                                            "decoupled_weight_decay")))
    return tuple(of(g) for g in optimizer.param_groups)


def _scaled(optimizer: torch.optim.Optimizer) -> bool:
    """A gradient scaler (or a skip decision) handed to a fused optimizer for this step."""
    return (getattr(optimizer, "grad_scale", None) is not None
            or getattr(optimizer, "found_inf", None) is not None)


def _has_hooks(optimizer: torch.optim.Optimizer) -> bool:
    return any((optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks,
                _optim._global_optimizer_pre_hooks, _optim._global_optimizer_post_hooks))


# ---------------------------------------------------------------- the proof, per machine

# Lengths that take every path through torch's kernels and this one: shorter than one
# vector, vector bodies with and without scalar tails, more than one block, and more
# than ATen's grain (32768 elements), where its threads split a tensor.
_PROBE_LENGTHS = (1, 3, 8, 15, 16, 17, 33, 1023, 1025, 4099, 70001)
_PROBE_STEPS = 4
# The compiled step's arithmetic does not depend on a tensor's length (inductor's loops end
# in masked vector tails, the kernel's compiled path has no scalar tail): fewer lengths,
# one for each of the kernel's own paths (a short tensor, a tail, blocks, two threads),
# keep the proof's compilation short.
_COMPILED_PROBE_LENGTHS = (3, 17, 1025, 70001)


def _state_tensors(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]
                   ) -> list[torch.Tensor]:
    return [v for p in params for v in optimizer.state.get(p, {}).values()
            if isinstance(v, torch.Tensor)]


def _bits(tensors: Sequence[torch.Tensor]) -> list[bytes]:
    return [t.detach().reshape(-1).numpy().tobytes() for t in tensors]


@torch.no_grad()
def agrees(optimizer: torch.optim.Optimizer, compiled: bool = False) -> str | None:
    """None when the kernel reproduces ``optimizer.step()`` (``compiled``: the step
    ``torch.compile`` makes of it) bit for bit, and its word sums those of
    :func:`~torchverity.training._fused.word_sums`, on probe tensors with each group's
    own settings; otherwise what differed."""
    gen = torch.Generator().manual_seed(0x5EED)
    proven: set[str] = set()
    for index, group in enumerate(optimizer.param_groups):
        settings = {k: v for k, v in group.items() if k != "params"}
        # Groups that differ only in their learning rate (layer-wise decay) take the same
        # operations with another scalar: one proof serves them all.
        same = repr(sorted((k, v) for k, v in settings.items() if k not in ("lr", "initial_lr")))
        if same in proven:
            continue
        proven.add(same)
        prove = _prove_compiled if compiled else _prove_eager
        why = prove(type(optimizer), settings, gen)
        if why is not None:
            return f"group {index}: {why}"
    return None


def _probe_grads(params: Sequence[torch.Tensor], others: Sequence[torch.Tensor],
                 step: int, gen: torch.Generator) -> None:
    for i, (a, b) in enumerate(zip(params, others, strict=True)):
        skip = step == 2 and i == 1  # a parameter without a gradient this time
        grad = None if skip else torch.randn(a.shape, generator=gen)
        a.grad, b.grad = grad, None if grad is None else grad.clone()


def _prove_eager(make: Any, settings: dict[str, Any], gen: torch.Generator) -> str | None:
    base = [torch.randn(n, generator=gen) for n in _PROBE_LENGTHS]
    theirs = [torch.nn.Parameter(b.clone()) for b in base]
    ours = [torch.nn.Parameter(b.clone()) for b in base]
    reference, probe = make(theirs), make(ours)  # SGD, Adam or AdamW: defaults for all
    reference.param_groups[0].update(settings)
    probe.param_groups[0].update(settings)
    native = NativeUpdate(probe)
    for step in range(_PROBE_STEPS):
        _probe_grads(theirs, ours, step, gen)
        reference.step()
        tensors = ours + _state_tensors(probe, ours)
        read = word_sums(tensors)
        sums = native(tensors)
        if sums is None:
            if step > 0:
                return "the native update declined a probe step"
            probe.step()
        if _bits(theirs + _state_tensors(reference, theirs)) != _bits(
                ours + _state_tensors(probe, ours)):
            return f"the native update differs from {make.__name__}.step() in step {step + 1}"
        if sums is not None and not (torch.equal(sums[0], read)
                                     and torch.equal(sums[1], word_sums(tensors))):
            return "the native update's word sums differ"
    return None


def _prove_compiled(make: Any, settings: dict[str, Any], gen: torch.Generator) -> str | None:
    """Against the guard's compiled update (``torch.compile`` of the optimizer's own step
    with the sums), from the state its first step created."""
    def with_lr(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        opt = make(params)
        opt.param_groups[0].update(settings, lr=torch.tensor(float(settings["lr"])))
        return opt
    theirs = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in _COMPILED_PROBE_LENGTHS]
    reference = with_lr(theirs)
    compiled_step = FusedUpdate(reference)
    _probe_grads(theirs, theirs, 0, gen)
    compiled_step(list(theirs))  # creates the state
    ours = [torch.nn.Parameter(t.detach().clone()) for t in theirs]
    probe = with_lr(ours)
    for a, b in zip(theirs, ours, strict=True):
        probe.state[b] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                          for k, v in reference.state[a].items()}
    native = NativeUpdate(probe, compiled=True)
    for step in range(1, _PROBE_STEPS):
        _probe_grads(theirs, ours, step, gen)
        want = compiled_step(theirs + _state_tensors(reference, theirs))
        got = native(ours + _state_tensors(probe, ours))
        if got is None:
            return "the native update declined a probe step"
        if _bits(theirs + _state_tensors(reference, theirs)) != _bits(
                ours + _state_tensors(probe, ours)):
            return (f"the native update differs from torch.compile({make.__name__}.step) "
                    f"in step {step + 1}")
        if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
            return "the native update's word sums differ"
    return None
