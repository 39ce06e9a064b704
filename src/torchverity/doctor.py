"""``torchverity doctor``: what this environment does to the safety of your results.

One report: versions (Python, torch, CUDA, cuDNN, driver), the effective
``torch.load`` ``weights_only`` default and the environment variables that
change it, determinism settings, GPU ECC mode and error counters through NVML
when ``nvidia-ml-py`` is installed (extra ``nvml``), and a short self-test of
each device. Every finding has a level: ``ok``, ``info``, ``warn`` or
``fail``; any ``fail`` makes the report (and the command) fail.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from torchverity.selftest import SelftestResult, run_selftest

FORCE_SAFE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
FORCE_UNSAFE = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
# torch.load's own parsing of these variables.
_TRUE_VALUES = ("1", "y", "yes", "true")


Level = Literal["ok", "info", "warn", "fail"]


@dataclass(frozen=True)
class Finding:
    """One observation. ``level`` is ``ok``, ``info``, ``warn`` or ``fail``."""

    level: Level
    topic: str
    message: str
    hint: str | None = None


@dataclass(frozen=True)
class DoctorReport:
    """What doctor found: versions, torch.load's defaults, determinism settings, GPUs,
    self-test results and the findings drawn from them."""

    ok: bool
    versions: dict[str, str | None]
    weights_only: dict[str, Any]
    determinism: dict[str, Any]
    gpus: dict[str, Any]
    selftests: tuple[SelftestResult, ...]
    findings: tuple[Finding, ...]


# ------------------------------------------------------------ versions


def versions(nvml: Mapping[str, Any]) -> dict[str, str | None]:
    import numpy

    from torchverity import __version__

    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torchverity": __version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "cuda": torch.version.cuda,
        "cudnn": str(cudnn) if cudnn else None,
        "driver": nvml.get("driver"),
    }


# ------------------------------------------------------------ weights_only


def weights_only_status(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What ``torch.load`` does about ``weights_only`` under ``environ`` (default: os.environ)."""
    env = os.environ if environ is None else environ
    force_safe = env.get(FORCE_SAFE, "0").lower() in _TRUE_VALUES
    force_unsafe = env.get(FORCE_UNSAFE, "0").lower() in _TRUE_VALUES
    default = _torch_default_weights_only()
    if force_safe and force_unsafe:
        effective = "error: torch.load refuses to run when both variables are set"
    elif force_safe:
        effective = "True for every call, even those passing weights_only=False"
    elif force_unsafe:
        effective = "False for calls that do not pass weights_only (arbitrary code can run)"
    else:
        effective = f"{default} unless the caller passes weights_only"
    return {
        "torch_default": default,
        FORCE_SAFE: env.get(FORCE_SAFE),
        FORCE_UNSAFE: env.get(FORCE_UNSAFE),
        "effective": effective,
    }


def _torch_default_weights_only() -> bool:
    default = getattr(torch.serialization, "_default_to_weights_only", None)
    if callable(default):
        return bool(default(None))
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 6)


def _weights_only_findings(status: Mapping[str, Any]) -> list[Finding]:
    effective = str(status["effective"])
    if effective.startswith("error"):
        return [Finding("fail", "weights_only", f"{FORCE_SAFE} and {FORCE_UNSAFE} are both set: "
                        "every torch.load call will raise", hint=f"unset {FORCE_UNSAFE}")]
    if effective.startswith("False"):
        return [Finding("warn", "weights_only", f"{FORCE_UNSAFE} is set: torch.load unpickles "
                        "full objects (which can run code) for callers that do not pass "
                        "weights_only", hint=f"unset {FORCE_UNSAFE}; check files with "
                        "'torchverity scan FILE' before loading them")]
    if not status["torch_default"] and not effective.startswith("True"):
        return [Finding("warn", "weights_only", "this torch defaults to weights_only=False: "
                        "torch.load runs pickled code unless callers opt in",
                        hint=f"upgrade to torch>=2.6 or export {FORCE_SAFE}=1")]
    return [Finding("ok", "weights_only", f"torch.load weights_only: {effective}")]


# ------------------------------------------------------------ determinism


def determinism_settings() -> dict[str, Any]:
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED"),
        "num_threads": torch.get_num_threads(),
    }


def _determinism_findings(settings: Mapping[str, Any]) -> list[Finding]:
    if not settings["deterministic_algorithms"]:
        return [Finding("info", "determinism", "deterministic algorithms are off: reruns on a "
                        "GPU may differ in the last bits",
                        hint="torchverity.seed_everything(seed, deterministic=True) for "
                        "bitwise-reproducible runs")]
    if torch.cuda.is_available() and not settings["CUBLAS_WORKSPACE_CONFIG"]:
        return [Finding("warn", "determinism", "deterministic algorithms are on but "
                        "CUBLAS_WORKSPACE_CONFIG is unset: cuBLAS calls will raise",
                        hint="export CUBLAS_WORKSPACE_CONFIG=:4096:8")]
    return [Finding("ok", "determinism", "deterministic algorithms are on")]


# ------------------------------------------------------------ NVML


def nvml_status() -> dict[str, Any]:
    """Driver version and per-GPU ECC mode and error counters, when NVML can be read."""
    try:
        import pynvml
    except ImportError:
        return {"available": False,
                "reason": "nvidia-ml-py is not installed (pip install 'torchverity[nvml]')"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return {"available": False, "reason": f"NVML could not start: {exc}"}
    try:
        driver = _nvml_query(pynvml, pynvml.nvmlSystemGetDriverVersion)
        count = _nvml_query(pynvml, pynvml.nvmlDeviceGetCount) or 0
        devices = [_nvml_device(pynvml, i) for i in range(count)]
    finally:
        pynvml.nvmlShutdown()
    return {"available": True, "driver": _text(driver), "devices": devices}


def _nvml_query(pynvml: Any, fn: Callable[..., Any], *args: Any) -> Any:
    # Many counters are "not supported" on consumer GPUs; report None instead of failing.
    try:
        return fn(*args)
    except pynvml.NVMLError:
        return None


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def _nvml_device(pynvml: Any, index: int) -> dict[str, Any]:
    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    q = lambda fn, *a: _nvml_query(pynvml, fn, h, *a)  # noqa: E731
    mode = q(pynvml.nvmlDeviceGetEccMode)
    counts = {
        f"{kind}_{scope}": q(pynvml.nvmlDeviceGetTotalEccErrors, err, counter)
        for kind, err in (("corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                          ("uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED))
        for scope, counter in (("volatile", pynvml.NVML_VOLATILE_ECC),
                               ("aggregate", pynvml.NVML_AGGREGATE_ECC))
    }
    remapped = q(pynvml.nvmlDeviceGetRemappedRows)
    return {
        "index": index,
        "name": _text(q(pynvml.nvmlDeviceGetName)),
        "ecc_current": bool(mode[0]) if mode else None,
        "ecc_pending": bool(mode[1]) if mode else None,
        "ecc_errors": counts,
        "remapped_rows": dict(zip(("corrected", "uncorrected", "pending", "failure"),
                                  remapped, strict=True)) if remapped else None,
    }


def _gpu_findings(gpus: Mapping[str, Any]) -> list[Finding]:
    if not gpus.get("available"):
        level: Level = "warn" if torch.cuda.is_available() else "info"
        return [Finding(level, "gpu", f"GPU ECC counters not read: {gpus.get('reason')}")]
    findings = []
    for dev in gpus["devices"]:
        label = f"GPU {dev['index']} ({dev['name']})"
        errors = dev["ecc_errors"]
        rows = dev["remapped_rows"] or {}
        if errors.get("uncorrected_volatile") or rows.get("failure") or rows.get("pending"):
            findings.append(Finding("fail", "gpu", f"{label}: uncorrected memory errors "
                                    f"{errors}, row remapping {rows}",
                                    hint="drain this GPU and run the vendor diagnostics "
                                    "(dcgmi diag -r 3)"))
        elif dev["ecc_current"] is False:
            findings.append(Finding("warn", "gpu", f"{label}: ECC is off, memory bit flips "
                                    "go undetected", hint="nvidia-smi -e 1 (needs a reboot)"))
        elif errors.get("corrected_volatile"):
            findings.append(Finding("warn", "gpu", f"{label}: corrected ECC errors since boot: "
                                    f"{errors['corrected_volatile']}"))
        else:
            findings.append(Finding("ok", "gpu", f"{label}: ECC on, no uncorrected errors"))
    return findings


# ------------------------------------------------------------ the report


def available_devices() -> list[str]:
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        devices.append("mps")
    return devices


def _selftest_findings(results: tuple[SelftestResult, ...]) -> list[Finding]:
    findings = []
    for r in results:
        if r.ok:
            findings.append(Finding("ok", "selftest", f"{r.device} ({r.device_name}): "
                                    f"{len(r.checks)} checks passed in {r.rounds} round(s)"))
            continue
        failed = "; ".join(f"{c.kernel} {c.dtype} {c.test}: {c.detail}" for c in r.failures[:3])
        findings.append(Finding("fail", "selftest", f"{r.device}: self-test failed: {failed}",
                                hint=f"rerun longer: torchverity selftest --device "
                                f"{r.device.split(':')[0]} --seconds 60"))
    return findings


def diagnose(*, selftest_seconds: float | None = None, selftest: bool = True) -> DoctorReport:
    """Collect the report; ``selftest_seconds=None`` runs one self-test round per device."""
    gpus = nvml_status()
    weights_only = weights_only_status()
    determinism = determinism_settings()
    tests = tuple(
        run_selftest(device, selftest_seconds, memory_mb=None if device == "cpu" else 64)
        for device in available_devices()
    ) if selftest else ()
    findings = (
        _weights_only_findings(weights_only)
        + _determinism_findings(determinism)
        + _gpu_findings(gpus)
        + _selftest_findings(tests)
    )
    return DoctorReport(
        ok=not any(f.level == "fail" for f in findings),
        versions=versions(gpus),
        weights_only=weights_only,
        determinism=determinism,
        gpus=gpus,
        selftests=tests,
        findings=tuple(findings),
    )
