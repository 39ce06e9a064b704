"""``int | None`` in a checkpoint is typing data; the globals spelling it, used otherwise, are not.

Pickle has no reduce of its own for a union of types: ``int | None`` is written as
``functools.reduce(operator.or_, (int, type(None)))`` (``__builtin__.reduce`` up to
protocol 2). That call, with every member a type of data classes, is judged data; reduce
given another callable, or_ given a member that runs code, a union of a class whose own
``__or__`` runs code, and reduce or or_ used any other way stay dangerous, each proved
live in a throwaway process.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import torch

from torchverity.pickles import scan_file
from torchverity.pickles._classes import BENIGN, DANGEROUS

_REDUCES = ("__builtin__.reduce", "_functools.reduce", "functools.reduce")
_ORS = ("_operator.or_", "operator.or_")


def _found(path: Path) -> tuple[str, dict[str, tuple[str, str]]]:
    result = scan_file(path)
    return result.verdict, {g.name: (g.category, g.reason) for g in result.globals}


def _run(code: str, *args: str) -> str:
    """Run ``code`` in a throwaway interpreter; its stdout."""
    done = subprocess.run([sys.executable, "-c", code, *args], check=True, timeout=120,
                          capture_output=True, text=True)
    return done.stdout.strip()


_LOAD_REPR = """
import pickle, sys, torch
path = sys.argv[1]
with open(path, "rb") as fh:
    obj = torch.load(fh, weights_only=False) if path.endswith(".pt") else pickle.load(fh)
print(repr(obj["hp"]["x"]))
"""


def test_a_union_of_types_is_typing_data(tmp_path: Path) -> None:
    hp = {"x": int | None, "many": int | str | None, "gen": list[int] | None,
          "nested": dict[str, int | None] | None, "opt": typing.Optional[int] | str}  # noqa: UP045
    files = {}
    for protocol in range(6):
        files[f"p{protocol}.pkl"] = pickle.dumps({"hp": hp}, protocol)
    files["default.pt"] = None
    # Spellings no pickler of this Python writes, that older or other ones may: the public
    # module names, and or_ called on two types directly.
    files["public_names.pkl"] = (b"\x80\x02}X\x02\x00\x00\x00hp}X\x01\x00\x00\x00xcfunctools\n"
                                 b"reduce\ncoperator\nor_\nc__builtin__\nint\nc__builtin__\ntype"
                                 b"\nN\x85R\x86\x86Rss.")
    files["direct_or.pkl"] = (b"\x80\x02}X\x02\x00\x00\x00hp}X\x01\x00\x00\x00xc_operator\nor_"
                              b"\nc__builtin__\nint\nc__builtin__\ntype\nN\x85R\x86Rss.")
    for name, data in files.items():
        path = tmp_path / name
        if data is None:
            torch.save({"w": torch.zeros(2), "hp": hp}, path)
        else:
            path.write_bytes(data)
        verdict, found = _found(path)
        assert verdict == "needs-allowlist", (name, found)
        assert {c for c, _ in found.values()} <= {BENIGN, "torch"}, (name, found)
        reduce_ = [found[n] for n in _REDUCES if n in found]
        or_ = [found[n] for n in _ORS if n in found]
        assert or_ and (reduce_ or name == "direct_or.pkl"), (name, found)
        for _, reason in reduce_:
            assert reason == "builds a union of types (int | None): typing data", (name, reason)
        assert or_[0][1] == "joins the members of a union of types (int | None): typing data"
        # What the real unpickler makes of it: the union itself.
        assert _run(_LOAD_REPR, str(path)) == "int | None", name


def test_the_plan_inspect_and_migrate_show_the_union(tmp_path: Path,
                                                     run_cli: Any) -> None:
    path = tmp_path / "hp.pt"
    torch.save({"w": torch.zeros(2), "hp": {"x": int | None, "n": 3}}, path)
    plan = scan_file(path).plan
    assert plan is not None and plan.loadable
    assert {"functools.reduce", "_operator.or_"} <= set(plan.needs), plan.needs
    loaded = _run(plan.code + "print(repr(obj['hp']['x']))\n")  # our own advice, own file
    assert loaded == "int | None", plan.code
    res = run_cli("inspect", "--json", path)
    assert res.code == 0, res
    values = json.loads(res.out)["values"]
    assert values["hp.x.$type"] == "'int | None'" and values["hp.n"] == "3", values
    out = tmp_path / "hp.safetensors"
    res = run_cli("migrate", path, out)
    assert res.code == 0, res
    meta = json.loads(Path(f"{out}.meta.json").read_text())
    assert meta["user"]["content"]["hp"] == {"x": {"$type": "int | None"}, "n": 3}


_PICKLE_LOAD = """
import pickle, sys
try:
    pickle.load(open(sys.argv[1], "rb"))
except Exception:
    pass
"""
# A class whose metaclass runs code when it is joined into a union (Hint | None).
_HINT_MODULE = """
import os
class Meta(type):
    def __or__(cls, other):
        open(os.environ["TV_SENTINEL"], "w").close()
        return NotImplemented
class Hint(metaclass=Meta):
    pass
"""


def _text(value: str) -> bytes:
    """BINUNICODE of ``value``."""
    return b"X" + len(value.encode()).to_bytes(4, "little") + value.encode()


_REAL_UNION = (b"c__builtin__\nreduce\nq\x00c_operator\nor_\nc__builtin__\nint\nc__builtin__\n"
               b"type\nN\x85R\x86\x86R")


def _payloads(sentinel: Path) -> dict[str, tuple[bytes, tuple[str, ...]]]:
    """name -> (pickle whose payload creates ``sentinel``, the reduce/or_ globals that must
    stay dangerous in it)."""
    code = _text(f"open({str(sentinel)!r}, 'w').close()")
    both = ("__builtin__.reduce", "_operator.or_")
    return {
        # reduce handed another callable: exec(code, {})
        "reduce_other_callable": (b"\x80\x02c__builtin__\nreduce\nc__builtin__\nexec\n" + code
                                  + b"}\x86\x86R.", ("__builtin__.reduce",)),
        # a union member built by a call that runs a command
        "member_runs_code": (b"\x80\x02c__builtin__\nreduce\nc_operator\nor_\nc__builtin__\n"
                             b"int\ncos\nsystem\n" + _text(f"touch {sentinel}")
                             + b"\x85R\x86\x86R.", both),
        # a union of a class whose metaclass __or__ runs code, through reduce and directly
        "unknown_member": (b"\x80\x02c__builtin__\nreduce\nc_operator\nor_\nchintlib\nHint\n"
                           b"c__builtin__\ntype\nN\x85R\x86\x86R.", both),
        "unknown_member_or": (b"\x80\x02c_operator\nor_\nchintlib\nHint\nc__builtin__\ntype\nN"
                              b"\x85R\x86R.", ("_operator.or_",)),
        # the memoized reduce of a real union called again, on exec
        "reduce_reused": (b"\x80\x02" + _REAL_UNION + b"h\x00c__builtin__\nexec\n" + code
                          + b"}\x86\x86R\x86.", ("__builtin__.reduce",)),
    }


def test_the_same_globals_used_otherwise_stay_dangerous(tmp_path: Path) -> None:
    live = tmp_path / "live"
    live.mkdir()
    (live / "hintlib.py").write_text(_HINT_MODULE)
    for name in _payloads(live / "RAN"):
        sentinel = live / f"RAN_{name}"
        path = live / f"{name}.pkl"
        path.write_bytes(_payloads(sentinel)[name][0])
        subprocess.run([sys.executable, "-c", _PICKLE_LOAD, str(path)], check=True, timeout=120,
                       capture_output=True, env={**os.environ, "PYTHONPATH": str(live),
                                                 "TV_SENTINEL": str(sentinel)})
        assert sentinel.exists(), f"{name}: the payload did not run under pickle.load"

    checked = tmp_path / "checked"
    checked.mkdir()
    (checked / "hintlib.py").write_text(_HINT_MODULE)
    for name, (data, offenders) in _payloads(checked / "RAN").items():
        path = checked / f"{name}.pkl"
        path.write_bytes(data)
        verdict, found = _found(path)
        assert verdict == "unsafe", (name, found)
        for offender in offenders:
            category, reason = found[offender]
            assert category == DANGEROUS and "union" not in reason, (name, found)
    assert not list(checked.glob("RAN*"))


def test_unions_that_are_not_plain_data_keep_their_class(tmp_path: Path) -> None:
    """No payload runs in these (a member that is no type fails the union); the rule is
    exact all the same."""
    cases = {
        # a constant member: int | 3
        "constant_member": (b"\x80\x02c__builtin__\nreduce\nc_operator\nor_\nc__builtin__\nint"
                            b"\nK\x03\x86\x86R.", ("__builtin__.reduce", "_operator.or_")),
        # a dangerous global as a member: int | os.system
        "dangerous_member": (b"\x80\x02c__builtin__\nreduce\nc_operator\nor_\nc__builtin__\nint"
                             b"\ncos\nsystem\n\x86\x86R.", ("__builtin__.reduce", "_operator.or_")),
        # the argument tuple of a real union, memoized, also handed on as a value
        "arguments_reused": (b"\x80\x02c__builtin__\nreduce\nc_operator\nor_\nc__builtin__\nint"
                             b"\nc__builtin__\ntype\nN\x85R\x86\x86q\x00Rh\x00\x86.",
                             ("_operator.or_",)),
        # or_ handed on as a value beside a real union
        "or_escapes": (b"\x80\x02" + _REAL_UNION.replace(b"or_\n", b"or_\nq\x01")
                       + b"h\x01\x86.", ("_operator.or_",)),
        # reduce over no members, and with an initial value
        "no_members": (b"\x80\x02c__builtin__\nreduce\nc_operator\nor_\n)\x86R.",
                       ("__builtin__.reduce", "_operator.or_")),
        "initial_value": (b"\x80\x02c__builtin__\nreduce\nc_operator\nor_\nc__builtin__\nint"
                          b"\n\x85c__builtin__\nint\n\x87R.", ("__builtin__.reduce",)),
    }
    for name, (data, offenders) in cases.items():
        path = tmp_path / f"{name}.pkl"
        path.write_bytes(data)
        verdict, found = _found(path)
        assert verdict == "unsafe", (name, found)
        for offender in offenders:
            assert found[offender][0] == DANGEROUS, (name, offender, found)
