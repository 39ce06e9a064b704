"""The environment a golden record was made in, and what changed since."""

from __future__ import annotations

import platform
from collections.abc import Mapping
from typing import Any

import torch


def environment(device: torch.device) -> dict[str, Any]:
    """What determines the exact bits an inference produces on ``device``."""
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device.type,
        "device_name": device_name(device),
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32 if device.type == "cuda" else None,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32 if device.type == "cuda" else None,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }
    return env


# Keys whose change can legitimately change output bits.
_IDENTITY_KEYS = (
    "torch", "device", "device_name", "threads", "cpu_capability", "cuda", "cudnn",
    "tf32_matmul", "tf32_cudnn",
)


def environment_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    return [
        f"{k}: {recorded.get(k)!r} -> {current.get(k)!r}"
        for k in _IDENTITY_KEYS
        if recorded.get(k) != current.get(k)
    ]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    if device.type == "cpu":
        return _cpu_model()
    return device.type


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
