"""``python -m torchverity`` runs the CLI."""

import sys

from torchverity.cli import main

sys.exit(main())
