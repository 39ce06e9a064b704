"""Protect code you don't own: verify every checkpoint a process loads or saves.

One switch, three ways to turn it on: :func:`protect` (or the
:func:`protected` block) in code, ``torchverity run [--policy warn|refuse] --
COMMAND`` and ``TORCHVERITY_PROTECT=warn|refuse`` in the environment (read at
interpreter start by the ``torchverity-protect.pth`` hook the package
installs). While it is on, ``torch.load``, ``torch.save``, safetensors'
``load_file`` / ``safe_open`` / ``save_file`` and ``nn.Module.load_state_dict``
are watched; load failures that were caught and not re-raised are listed
when the process ends. Importing this package patches nothing.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from torchverity.protect._failures import Swallowed
from torchverity.protect._state import POLICIES, Event, Policy
from torchverity.protect._switch import is_protected, protect, protected, unprotect

__all__ = ["POLICIES", "Event", "Policy", "Swallowed", "is_protected", "protect", "protected",
           "unprotect"]


class _Switch(types.ModuleType):
    """``torchverity.protect`` names both this package and the function that turns it on.

    Importing a submodule binds the package to that name on ``torchverity``;
    calling it still turns the switch on.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        protect(*args, **kwargs)


sys.modules[__name__].__class__ = _Switch
