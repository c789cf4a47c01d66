"""The runtime (torch): topology and groups, the plan, the engine that interprets it, stages, the wire,
gradient sync, numerics and faults. ``options`` is torch-free: the trainer's command line checks its
values with the same functions the engine uses."""
