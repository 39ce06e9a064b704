"""``torchverity golden record|check``: golden outputs of a model on fixed inputs."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from torchverity.cli._command import at_least
from torchverity.cli._fit_args import add_fit_args, fit_kwargs
from torchverity.cli._output import Output
from torchverity.errors import UsageError, shell_path

if TYPE_CHECKING:
    from torchverity.checkpoint._results import LoadReport
    from torchverity.golden import GoldenRecord, GoldenResult
    from torchverity.golden._compare import CompareMode

# --mode: the compare modes (golden imports torch, so the names are checked by mypy, not
# imported for --help), and auto: exact on the recorded environment, tolerance elsewhere.
_EXACT: dict[CompareMode | Literal["auto"], bool | None] = {
    "auto": None, "exact": True, "tolerance": False}


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "golden", help="record and check golden outputs of a model",
        description="Record a model's outputs on fixed inputs (summary, sampled exact values, "
        "digest of the full output, environment), then check a model against them: exact on "
        "the same environment, within tolerances across devices and versions.",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    model_args = argparse.ArgumentParser(add_help=False)
    model_args.add_argument("--model", required=True, metavar="MODULE:CALLABLE",
                            help="callable that builds the model, e.g. mypkg.models:build")
    model_args.add_argument("--weights", type=Path, metavar="CKPT",
                            help="checkpoint loaded into the model with torchverity.load")
    add_fit_args(model_args)
    model_args.add_argument("--golden", type=Path, required=True, metavar="FILE",
                            help="the golden file (JSON)")
    model_args.add_argument("--device", default="cpu", help="run the model here (default cpu)")

    rec = actions.add_parser(
        "record", parents=[common, model_args], help="run the model and write a golden file",
        description="Inputs come from --inputs FILE (.pt or .safetensors: a tensor, tuple or "
        "dict of tensors) or are drawn from --seed with --shape and --dtype: normal values, "
        "or token ids for an integer dtype. The record keeps them and how they were drawn.",
    )
    rec.add_argument("--inputs", type=Path, metavar="FILE", help="input tensors to record")
    rec.add_argument("--shape", help="random input shape, e.g. 4,3,32,32 (with --seed)")
    rec.add_argument("--dtype", default="float32",
                     help="dtype of --shape inputs: a float dtype draws normal values, an "
                     "integer one token ids in [0, vocab_size) of the model's config "
                     "(else [0, 10))")
    rec.add_argument("--seed", type=int, default=0, help="seed of --shape inputs (default 0)")
    rec.add_argument("--sample-size", type=at_least(1), default=64,
                     help="exact output values kept per output (default 64)")
    rec.set_defaults(func=_record)

    chk = actions.add_parser(
        "check", parents=[common, model_args], help="compare the model with a golden file",
        description="Exit 1 when any part fails: digest, sampled values, a statistic, "
        "NaN/Inf count, output structure, or the weights' fingerprint (compared whenever "
        "the record holds one).",
    )
    chk.add_argument("--mode", choices=tuple(_EXACT), default="auto",
                     help="auto: exact on the recorded environment, tolerance elsewhere")
    chk.add_argument("--check-weights", action=argparse.BooleanOptionalAction, default=None,
                     help="compare the model's weights with the record's fingerprint even when "
                     "outputs match (default: whenever the record holds one; "
                     "--no-check-weights only when outputs differ)")
    chk.add_argument("--rtol", type=float, help="relative tolerance (tolerance mode)")
    chk.add_argument("--atol", type=float, help="absolute tolerance (tolerance mode)")
    chk.set_defaults(func=_check)


def build_model(spec: str, weights: Path | None, device: str, out: Output,
                fit: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any] | None]:
    """Build the model from ``module:callable``, load verified weights, move it to ``device``;
    what the load could not verify is printed as warnings. The files a build reads beside
    the weights of a model folder (config.json...) are checked before it reads them.
    Returns the model and, with weights, what their load left out and warned about (for
    ``--json``)."""
    import torch

    from torchverity._callables import call_spec, import_callable
    from torchverity.checkpoint._folders import resolve
    from torchverity.checkpoint._model_files import check_model_files
    from torchverity.selftest import resolve_device

    dev = resolve_device(device)
    if weights is not None:
        check_model_files(resolve(weights))  # the load checks them again and warns
    model = call_spec(spec, import_callable(spec))
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"'{spec}' returned a {type(model).__name__}, not a torch.nn.Module",
                         hint="--model names a class or function that returns the model itself "
                              "(an nn.Module), e.g. mypkg.models:build with build() returning "
                              "Net()")
    loaded = None
    if weights is not None:
        _obj, report = _loaded(weights, out, model=model, map_location="cpu", **(fit or {}))
        loaded = {"path": str(weights), "missing_keys": list(report.missing_keys),
                  "unexpected_keys": list(report.unexpected_keys),
                  "warnings": list(report.warnings)}
    return model.to(dev), loaded


def _loaded(path: Path, out: Output, **kwargs: Any) -> tuple[Any, LoadReport]:
    """``torchverity.load``, what it could not verify printed as this command's warnings."""
    import warnings

    from torchverity.checkpoint._load import load
    from torchverity.checkpoint._results import CheckpointWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        obj, report = load(path, with_report=True, **kwargs)
    for text in report.warnings:
        out.warn(text)
    return obj, report


def _require_fingerprint(args: argparse.Namespace) -> None:
    from torchverity.golden._record_file import load_record

    if load_record(args.golden)[0].model_fingerprint is None:
        raise UsageError(f"{args.golden}: the record holds no weights fingerprint to compare with",
                         hint=_record_again(args))


def _record_again(args: argparse.Namespace) -> str:
    weights = f" --weights {shell_path(args.weights)}" if args.weights is not None else ""
    return (f"record it again from the trusted weights, which stores their fingerprint: "
            f"torchverity golden record --model {shlex.quote(args.model)}{weights} --golden "
            f"{shell_path(args.golden)} --inputs INPUTS (or --shape DIMS)")


def _inputs(args: argparse.Namespace, out: Output, model: Any) -> Any:
    from torchverity.golden import draw_inputs

    if (args.inputs is None) == (args.shape is None):
        raise UsageError("give exactly one of --inputs FILE or --shape DIMS",
                         hint="for example --shape 4,3,32,32")
    if args.inputs is not None:
        return _loaded(args.inputs, out)[0]
    try:
        shape = [int(s) for s in args.shape.split(",")]
    except ValueError:
        raise UsageError(f"--shape '{args.shape}' is not a comma-separated list of sizes",
                         hint="for example --shape 4,3,32,32") from None
    return draw_inputs(shape, args.dtype, seed=args.seed, model=model)


def _record(args: argparse.Namespace, out: Output) -> int:
    from torchverity import golden

    model, loaded = build_model(args.model, args.weights, args.device, out, fit_kwargs(args))
    rec = golden.record(model, _inputs(args, out, model), args.golden,
                        sample_size=args.sample_size)
    return out.result({"ok": True, "record": rec, "weights": loaded},
                      lambda: _print_record(rec, args.golden, out))


def _print_record(rec: GoldenRecord, path: Path, out: Output) -> None:
    from torchverity.golden import STATS

    weights = rec.model_fingerprint.root[:16] if rec.model_fingerprint else "-"
    out.line(f"recorded {path}: {len(rec.outputs)} output(s) on "
             f"{rec.environment['device']} ({rec.environment['device_name']})")
    out.table(("output", "dtype", "shape", "mean", "std", "min", "max"), [
        (o.name, o.dtype, list(o.shape), *(f"{o.summary[s]:.6g}" for s in STATS))
        for o in rec.outputs
    ])
    out.line(f"inputs {rec.input_fingerprint[:16]}…  weights {weights}…")


def _check(args: argparse.Namespace, out: Output) -> int:
    from torchverity import golden
    from torchverity._jsonable import to_jsonable

    model, loaded = build_model(args.model, args.weights, args.device, out, fit_kwargs(args))
    exact = _EXACT[args.mode]
    if args.check_weights:
        _require_fingerprint(args)
    result = golden.check(model, args.golden, exact=exact, rtol=args.rtol, atol=args.atol,
                          weights=args.check_weights)
    if result.ok and result.weights_changed is None and args.check_weights is not False:
        # Outputs alone miss a weight change that moves no output bit on the golden inputs.
        out.warn(f"{args.golden}: the record holds no weights fingerprint, so the weights were "
                 f"not compared, only the outputs; {_record_again(args)}")
    return out.result({**to_jsonable(result), "weights": loaded},
                      lambda: _print_check(result, args, out))


def _print_check(result: GoldenResult, args: argparse.Namespace, out: Output) -> None:
    from torchverity.golden._verdict import verdict

    where = ("same environment" if not result.environment_differences
             else "environment differs: " + "; ".join(result.environment_differences))
    if result.ok:
        out.line(f"golden check passed: {args.golden} ({result.mode} mode, {where}): "
                 f"{len(result.outputs)} output(s) match")
        return
    out.line(f"golden check FAILED: {args.golden} ({result.mode} mode, {where}); "
             f"failed parts: {', '.join(result.parts)}")
    out.table(("part", "output", "what"), [(f.part, f.output, f.message) for f in result.failures])
    what, step = verdict(result, weights=None if args.weights is None else str(args.weights),
                         device=args.device.split(":")[0])
    out.info(f"{what}; next: {step}")
