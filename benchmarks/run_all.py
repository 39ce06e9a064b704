"""Run every benchmark in one go and assemble docs/benchmarks.md from their results.

    python benchmarks/run_all.py            # all benchmarks, full sizes
    python benchmarks/run_all.py --quick    # smaller sizes
    python benchmarks/run_all.py --assemble # only rebuild docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DOCS = HERE.parent / "docs"
ORDER = ("digest", "checkpoint", "checkpoint-bert", "model-files", "protect", "startup", "scan",
         "guard", "distributed", "distributed-hsdp", "distributed-guard", "inference", "serve",
         "batch", "provenance")


def assemble() -> Path:
    parts = sorted((DOCS / "benchmarks").glob("*.md"),
                   key=lambda p: (ORDER.index(p.stem) if p.stem in ORDER else len(ORDER), p.stem))
    text = ("# Benchmarks\n\nEach section is written by `benchmarks/bench_<area>.py`; "
            "`make bench` runs them all and rebuilds this page. Ratios are measured side by "
            "side in one run on the machine named in each section (2 cores here), so they "
            "compare methods rather than machines.\n")
    for part in parts:
        # Each part's headings move one level down under this page's title.
        body = part.read_text().replace("\n## ", "\n### ")
        text += "\n#" + body if body.startswith("# ") else "\n" + body
    out = DOCS / "benchmarks.md"
    out.write_text(text)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--assemble", action="store_true")
    args = parser.parse_args()
    failed = []
    if not args.assemble:
        for script in sorted(HERE.glob("bench_*.py")):
            cmd = [sys.executable, str(script)] + (["--quick"] if args.quick else [])
            print(f"== {script.name}", flush=True)
            if subprocess.run(cmd).returncode != 0:
                failed.append(script.name)
    print(f"wrote {assemble()}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
