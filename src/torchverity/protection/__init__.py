"""Protect code you don't own: verify every checkpoint a process loads or saves.

One switch, three ways to turn it on: :func:`protect` (also ``torchverity.protect``)
or the :func:`protected` block in code, ``torchverity run [--policy warn|refuse] --
COMMAND`` and ``TORCHVERITY_PROTECT=warn|refuse`` in the environment (read at
interpreter start by the ``torchverity-protect.pth`` hook the package
installs). While it is on, ``torch.load``, ``torch.save``, safetensors'
``load_file`` / ``safe_open`` / ``save_file`` and ``nn.Module.load_state_dict``
are watched; load failures that were caught and not re-raised are listed
when the process ends. Importing this package patches nothing.
"""

from __future__ import annotations

from torchverity.protection._failures import Swallowed
from torchverity.protection._state import POLICIES, Event, Policy
from torchverity.protection._switch import is_protected, protect, protected, unprotect

__all__ = ["POLICIES", "Event", "Policy", "Swallowed", "is_protected", "protect", "protected",
           "unprotect"]
