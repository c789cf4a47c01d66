"""``python -m pipeengine.train``: the trainer's command line (training/cli.py; launch/pipe.sh starts it)."""

from .training.cli import main

if __name__ == "__main__":
    main()
