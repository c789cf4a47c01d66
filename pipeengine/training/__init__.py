"""The training layer: config and command line, the Trainer, data, checkpoints, reporting (TensorBoard, timeline,
summary). Modules import torch only where they need it: ``config`` and ``cli`` stay torch-free for ``--help``."""
