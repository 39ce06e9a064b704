"""Fitting a checkpoint's keys to a model the way PyTorch users do: prefixes stripped
(``module.`` from DDP, ``_orig_mod.`` from torch.compile, ``model.`` from Lightning), renamed
keys, non-persistent buffers a file still carries, and ``strict=False`` reported loudly.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchverity.errors import UsageError

if TYPE_CHECKING:
    import torch

# What wrappers put in front of every key: DDP/DataParallel, torch.compile, Lightning,
# and the base-model prefix of Hugging Face heads (BertForMaskedLM saves "bert.").
KNOWN_PREFIXES = ("module.", "_orig_mod.", "model.")


@dataclass(frozen=True)
class KeyFit:
    """How the checkpoint's keys are matched to the model's.

    ``strip_prefixes`` are removed from the front of every key that has them, each
    once, in the order the key has them (``module.`` and ``_orig_mod.`` strip
    ``module._orig_mod.`` and ``_orig_mod.module.``; so does the stack
    ``module._orig_mod.`` given as one prefix); ``key_map`` maps
    an old key prefix to a new one (an exact key is its own prefix), applied
    after stripping. ``strict=False`` loads what fits and reports the rest.
    """

    strict: bool = True
    strip_prefixes: tuple[str, ...] = ()
    key_map: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, strict: bool = True, strip_prefix: str | Iterable[str] | None = None,
           key_map: Mapping[str, str] | None = None) -> KeyFit:
        return cls(bool(strict), _prefixes(strip_prefix), _pairs(key_map))

    @property
    def renames(self) -> bool:
        return bool(self.strip_prefixes or self.key_map)


def _pairs(key_map: object) -> tuple[tuple[str, str], ...]:
    """The key map's (old, new) prefix pairs, each a str."""
    if key_map is None:
        return ()
    if isinstance(key_map, Mapping) and all(isinstance(a, str) and isinstance(b, str)
                                            for a, b in key_map.items()):
        return tuple(key_map.items())
    raise UsageError("key_map maps old key prefixes (str) to new ones (str)",
                     hint="for example key_map={'fc.': 'head.'} (CLI: --key-map fc.=head.)")


def _prefixes(strip_prefix: object) -> tuple[str, ...]:
    """The prefixes to strip, each a non-empty str; a wrapper's prefix without its dot would
    leave every key starting with '.'."""
    if strip_prefix is None:
        return ()
    given = (strip_prefix,) if isinstance(strip_prefix, str) else strip_prefix
    if not isinstance(given, Iterable) or not all(isinstance(p, str) for p in given):
        raise UsageError(f"strip_prefix must be a str or a list of str, not {strip_prefix!r}",
                         hint="for example strip_prefix='module.' (CLI: --strip-prefix module.)")
    prefixes = tuple(given)
    for p in prefixes:
        if not p:
            raise UsageError("an empty strip_prefix strips nothing",
                             hint="name the prefix, e.g. strip_prefix='module.' (CLI: "
                                  "--strip-prefix module.)")
        if p + "." in KNOWN_PREFIXES:
            raise UsageError(f"strip_prefix '{p}' would leave every key starting with '.'",
                             hint=f"strip the prefix with its dot: strip_prefix='{p}.' (CLI: "
                                  f"--strip-prefix {p}.)")
    return prefixes


@dataclass(frozen=True)
class FitReport:
    """What did not load one to one: reported in the LoadReport and warned about."""

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    ignored_buffers: tuple[str, ...] = ()  # non-persistent buffers the file still holds
    renamed: int = 0


def rename_keys(state: Mapping[str, Any], fit: KeyFit) -> tuple[dict[str, Any], int]:
    """The state with prefixes stripped and keys mapped; the count of keys renamed."""
    out: dict[str, Any] = {}
    renamed = 0
    for key, value in state.items():
        new = _renamed(str(key), fit)
        if new in out:
            raise UsageError(f"two checkpoint keys become '{new}' after renaming",
                             hint="narrow the key map or the prefixes to strip")
        renamed += new != key
        out[new] = value
    return out, renamed


def _renamed(key: str, fit: KeyFit) -> str:
    # Each prefix comes off once, in whatever order the wrappers stacked them: stripping
    # 'model.' again would eat the model's own 'model.' (a Lightning module around a
    # LlamaForCausalLM saves 'model.model.layers...').
    left = list(fit.strip_prefixes)
    while (prefix := next((p for p in left if key.startswith(p)), None)) is not None:
        key = key[len(prefix):]
        left.remove(prefix)
    for old, new in fit.key_map:
        if key.startswith(old):
            return new + key[len(old):]
    return key


def non_persistent_buffers(model: torch.nn.Module) -> set[str]:
    """Dotted names of buffers ``model.state_dict()`` leaves out (e.g. BERT's position_ids)."""
    names = set()
    for prefix, module in model.named_modules():
        for buf in getattr(module, "_non_persistent_buffers_set", ()):
            names.add(f"{prefix}.{buf}" if prefix else buf)
    return names


def prefix_diagnosis(missing: Iterable[str], unexpected: Iterable[str]) -> str | None:
    """Say so when every unexpected key is a known prefix, a stack of them (DDP around
    torch.compile saves ``module._orig_mod.``) or a first part they all share, plus a
    missing key."""
    missing_set, extra = set(missing), list(unexpected)
    if not extra or not missing_set:
        return None
    for prefix in _shared_stacks(extra) + _common_prefix(extra):
        if all(k.startswith(prefix) and k[len(prefix):] in missing_set for k in extra):
            return (f"every unexpected key is '{prefix}' + a missing key: the checkpoint was "
                    f"saved with a '{prefix}' prefix{_wrappers(prefix)}; strip it: "
                    f"strip_prefix='{prefix}' (CLI: --strip-prefix {shlex.quote(prefix)})")
    return None


# Who puts each known prefix in front of the keys, for the diagnosis of a stack of them.
_WRAPPERS = {"module.": "DDP/DataParallel", "_orig_mod.": "torch.compile",
             "model.": "a Lightning or Hugging Face wrapper"}


def _shared_stacks(keys: list[str]) -> tuple[str, ...]:
    """The known prefixes every key starts with, one on top of the other, each stack
    depth a candidate: ``module.``, then ``module._orig_mod.``."""
    stacks: list[str] = []
    stack = ""
    while len(stacks) < 4:  # deeper wrapping than DDP + compile + Lightning is not seen
        shared = next((p for p in KNOWN_PREFIXES if all(k.startswith(stack + p) for k in keys)),
                      None)
        if shared is None:
            break
        stack += shared
        stacks.append(stack)
    return tuple(stacks)


def _wrappers(prefix: str) -> str:
    parts = [p + "." for p in prefix.split(".")[:-1]]
    if len(parts) < 2 or any(p not in _WRAPPERS for p in parts):
        return ""
    return " (" + ", ".join(f"{p} from {_WRAPPERS[p]}" for p in parts) + ")"


def partial_prefix_diagnosis(missing: Iterable[str], unexpected: Iterable[str]) -> str | None:
    """Say so when some unexpected keys are a prefix plus a missing key and others are extra
    (a model with a head, ``bert.*`` and ``cls.*``, loaded into its base model)."""
    missing_set, extra = set(missing), list(unexpected)
    heads = tuple(sorted({k.split(".", 1)[0] + "." for k in extra if "." in k}))
    best: tuple[str, int] | None = None
    for prefix in KNOWN_PREFIXES + heads:
        hits = sum(k.startswith(prefix) and k[len(prefix):] in missing_set for k in extra)
        if hits and (best is None or hits > best[1]):
            best = (prefix, hits)
    if best is None or best[1] == len(extra):
        return None
    prefix, hits = best
    return (f"{hits} of the {len(extra)} unexpected keys are '{prefix}' + a missing key: strip "
            f"it (strip_prefix='{prefix}', CLI: --strip-prefix {shlex.quote(prefix)}) and load "
            "with strict=False (CLI: --no-strict), which reports the keys left over")


def adapter_diagnosis(missing: Iterable[str], unexpected: Iterable[str]) -> str | None:
    """Say so when every unexpected key is a missing key less one adapter name: PEFT saves
    ``...lora_A.weight`` for the model's ``...lora_A.default.weight``."""
    named: dict[str, str] = {}
    for key in missing:
        head, _, leaf = key.rpartition(".")
        stem, _, adapter = head.rpartition(".")
        if stem:
            named[f"{stem}.{leaf}"] = adapter
    names = {named.get(k) for k in unexpected}
    name = names.pop() if len(names) == 1 else None
    if name is None:
        return None
    return (f"every unexpected key is a missing key without the adapter name '{name}': a PEFT "
            "adapter file, whose keys leave the name out; verify it with torchverity and let "
            "peft insert the name: set_peft_model_state_dict(model, torchverity.load(path))")


def base_adapter_diagnosis(unexpected: Iterable[str]) -> str | None:
    """Say so when the checkpoint is a whole PEFT adapter file given to its base model: every
    key carries the ``base_model.model.`` prefix PEFT saves adapters under."""
    keys = list(unexpected)
    if not keys or not all(k.startswith("base_model.model.") for k in keys):
        return None
    return ("the checkpoint is a PEFT adapter (every key starts with 'base_model.model.'): it "
            "holds the adapter's tensors only and goes onto the base model through peft: "
            "PeftModel.from_pretrained(base, folder), or verify it first with "
            "set_peft_model_state_dict(get_peft_model(base, config), torchverity.load(path))")


def _common_prefix(keys: list[str]) -> tuple[str, ...]:
    first = keys[0].split(".", 1)[0] + "."
    return (first,) if first not in (*KNOWN_PREFIXES, ".") \
        and all(k.startswith(first) for k in keys) else ()


def wrapped_model_diagnosis(missing: Iterable[str], unexpected: Iterable[str]) -> str | None:
    """Say so when every missing key is a wrapper's prefix (or a stack of them) + an
    unexpected key: a plain checkpoint given to a model wrapped by torch.compile or DDP."""
    extra, lacking = set(unexpected), list(missing)
    if not extra or not lacking:
        return None
    for prefix in _shared_stacks(lacking):
        if all(k[len(prefix):] in extra for k in lacking):
            by = _wrappers(prefix) or f" ({prefix} from {_WRAPPERS[prefix]})"
            return (f"every missing key is '{prefix}' + an unexpected key: the model is wrapped"
                    f"{by} and the checkpoint is not; load into the model it wraps "
                    f"(model.{prefix[:-1]}) or add the prefix: key_map={{'': '{prefix}'}} "
                    f"(CLI: --key-map ={prefix})")
    return None


def parse_key_map(items: Iterable[str]) -> dict[str, str]:
    """``OLD=NEW`` command-line pairs as a key map (``NEW`` may be empty)."""
    mapping = {}
    for item in items:
        old, sep, new = item.partition("=")
        if not sep or not (old or new):
            raise UsageError(f"--key-map '{item}' is not OLD=NEW",
                             hint="for example --key-map bert.=  or  --key-map fc.=head.  (an "
                                  "empty OLD prefixes every key: --key-map =module.)")
        mapping[old] = new
    return mapping
