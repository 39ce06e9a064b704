"""The interpreter-start hook: ``torchverity-protect.pth`` calls :func:`install_from_env`.

The .pth line itself only reads ``TORCHVERITY_PROTECT``; this module is
imported only when it is set. It imports neither torch nor safetensors: they
are patched when the program imports them.
"""

from __future__ import annotations

import os

from torchverity.protection._state import POLICIES, say
from torchverity.protection._switch import protect

ENV = "TORCHVERITY_PROTECT"
LOG_ENV = "TORCHVERITY_PROTECT_LOG"
_OFF = ("", "0", "off", "no", "false")


def install_from_env() -> None:
    value = os.environ.get(ENV, "").strip().lower()
    if value in _OFF:
        return
    if value not in POLICIES:
        say(f"{ENV}={value!r} is not a policy (warn or refuse): protecting with policy warn")
        value = "warn"
    protect(value, log=os.environ.get(LOG_ENV) or None)  # type: ignore[arg-type]
