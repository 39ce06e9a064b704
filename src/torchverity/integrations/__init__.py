"""Trainer integrations (extras): the TrainingGuard as a Lightning or Hugging Face callback.

* ``torchverity.integrations.lightning.GuardCallback`` (``pip install 'torchverity[lightning]'``)
* ``torchverity.integrations.hf.GuardCallback`` (``pip install 'torchverity[hf]'``)

Both run the same detectors and policies as :class:`torchverity.TrainingGuard`
and record every checkpoint the trainer saves: a ``FILE.blake3`` sidecar and
a ``FILE.meta.json`` with the content fingerprint, exactly what
``torchverity.save`` writes, so ``torchverity verify`` and ``torchverity.load``
check those files like their own. The records are written after the guard has
verified the weights being saved at rest; meta.json carries that certification
(uncertified while an anomaly is unresolved). The guard's own state (rolling
windows, counters) travels in the trainer's checkpoints and is restored on resume.

This module imports neither Lightning nor transformers.
"""

from __future__ import annotations

__all__: list[str] = []
