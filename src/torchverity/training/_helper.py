"""The guard's optional helper thread (``overlap=True`` / ``defer_record=True``, CPU only)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Helper:
    """One background thread for guard work that may run beside the training thread.

    Opt-in (``overlap=True``), for CPU parameters with a core to spare; on an
    accelerator the work is already asynchronous. It sums half of the bytes of each
    memory-bound pass (gradient norms, at-rest verification and record) beside the
    training thread, each pass complete before the guard goes on (the verification
    before the update starts, the record before ``step()`` returns), and takes the
    step's bookkeeping (device rules: statistics, flag row), which touches no guarded
    tensor, beside the next forward pass. With ``defer_record=True`` (alone or with
    ``overlap``) it also takes the whole at-rest record beside the next forward pass.
    Jobs run in submission order; :meth:`join` waits for all of them and re-raises the
    first failure.
    """

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="torchverity-guard")
        self._jobs: list[Future[None]] = []

    def submit(self, fn: Callable[[], None]) -> None:
        self._jobs.append(self.pool.submit(_no_grad_call, fn))

    def join(self) -> None:
        jobs, self._jobs = self._jobs, []
        for job in jobs:
            job.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _no_grad_call(fn: Callable[[], None]) -> None:
    # Grad mode is per thread, and a new thread starts with it on.
    with torch.no_grad():
        fn()
