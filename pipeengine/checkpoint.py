"""``python -m pipeengine.checkpoint``: inspect a checkpoint or export its model (training/export.py)."""

import sys

from .training.export import main

if __name__ == "__main__":
    sys.exit(main())
