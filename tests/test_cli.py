"""CLI conventions: exit codes, --json everywhere, golden output, no tracebacks."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from torchverity.cli import build_parser


def _fixed_tree(root: Path) -> Path:
    tree = root / "run"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.txt").write_text("alpha\n")
    (tree / "sub" / "b.bin").write_bytes(bytes(range(256)) * 4)
    return tree


def _leaf_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, child in subs[0].choices.items():
        yield from _leaf_parsers(child, (*path, name))


def test_every_command_accepts_json() -> None:
    leaves = list(_leaf_parsers(build_parser()))
    assert len(leaves) >= 5
    for path, parser in leaves:
        options = {opt for a in parser._actions for opt in a.option_strings}
        assert "--json" in options, f"torchverity {' '.join(path)} lacks --json"


def test_hash_output_matches_sha256sum(tmp_path: Path, run_cli, monkeypatch) -> None:
    tree = _fixed_tree(tmp_path)
    monkeypatch.chdir(tree)
    ours = run_cli("hash", "--algo", "sha256", "a.txt", "sub/b.bin")
    theirs = subprocess.run(["sha256sum", "a.txt", "sub/b.bin"], capture_output=True, text=True)
    assert ours.code == 0 and ours.out == theirs.stdout and ours.err == ""
    import blake3

    default = run_cli("hash", "a.txt")  # BLAKE3, as b3sum prints it
    assert default.out == blake3.blake3(b"alpha\n").hexdigest() + "  a.txt\n"


def test_json_outputs_are_stable(tmp_path: Path, run_cli, monkeypatch, golden) -> None:
    tree = _fixed_tree(tmp_path)
    monkeypatch.chdir(tmp_path)
    made = run_cli("manifest", "--json", "run")
    golden("manifest.json", made.out)
    golden("manifest-file.json", (tree / "torchverity.manifest.json").read_text())
    ok = run_cli("verify", "--json", "run")
    golden("verify-ok.json", ok.out)
    run_cli("inject", "bitflip", "run/a.txt", "--offset", "0", "--bit", "0")
    (tree / "sub" / "b.bin").unlink()
    (tree / "new.txt").write_text("new\n")
    bad = run_cli("verify", "--json", "run")
    assert bad.code == 1
    golden("verify-failed.json", bad.out)
    plain = run_cli("verify", "run")
    golden("verify-failed.txt", plain.out)


def test_exit_codes(tmp_path: Path, run_cli) -> None:
    tree = _fixed_tree(tmp_path)
    assert run_cli("hash", "--write", tree / "a.txt").code == 0
    assert run_cli("verify", tree / "a.txt").code == 0
    run_cli("inject", "bitflip", tree / "a.txt", "--random", "--seed", "3")
    failed = run_cli("verify", tree / "a.txt")
    assert failed.code == 1 and "FAILED (1 mismatched)" in failed.out
    missing = run_cli("verify", tmp_path / "nothing")
    assert missing.code == 2
    assert missing.err == (
        f"torchverity: error: {tmp_path / 'nothing'}: no such file or directory\n"
        f"  next: check the path; ls {tmp_path} lists what is there\n")
    by_sidecars = run_cli("verify", tree)  # no manifest: the sidecars it holds are checked
    assert by_sidecars.code == 1 and "1 per-file sidecar" in by_sidecars.out
    (tree / "a.txt.blake3").unlink()
    no_manifest = run_cli("verify", tree)
    assert no_manifest.code == 2
    assert f"next: record the folder from a trusted copy: torchverity manifest {tree}" \
        in no_manifest.err
    bad_flip = run_cli("inject", "bitflip", tree / "a.txt")
    assert bad_flip.code == 2 and "give --offset and --bit, or --random" in bad_flip.err


def test_json_error_document(tmp_path: Path, run_cli) -> None:
    result = run_cli("verify", "--json", tmp_path / "gone.pt")
    assert result.code == 2
    doc = json.loads(result.out)
    assert doc["ok"] is False and doc["error"] == "InputError"
    assert doc["path"] == str(tmp_path / "gone.pt")


def _cli_subprocess(
    *args: str, env: dict[str, str] | None = None, **kw
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchverity", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        **kw,
    )


def test_no_traceback_unless_debug(tmp_path: Path) -> None:
    tree = _fixed_tree(tmp_path)
    (tree / "torchverity.manifest.json").write_text("[]")
    quiet = _cli_subprocess("verify", str(tree))
    assert quiet.returncode == 2 and "Traceback" not in quiet.stderr
    assert "invalid manifest" in quiet.stderr and quiet.stdout == ""
    loud = _cli_subprocess("verify", str(tree), env={"TORCHVERITY_DEBUG": "1"})
    assert loud.returncode != 0 and "Traceback" in loud.stderr


def test_unreadable_file_exits_2(tmp_path: Path) -> None:
    secret = tmp_path / "secret.pt"
    secret.write_bytes(b"x" * 10)
    secret.chmod(0)
    # Root reads everything, so drop to 'nobody' once the modules are imported.
    code = (
        "import locale, os, sys; import torchverity.cli, torchverity.digest\n"
        "torchverity.cli.build_parser().parse_args(['hash', 'x'])\n"
        "if os.geteuid() == 0:\n    os.setgid(65534); os.setuid(65534)\n"
        "sys.exit(torchverity.cli.main(['hash', sys.argv[1]]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(secret)], capture_output=True, text=True
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"torchverity: error: {secret}: permission denied\n  next: check the file's permissions\n"
    )


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys; from torchverity.cli import build_parser; build_parser(); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("args", [["--version"], []])
def test_version_and_bare_invocation(args: list[str]) -> None:
    result = _cli_subprocess(*args)
    if args:
        assert result.returncode == 0 and result.stdout.startswith("torchverity ")
    else:
        assert result.returncode == 2 and "usage:" in result.stderr


def _run_in_terminal(args: list[str], cwd: Path) -> str:
    """Run the CLI with stdout and stderr on a real pseudo-terminal; return what it drew."""
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "torchverity", *args], cwd=cwd,
                            stdout=follower, stderr=follower, env={**os.environ, "COLUMNS": "200"})
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=60)
    os.close(leader)
    return b"".join(chunks).decode(errors="replace")


def test_rich_table_on_a_terminal_plain_text_in_a_pipe(tmp_path: Path) -> None:
    tree = _fixed_tree(tmp_path)
    subprocess.run([sys.executable, "-m", "torchverity", "manifest", "run"], cwd=tmp_path,
                   check=True, capture_output=True)
    (tree / "a.txt").write_text("changed\n")
    drawn = _run_in_terminal(["verify", "run"], tmp_path)
    assert "┃" in drawn or "│" in drawn, drawn
    piped = _cli_subprocess("verify", "run", cwd=tmp_path)
    assert piped.returncode == 1
    assert "│" not in piped.stdout and "\x1b[" not in piped.stdout + piped.stderr


def test_an_internal_error_has_its_own_exit_code(
    run_cli: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A bug is never reported as a verdict on the input (exit 2) or a failed check (1)."""
    from torchverity.cli import _cmd_hash

    def broken(args: object, out: object) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr(_cmd_hash, "_run", broken)  # register() binds _run when main runs
    (tmp_path / "f").write_bytes(b"x")
    result = run_cli("hash", tmp_path / "f")
    assert result.code == 3
    assert "internal error: RuntimeError: a bug" in result.err
    assert "TORCHVERITY_DEBUG=1" in result.err


def test_every_command_module_is_listed() -> None:
    import pkgutil

    import torchverity.cli as cli

    found = {m.name.removeprefix("_cmd_") for m in pkgutil.iter_modules(cli.__path__)
             if m.name.startswith("_cmd_")}
    assert found == set(cli.COMMANDS)
