"""PEP 517 build backend: setuptools' own, plus the startup hook in every wheel it builds.

``torchverity-protect.pth`` must sit at the root of site-packages, where no
package file goes. setuptools' public hooks cannot put a file there in an
editable wheel, so this backend lets ``setuptools.build_meta`` build the wheel
(plain or editable) and then adds the .pth at the wheel's root with its line in
RECORD, the way any wheel lists its files (``pip uninstall`` removes it). The
.pth reads ``TORCHVERITY_PROTECT`` and imports nothing unless it is set.
"""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import (  # noqa: F401  (the rest of the PEP 517 interface)
    build_sdist,
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

PTH = "torchverity-protect.pth"


def _hook_source() -> bytes:
    # PEP 517 runs the backend with the project's root as the working directory.
    with open(os.path.join("src", PTH), "rb") as fh:
        return fh.read()


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


def add_hook(wheel_path: str, data: bytes) -> None:
    """Rewrite the wheel at ``wheel_path`` with ``PTH`` at its root and listed in RECORD."""
    tmp = wheel_path + ".tmp"
    with zipfile.ZipFile(wheel_path) as src, \
            zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        record = next(i for i in src.infolist() if i.filename.endswith(".dist-info/RECORD"))
        for info in src.infolist():
            if info.filename not in (record.filename, PTH):
                dst.writestr(info, src.read(info))
        dst.writestr(PTH, data)
        lines = [line for line in src.read(record).decode().splitlines(keepends=True)
                 if not line.startswith(f"{PTH},")]
        dst.writestr(record, "".join(lines) + _record_line(PTH, data))
    os.replace(tmp, wheel_path)


def build_wheel(wheel_directory: str, config_settings: dict[str, Any] | None = None,
                metadata_directory: str | None = None) -> str:
    name = _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    add_hook(os.path.join(wheel_directory, name), _hook_source())
    return name


def build_editable(wheel_directory: str, config_settings: dict[str, Any] | None = None,
                   metadata_directory: str | None = None) -> str:
    name = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    add_hook(os.path.join(wheel_directory, name), _hook_source())
    return name
