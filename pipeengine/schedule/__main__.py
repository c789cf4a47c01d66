"""``python -m pipeengine.schedule``: the schedule tool (see cli.py)."""

import sys

from .cli import main

sys.exit(main())
