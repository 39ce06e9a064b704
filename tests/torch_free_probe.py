"""Run the CLI in a fresh interpreter and tell whether it imported torch."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
from torchverity.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "torch": "torch" in sys.modules}), file=sys.stderr)
"""


def cli(*args: object) -> dict[str, object]:
    """``{"code": exit code, "torch": imported?, "out": stdout}`` of ``torchverity ARGS``."""
    proc = subprocess.run([sys.executable, "-c", PROBE, *map(str, args)], capture_output=True,
                          text=True, timeout=120, check=False)
    result: dict[str, object] = json.loads(proc.stderr.strip().splitlines()[-1])
    result["out"] = proc.stdout
    return result
