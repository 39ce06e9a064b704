"""``python -m torchverity`` runs the CLI."""

import sys

from torchverity.cli import main

if __name__ == "__main__":
    sys.exit(main())
