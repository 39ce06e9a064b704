"""Determinism and data-order records.

* :func:`seed_everything` seeds Python, NumPy, torch and CUDA and (by default)
  turns on deterministic algorithms, so two runs can be compared bit for bit.
* :func:`capture_rng` / :func:`restore_rng` snapshot every RNG; ``to_state()``
  gives plain tensors and lists that ``torch.load(weights_only=True)`` accepts,
  so the state can travel inside a checkpoint.
* :class:`RecordingSampler` wraps a sampler and records a SHA-256 digest of each
  epoch's index order (and the order itself on request); its ``state_dict``
  lets a resumed run prove it continues the same order.
* :func:`reproducibility_check` runs N steps twice from the same state and
  names the first step and tensor that diverge.

>>> import torchverity
>>> record = torchverity.seed_everything(0)
>>> record.seed
0
"""

from __future__ import annotations

import copy
import hashlib
import os
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torchverity.checkpoint._fingerprint import checksum_tensors
from torchverity.errors import FormatError, IntegrityError, UsageError

# cuBLAS needs a fixed workspace to be deterministic (NVIDIA's documented values).
CUBLAS_WORKSPACE = ":4096:8"


@dataclass(frozen=True)
class SeedRecord:
    """What :func:`seed_everything` set, to be stored with a run's metadata."""

    seed: int
    deterministic: bool
    torch_version: str
    cublas_workspace_config: str | None
    cuda_devices: int


def seed_everything(
    seed: int, *, deterministic: bool = True, warn_only: bool = False
) -> SeedRecord:
    """Seed every RNG and make torch pick deterministic kernels.

    ``PYTHONHASHSEED`` is set for child processes (dataloader workers started
    with spawn); the current interpreter's hash seed cannot change after start.
    With ``deterministic=True`` an operation that has no deterministic kernel
    raises, unless ``warn_only=True``.
    """
    if not 0 <= seed < 2**32:
        raise UsageError(f"seed {seed} is out of range", hint="use an integer in [0, 2**32)")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    os.environ["PYTHONHASHSEED"] = str(seed)
    if deterministic:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic and torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    return SeedRecord(
        seed=seed,
        deterministic=deterministic,
        torch_version=torch.__version__,
        cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0,
    )


# ------------------------------------------------------------ RNG states


@dataclass(frozen=True)
class RngState:
    """Every RNG's state at one moment."""

    python: tuple[Any, ...]
    numpy: Any
    cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...] = ()

    def to_state(self) -> dict[str, Any]:
        """Plain values and tensors only, loadable with ``torch.load(weights_only=True)``."""
        version, words, gauss = self.python
        kind, keys, pos, has_gauss, cached = self.numpy
        return {
            "python": {"version": version, "state": torch.tensor(words, dtype=torch.int64),
                       "gauss": gauss},
            "numpy": {"kind": kind, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
            "torch": self.cpu.clone(),
            "cuda": [s.clone() for s in self.cuda],
        }

    @classmethod
    def from_state(cls, data: Mapping[str, Any]) -> RngState:
        try:
            py, npy = data["python"], data["numpy"]
            return cls(
                python=(py["version"], tuple(int(w) for w in py["state"].tolist()), py["gauss"]),
                numpy=(npy["kind"], npy["keys"].numpy().astype(np.uint32), int(npy["pos"]),
                       int(npy["has_gauss"]), float(npy["cached"])),
                cpu=data["torch"],
                cuda=tuple(data.get("cuda", ())),
            )
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise FormatError(f"not a valid RNG state record: {exc!r}") from None


def capture_rng() -> RngState:
    """Snapshot the Python, NumPy, torch CPU and every CUDA RNG."""
    cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else ()
    return RngState(random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda)


def restore_rng(state: RngState) -> None:
    """Put every RNG back to ``state``."""
    random.setstate(state.python)
    np.random.set_state(state.numpy)
    torch.set_rng_state(state.cpu)
    if state.cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state.cuda))


# ------------------------------------------------------------ data order


@dataclass(frozen=True)
class EpochOrder:
    """The record of one epoch's index order."""

    epoch: int
    count: int
    digest: str
    order: tuple[int, ...] | None = None


def order_digest(indices: Sequence[int] | torch.Tensor) -> str:
    """SHA-256 of an index order (int64 little-endian), the value :class:`EpochOrder` holds."""
    arr = torch.as_tensor(indices, dtype=torch.int64).contiguous()
    h = hashlib.sha256(f"torchverity-order-v1\0{arr.numel()}\0".encode())
    h.update(arr.numpy().astype("<i8", copy=False).tobytes())
    return h.hexdigest()


class RecordingSampler(torch.utils.data.Sampler[int]):
    """Wrap a sampler and record a digest of each epoch's index order.

    The epoch's order is materialised (8 bytes per index) when iteration
    starts, hashed, then yielded. ``state_dict(position=...)`` records the
    epoch, its digest, how far the run got and the inner sampler's generator
    state; after ``load_state_dict`` the next iteration regenerates the
    order, refuses to continue if its digest differs (``IntegrityError``), and
    resumes at ``position``.
    """

    def __init__(self, sampler: Any, *, keep_order: bool = False) -> None:
        self.sampler = sampler
        self.keep_order = keep_order
        self.epoch = 0
        self.records: list[EpochOrder] = []
        self.yielded = 0
        self._resume: dict[str, Any] | None = None
        self._generator_state: torch.Tensor | None = None
        self._digest: str | None = None

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def _generator(self) -> torch.Generator | None:
        gen = getattr(self.sampler, "generator", None)
        return gen if isinstance(gen, torch.Generator) else None

    def __iter__(self) -> Iterator[int]:
        start = self._prepare_resume()
        gen = self._generator()
        self._generator_state = gen.get_state() if gen is not None else None
        order = torch.tensor(list(iter(self.sampler)), dtype=torch.int64)
        self._digest = order_digest(order)
        self._check_resume(self._digest)
        kept = tuple(order.tolist()) if self.keep_order else None
        self.records.append(EpochOrder(self.epoch, order.numel(), self._digest, kept))
        epoch = self.epoch
        self.yielded = start
        for index in order[start:].tolist():
            self.yielded += 1
            yield index
        if self.epoch == epoch and not hasattr(self.sampler, "set_epoch"):
            self.epoch += 1

    def _prepare_resume(self) -> int:
        if self._resume is None:
            return 0
        gen, state = self._generator(), self._resume.get("generator_state")
        if gen is not None and state is not None:
            gen.set_state(state)
        self.set_epoch(int(self._resume["epoch"]))
        return int(self._resume["position"])

    def _check_resume(self, digest: str) -> None:
        if self._resume is None:
            return
        expected, self._resume = self._resume["digest"], None
        if digest != expected:
            raise IntegrityError(
                f"data order of epoch {self.epoch} differs from the recorded run",
                expected=expected, actual=digest,
                hint="resume with the same sampler, seed and dataset as the recorded run",
            )

    def state_dict(self, position: int | None = None) -> dict[str, Any]:
        """Where the run is: epoch, order digest, ``position`` (default: indices yielded)."""
        if self._digest is None:
            raise UsageError("RecordingSampler.state_dict() before the first epoch started")
        return {
            "epoch": self.epoch,
            "digest": self._digest,
            "position": self.yielded if position is None else position,
            "generator_state": self._generator_state,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = {"epoch", "digest", "position"} - set(state)
        if missing:
            raise FormatError(f"sampler state lacks {sorted(missing)}")
        self._resume = dict(state)


# ------------------------------------------------------------ reproducibility


@dataclass(frozen=True)
class ReproducibilityResult:
    """Outcome of :func:`reproducibility_check`. ``first_step`` is None when both runs agree."""

    ok: bool
    steps: int
    first_step: int | None = None
    tensors: tuple[str, ...] = ()
    losses: tuple[float | None, float | None] = (None, None)


@dataclass
class _Snapshot:
    """What each replay starts from: the objects' states and the RNG."""

    states: list[Any]
    rng: RngState


def _named_state(objects: Sequence[Any]) -> tuple[list[str], list[torch.Tensor]]:
    from torchverity._tensors import iter_leaves

    names: list[str] = []
    tensors: list[torch.Tensor] = []
    for i, obj in enumerate(objects):
        prefix = "model" if i == 0 else f"state{i}"
        for name, value in iter_leaves(obj.state_dict(), prefix):
            if isinstance(value, torch.Tensor):
                names.append(name)
                tensors.append(value)
    return names, tensors


def _step_record(loss: Any, objects: Sequence[Any]) -> tuple[list[str], list[list[int]], Any]:
    names, tensors = _named_state(objects)
    sums = [checksum_tensors([t]).cpu().reshape(-1).tolist() for t in tensors]
    if isinstance(loss, torch.Tensor):
        loss = loss.detach().float().cpu().item()
    return names, sums, loss


def reproducibility_check(
    step_fn: Callable[[int], Any], *, steps: int, model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None, extra: Sequence[Any] = (),
) -> ReproducibilityResult:
    """Run ``step_fn(step)`` for ``steps`` steps twice from the same state and compare.

    ``step_fn`` does one full training step (forward, backward, optimizer step)
    and may return the loss. Model, optimizer, ``extra`` objects with
    ``state_dict``/``load_state_dict`` and every RNG are snapshotted before the
    first run, restored before the second and again at the end, so the check
    leaves training where it was. After each step every tensor of their
    states is compared bit for bit; the first step with a difference is
    reported with the names of the differing tensors.
    """
    if steps < 1:
        raise UsageError("reproducibility_check needs steps >= 1")
    objects: list[Any] = [model, *([optimizer] if optimizer is not None else []), *extra]
    snap = _Snapshot([copy.deepcopy(o.state_dict()) for o in objects], capture_rng())
    first = _run(step_fn, steps, objects)
    _restore(snap, objects)
    second = _run(step_fn, steps, objects)
    _restore(snap, objects)
    for step, ((names_a, sums_a, loss_a), (names_b, sums_b, loss_b)) in enumerate(
        zip(first, second, strict=True)
    ):
        differing = _differing(names_a, sums_a, names_b, sums_b)
        if differing or not _same_loss(loss_a, loss_b):
            return ReproducibilityResult(False, steps, step, tuple(differing), (loss_a, loss_b))
    return ReproducibilityResult(True, steps)


def _run(step_fn: Callable[[int], Any], steps: int, objects: Sequence[Any]) -> list[Any]:
    return [_step_record(step_fn(step), objects) for step in range(steps)]


def _restore(snap: _Snapshot, objects: Sequence[Any]) -> None:
    for obj, state in zip(objects, snap.states, strict=True):
        obj.load_state_dict(copy.deepcopy(state))
    restore_rng(snap.rng)


def _differing(names_a: list[str], sums_a: list[Any], names_b: list[str],
               sums_b: list[Any]) -> list[str]:
    a, b = dict(zip(names_a, sums_a, strict=True)), dict(zip(names_b, sums_b, strict=True))
    return sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))


def _same_loss(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    return bool(a == b)
