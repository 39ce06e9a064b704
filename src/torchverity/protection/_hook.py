"""The interpreter-start hook: ``torchverity-protect.pth`` calls :func:`install_from_env`.

The .pth line itself only reads ``TORCHVERITY_PROTECT``; this module is
imported only when it is set. It imports neither torch nor safetensors: they
are patched when the program imports them. ``TORCHVERITY_PUBLIC_KEY`` (or
``TORCHVERITY_CERTIFICATE_CHAIN``) names what model signatures must verify with.
"""

from __future__ import annotations

import os

from torchverity.errors import TorchVerityError
from torchverity.protection._state import CHAIN_ENV, POLICIES, PUBLIC_KEY_ENV, say
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
    log = os.environ.get(LOG_ENV) or None
    key = os.environ.get(PUBLIC_KEY_ENV) or None
    chain = [c for c in os.environ.get(CHAIN_ENV, "").split(os.pathsep) if c]
    try:
        protect(value, log=log, public_key=key, certificate_chain=chain)  # type: ignore[arg-type]
    except TorchVerityError as exc:  # a key that is not there: protect anyway, and say so
        say(f"{exc.message}: model signatures will not be checked ({PUBLIC_KEY_ENV}, "
            f"{CHAIN_ENV})")
        protect(value, log=log)  # type: ignore[arg-type]
