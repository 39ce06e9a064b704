"""Does a checkpoint fit a model: keys, shapes and dtypes, all reported at once."""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from torchverity._leaves import weights_in
from torchverity._tensors import dtype_name
from torchverity.checkpoint._key_map import (
    FitReport,
    KeyFit,
    adapter_diagnosis,
    base_adapter_diagnosis,
    non_persistent_buffers,
    partial_prefix_diagnosis,
    prefix_diagnosis,
    rename_keys,
    wrapped_model_diagnosis,
)
from torchverity.errors import (
    FormatError,
    StateDictMismatchError,
    shell_path,
)


def state_dict_of(obj: Any) -> Mapping[str, Any]:
    """The model weights inside a checkpoint: the object itself or its
    ``state_dict`` / ``model`` / ``model_state_dict`` entry."""
    if isinstance(obj, Mapping):
        return weights_in(obj, lambda v: isinstance(v, torch.Tensor))
    raise FormatError(f"checkpoint holds a {type(obj).__name__}, not a state_dict",
                      hint="save model.state_dict() instead of the model object")


def check_against_model(obj: Any, model: torch.nn.Module, path: Path,
                        fit: KeyFit | None = None) -> FitReport:
    """Report every missing, unexpected, reshaped or retyped key at once, then load.

    Keys are renamed by ``fit`` first; non-persistent buffers the file still
    holds are left out, as transformers' ``from_pretrained`` does. With
    ``fit.strict`` False only reshaped or retyped entries refuse the load:
    missing and unexpected keys are returned to be reported.
    """
    fit = fit or KeyFit()
    state, renamed = rename_keys(state_dict_of(obj), fit)
    want = model.state_dict()
    ignored = sorted((set(state) - set(want)) & non_persistent_buffers(model))
    state = {k: v for k, v in state.items() if k not in ignored}
    missing = sorted(set(want) - set(state) - _tied(want, state))
    unexpected = sorted(set(state) - set(want))
    mismatched = _mismatched(want, state)
    # strict=False that would load none of the file's tensors is never what was meant.
    nothing_fits = bool(state) and not state.keys() & want.keys()
    if mismatched or nothing_fits or (fit.strict and (missing or unexpected)):
        raise _mismatch_error(path, model, missing, unexpected, mismatched, nothing_fits,
                              renamed_away=bool(renamed) and _fits_as_saved(obj, want))
    model.load_state_dict({k: v for k, v in state.items() if k in want}, strict=False)
    return FitReport(tuple(missing), tuple(unexpected), tuple(ignored), renamed)


def _fits_as_saved(obj: Any, want: Mapping[str, Any]) -> bool:
    """Whether the checkpoint's own keys, before any renaming, are the model's."""
    return set(state_dict_of(obj)) >= set(want)


def _tied(want: Mapping[str, Any], state: Mapping[str, Any]) -> set[str]:
    """Model keys that are the very tensor of a key the file holds: tied weights (GPT-2's
    lm_head.weight is transformer.wte.weight), which save_pretrained writes once."""
    def ident(t: torch.Tensor) -> tuple[int, tuple[int, ...], torch.dtype]:
        return t.data_ptr(), tuple(t.shape), t.dtype

    loaded = {ident(t) for k, t in want.items()
              if k in state and isinstance(t, torch.Tensor) and t.numel() and t.data_ptr()}
    return {k for k, t in want.items() if k not in state and isinstance(t, torch.Tensor)
            and t.numel() and t.data_ptr() and ident(t) in loaded}


def _mismatched(want: Mapping[str, Any], state: Mapping[str, Any]) -> list[dict[str, str]]:
    mismatched = []
    for name in sorted(set(want) & set(state)):
        w, g = want[name], state[name]
        if not isinstance(g, torch.Tensor):
            mismatched.append({"name": name, "expected": "tensor", "actual": type(g).__name__})
        elif w.shape != g.shape or w.dtype != g.dtype:
            mismatched.append({"name": name,
                               "expected": f"{dtype_name(w.dtype)}{list(w.shape)}",
                               "actual": f"{dtype_name(g.dtype)}{list(g.shape)}"})
    return mismatched


def build_mismatch(exc: BaseException, state: Mapping[str, Any],
                   path: Path) -> StateDictMismatchError | None:
    """The mismatch error :func:`check_against_model` gives, for ``state`` (the weights of
    ``path``) that a model factory's own ``load_state_dict`` refused with ``exc``; None
    when ``exc`` did not come from ``load_state_dict`` or no key, shape or strictness
    explains it.

    A batch factory builds its model and loads the state itself, so the model exists
    only in the frame of the ``load_state_dict`` call that raised: it is read from there.
    The keys are judged by that call's rules (its ``strict``; dtypes are cast)."""
    frame = next((f for f, _line in traceback.walk_tb(exc.__traceback__)
                  if f.f_code is torch.nn.Module.load_state_dict.__code__), None)
    model = frame.f_locals.get("self") if frame is not None else None
    if frame is None or not isinstance(model, torch.nn.Module):
        return None
    strict = bool(frame.f_locals.get("strict", True))
    want = model.state_dict()
    missing = sorted(set(want) - set(state)) if strict else []
    unexpected = sorted(set(state) - set(want)) if strict else []
    mismatched = [m for m in _mismatched(want, state)  # a dtype alone: load_state_dict casts
                  if not isinstance(got := state[m["name"]], torch.Tensor)
                  or got.shape != want[m["name"]].shape]
    if not (missing or unexpected or mismatched):
        return None
    nothing_fits = bool(state) and not state.keys() & want.keys()
    return _mismatch_error(path, model, missing, unexpected, mismatched, nothing_fits,
                           lenient=False)


def _mismatch_error(path: Path, model: torch.nn.Module, missing: list[str],
                    unexpected: list[str], mismatched: list[dict[str, str]],
                    nothing_fits: bool = False, *, lenient: bool = True,
                    renamed_away: bool = False) -> StateDictMismatchError:
    """``lenient``: the load can be told strict=False (a factory's own load cannot).
    ``renamed_away``: the keys fitted as saved, and the renaming asked for broke them."""
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing: {', '.join(missing[:10])}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected: {', '.join(unexpected[:10])}")
    for m in mismatched[:10]:
        parts.append(f"'{m['name']}' is {m['actual']}, model expects {m['expected']}")
    if nothing_fits:
        parts.append("none of the checkpoint's keys is one of the model's")
    diagnosis = _renamed_away() if renamed_away else _dtypes_only(mismatched) if mismatched \
        else (prefix_diagnosis(missing, unexpected)
              or wrapped_model_diagnosis(missing, unexpected)
              or adapter_diagnosis(missing, unexpected)
              or base_adapter_diagnosis(unexpected)
              or (partial_prefix_diagnosis(missing, unexpected) if lenient else None))
    hint = diagnosis or (
        f"check the model config matches the one that saved it; "
        f"torchverity inspect {shell_path(path)} lists the checkpoint's tensors"
        + ("; strict=False (CLI: --no-strict) loads what fits and reports the rest"
           if lenient and not (mismatched or nothing_fits) else ""))
    return StateDictMismatchError(
        f"{path}: checkpoint does not fit {type(model).__name__}: " + "; ".join(parts),
        path=path, missing=missing, unexpected=unexpected, mismatched=mismatched, hint=hint,
    )


def _renamed_away() -> str:
    return ("the checkpoint's keys are the model's as saved: the strip_prefix or key_map given "
            "renamed them away; load without it (CLI: without --strip-prefix / --key-map)")


def _dtypes_only(mismatched: list[dict[str, str]]) -> str | None:
    """Say so when every mismatch is a dtype alone (a float16 checkpoint, a float32 model)."""
    def shape(text: str) -> str:
        return text[text.find("["):]

    if not all(shape(m["expected"]) == shape(m["actual"]) for m in mismatched):
        return None
    got = sorted({m["actual"].split("[", 1)[0] for m in mismatched})
    want = sorted({m["expected"].split("[", 1)[0] for m in mismatched})
    return (f"only dtypes differ (the checkpoint holds {', '.join(got)} where the model has "
            f"{', '.join(want)}): convert one to the other before loading, the model with "
            f"model.to(torch.{got[0]}) or the checkpoint's tensors with .to(torch.{want[0]})")
