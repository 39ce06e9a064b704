"""Inference integrity: run-to-run consistency and golden outputs.

A model that loads may still compute wrong answers. Two checks catch it:

``consistency_check(model, sample, runs=2)``
    Runs the model several times on one sample (eval mode, no autograd) and
    compares the outputs, bitwise and within a dtype-aware tolerance. A device
    that sometimes returns a wrong element shows up as a difference, with the
    run, output and element named.

``record(model, inputs, path)`` / ``check(model, path)``
    A golden file stores the inputs (and their fingerprint), the weights'
    fingerprint, and per output: a summary (mean, std, min, max, non-finite
    count), exact values at fixed sampled positions and a SHA-256 digest of
    the full output, plus the environment. ``check`` reruns the inputs and
    names the part that failed. On the same environment the comparison is
    exact: the digest catches any change of any output bit, which is what a
    single flipped weight bit usually causes (a mean/max/std check within
    1e-4 misses most of those). Across devices or versions, where bitwise
    equality is not expected, sampled values and statistics are compared
    within tolerances instead. When outputs differ, the weights are hashed
    and compared with the recorded fingerprint, so the report says whether
    the weights changed (and which tensor) or the computation did.

>>> import torch, torchverity
>>> model = torch.nn.Linear(4, 2)
>>> torchverity.consistency_check(model, torch.ones(3, 4)).ok
True
"""

from __future__ import annotations

from torchverity.golden._compare import (
    Comparison,
    bitwise_equal,
    compare_tensors,
    tolerance,
    unravel,
)
from torchverity.golden._consistency import ConsistencyResult, consistency_check
from torchverity.golden._draw import DEFAULT_ID_HIGH, InputDraw, draw_inputs
from torchverity.golden._environment import device_name, environment
from torchverity.golden._golden import GoldenFailure, GoldenResult, check, record
from torchverity.golden._record_file import STATS, GoldenRecord, OutputRecord, load_record

__all__ = [
    "DEFAULT_ID_HIGH",
    "STATS",
    "Comparison",
    "ConsistencyResult",
    "GoldenFailure",
    "GoldenRecord",
    "GoldenResult",
    "InputDraw",
    "OutputRecord",
    "bitwise_equal",
    "check",
    "compare_tensors",
    "consistency_check",
    "device_name",
    "draw_inputs",
    "environment",
    "load_record",
    "record",
    "tolerance",
    "unravel",
]
