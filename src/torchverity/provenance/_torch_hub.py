"""Files torch.hub downloaded, checked offline against the hash in their name.

``torch.hub.load_state_dict_from_url`` (torchvision's pretrained weights, and those of many
repositories) keeps each file in ``$TORCH_HOME/hub/checkpoints`` (by default
``~/.cache/torch/hub/checkpoints``) under the URL's file name, which by convention holds
the first hex digits of the file's SHA-256 (``resnet18-f37072fd.pth``). torch.hub
compares them once, at the download, and only with ``check_hash=True``; here they are
compared whenever the file is verified or loaded. Eight digits are 32 bits: a damaged
file (a changed bit, a truncated copy) is caught with certainty 1 - 2**-32, but the name
does not vouch for the file against someone who chooses its bytes. Standard library only.
"""

from __future__ import annotations

import re
from pathlib import Path

# torch.hub's own rule (HASH_REGEX in torch/hub.py): the first "-<hex>." of the name.
_HASH = re.compile(r"-([a-f0-9]*)\.")
# Fewer digits than torchvision's eight would make a check too weak to report as one.
MIN_DIGITS = 8


def torch_hub_prefix(path: Path) -> str | None:
    """The SHA-256 prefix that a file in torch.hub's checkpoints folder carries in its
    name, or None (another folder, or no prefix of at least eight digits)."""
    if path.parent.name != "checkpoints" or path.parent.parent.name != "hub":
        return None
    found = _HASH.search(path.name)
    return found.group(1) if found and len(found.group(1)) >= MIN_DIGITS else None


def record_name(prefix: str) -> str:
    """How a verdict names the record: the name's prefix, as torch.hub reads it."""
    return f"the SHA-256 prefix in its name ({prefix}, torch.hub's check_hash)"


def refetch_hint(path: str) -> str:
    """The next step for a damaged download: torch.hub fetches a file again only when it
    is not in its checkpoints folder."""
    return (f"remove {path} and load it again: torch.hub.load_state_dict_from_url(url, "
            "check_hash=True) downloads it anew")
