"""What builds the per-item function: a ``module:callable`` with verified weights, or a given fn.

A factory is small and picklable, so Ray actors receive it and build their own
copy of the model (once per actor). ``identity()`` is what enters the job
fingerprint; every actor reports it back and the driver refuses an actor
whose model differs from its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from torchverity.batch._item import ItemFn
from torchverity.errors import TorchVerityError


class ModelFactory(Protocol):
    def identity(self) -> dict[str, str]: ...

    def load(self) -> tuple[ItemFn, dict[str, str]]: ...

    def cli_args(self) -> list[str] | None: ...  # how `batch run` names this model, if it can


def golden_gate(fn: ItemFn, golden: str, when: str, weights: str | None = None) -> None:
    """Run the golden check on the model behind ``fn`` (its ``model`` attribute).

    Raises IntegrityError saying what failed (the outputs, or the weights alone) and the
    next step, so no output is accepted from a model that does not reproduce its recorded
    outputs. ``weights``: the checkpoint the model was built from, if any.
    """
    from torchverity.errors import IntegrityError, UsageError
    from torchverity.golden import check
    from torchverity.golden._run import model_device
    from torchverity.golden._verdict import verdict

    model = getattr(fn, "model", None)
    if model is None:
        raise UsageError(
            "a golden check needs the model: the per-item function has no 'model' attribute",
            hint="in build(), set predict.model = model before returning predict",
        )
    result = check(model, golden)
    if result.ok:
        return
    # A batch factory is no model factory: no golden check command can rebuild its model.
    what, step = verdict(result, weights=weights, device=model_device(model).type,
                         every_part=f"torchverity.golden.check(predict.model, {golden!r})"
                                    ".failures in Python")
    detail = what.removeprefix(f"{golden}: ")
    raise IntegrityError(f"{golden}: the model failed its golden check {when}: {detail}",
                         path=golden,
                         tensors=list(result.weights_changed or ()), hint=step)


@dataclass(frozen=True)
class GivenFn:
    """The Python API's per-item function; ``name`` identifies it in the job fingerprint."""

    fn: ItemFn
    name: str
    model_fingerprint: str | None = None
    golden: str | None = None
    strip_prefix: tuple[str, ...] = ()
    key_map: tuple[tuple[str, str], ...] = ()

    def identity(self) -> dict[str, str]:
        ident = {"model": self.name}
        if self.model_fingerprint:
            ident["model_fingerprint"] = self.model_fingerprint
        return ident

    def load(self) -> tuple[ItemFn, dict[str, str]]:
        if self.golden:
            golden_gate(self.fn, self.golden, "before the first item")
        return self.fn, self.identity()

    def cli_args(self) -> list[str] | None:
        return None  # a Python function: no command runs it


@dataclass(frozen=True)
class ModelSpec:
    """``build = module:callable``; ``build(state) -> fn`` with weights, ``build() -> fn`` without.

    The weights are loaded with ``torchverity.load(..., sidecar="require")``:
    their SHA-256 sidecar must match before any item is processed.
    """

    spec: str
    weights: str | None = None
    golden: str | None = None
    strip_prefix: tuple[str, ...] = ()
    key_map: tuple[tuple[str, str], ...] = ()

    def identity(self) -> dict[str, str]:
        return self._weights()[1]

    def load(self) -> tuple[ItemFn, dict[str, str]]:
        from torchverity._callables import call_spec, factory_failed, import_callable

        build = import_callable(self.spec)
        state, ident = self._weights()
        if self.weights is None:
            fn = call_spec(self.spec, build)
        else:
            try:
                fn = build(state)
            except RuntimeError as exc:  # load_state_dict's own refusal, named as load names it
                from torchverity.checkpoint._model_fit import build_mismatch

                mismatch = build_mismatch(exc, state, Path(self.weights))
                if mismatch is None:
                    raise factory_failed(self.spec, exc, f"calling '{self.spec}'") from exc
                raise mismatch from None
            except TorchVerityError:
                raise
            except Exception as exc:
                raise factory_failed(self.spec, exc, f"calling '{self.spec}'") from exc
        if not callable(fn):
            from torchverity.errors import UsageError

            raise UsageError(
                f"'{self.spec}' returned a {type(fn).__name__}, not a per-item function",
                hint="build(state) must return fn(item) -> bytes | str | tensor; "
                "see docs/batch.md",
            )
        if self.golden:
            golden_gate(fn, self.golden, "before the first item", self.weights)
        return fn, ident

    def cli_args(self) -> list[str] | None:
        if any("=" in old for old, _ in self.key_map):
            return None  # --key-map OLD=NEW cannot say it
        args = ["--model", self.spec]
        if self.weights is not None:
            args += ["--weights", os.path.abspath(self.weights)]
        for prefix in self.strip_prefix:
            args += ["--strip-prefix", prefix]
        for old, new in self.key_map:
            args += ["--key-map", f"{old}={new}"]
        return args

    def _weights(self) -> tuple[Any, dict[str, str]]:
        ident = {"model": self.spec}
        if self.weights is None:
            return None, ident
        from torchverity.checkpoint._fingerprint import fingerprint
        from torchverity.checkpoint._load import load

        state, report = load(self.weights, sidecar="require", with_report=True,
                             strip_prefix=self.strip_prefix, key_map=dict(self.key_map))
        ident["weights_digest"] = f"{report.algo}:{report.digest}"
        if self.strip_prefix or self.key_map:
            ident["key_fit"] = repr((self.strip_prefix, self.key_map))
        ident["model_fingerprint"] = report.fingerprint or fingerprint(state, mode="exact").root
        return state, ident
