"""Demo step: a batch job killed half-way with SIGKILL resumes to exactly one output per input."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from torchverity.demo import DemoContext

TITLE = "Batch: kill -9 half-way, rerun, exactly one verified output per input"

ITEMS = 120
MODEL_CODE = '''
import os, time
import torch

def build(state):
    model = torch.nn.Linear(8, 2)
    model.load_state_dict(state)
    model.eval()
    # The killed run stalls after this many items, as a hung worker would, so the kill
    # always lands half-way whatever the machine's load.
    stall_after = int(os.environ.get("TV_DEMO_STALL_AFTER", "0"))
    done = [0]

    def fn(item):
        done[0] += 1
        if stall_after and done[0] > stall_after:
            time.sleep(3600)
        x = torch.frombuffer(bytearray(item.data[:32]), dtype=torch.float32).reshape(1, 8)
        with torch.no_grad():
            return model(x.nan_to_num()).numpy().tobytes()
    return fn
'''


def _committed(out: Path) -> int:
    journal = out / "batch-journal.sqlite"
    if not journal.exists():
        return 0
    with sqlite3.connect(f"file:{journal}?mode=ro", uri=True, timeout=5) as conn:
        return int(conn.execute("SELECT COUNT(*) FROM items WHERE state='committed'").fetchone()[0])


def _start_and_kill_half_way(args: list[str], env: dict[str, str], out: Path) -> int:
    proc = subprocess.Popen([sys.executable, "-m", "torchverity", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while _committed(out) < ITEMS // 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return _committed(out)


def run(ctx: DemoContext) -> None:
    import torch

    import torchverity

    root = ctx.workdir / "batch"
    inputs, code, out = root / "inputs", root / "code", root / "out"
    inputs.mkdir(parents=True)
    code.mkdir()
    (code / "tvdemo_batch.py").write_text(MODEL_CODE)
    gen = torch.Generator().manual_seed(0)
    for i in range(ITEMS):
        (inputs / f"sample{i:04d}.bin").write_bytes(torch.randn(8, generator=gen).numpy().tobytes())
    torch.manual_seed(0)
    weights = root / "linear.pt"
    torchverity.save(torch.nn.Linear(8, 2).state_dict(), weights)
    ctx.say(f"{ITEMS} input files, a small model with verified weights; run the job in a "
            "subprocess and kill -9 it half-way:")
    args = ["batch", "run", "--inputs", str(inputs), "--model", "tvdemo_batch:build",
            "--weights", str(weights), "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(code), TV_DEMO_STALL_AFTER=str(ITEMS // 2))
    killed_at = _start_and_kill_half_way(args, env, out)
    ctx.say(f"  $ torchverity {' '.join(args)}   # killed with SIGKILL")
    ctx.expect(0 < killed_at < ITEMS, f"the job died half-way ({killed_at} of {ITEMS} committed)")

    ctx.say("rerun the very same command: it resumes from the journal")
    sys.path.insert(0, str(code))
    try:
        ctx.cli(*args)
    finally:
        sys.path.remove(str(code))
    ctx.cli("batch", "verify", str(out))
    outputs = sorted(p.name for p in (out / "data").iterdir())
    ctx.expect(outputs == sorted(f"{p.name}.out" for p in inputs.iterdir()),
               f"exactly one output per input ({len(outputs)} outputs, no duplicates)")

    damaged = out / "data" / "sample0007.bin.out"
    raw = bytearray(damaged.read_bytes())
    raw[0] ^= 0x01
    damaged.write_bytes(raw)
    ctx.say("one bit of one output flips after the job:")
    _, text, _ = ctx.cli("batch", "verify", str(out), expect=1)
    ctx.expect("output-mismatch: sample0007.bin" in text, "verify names the damaged output")
