"""The engine's settings that the trainer's command line takes too: allowed values and their checks (torch-free).

Each check names the setting as the caller knows it (``--timeout`` on the command line, ``timeout``
for the engine), so one function serves both and a value is checked in one place.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

__all__ = ["PRECISIONS", "WIRE_MODES", "BOUNDARY_DTYPES",
           "ON_NONFINITE", "STARTUP_TIMEOUT", "check_choice", "check_timeout",
           "check_grad_clip", "parse_recompute", "SELECTIVE", "check_engine_arguments", "checked_optimizer"]

PRECISIONS = ("fp32", "bf16", "fp16")   # fp32 throughout; bf16 autocast; fp16 autocast with a loss scale (CUDA)
WIRE_MODES = ("tags", "strict")         # Gloo: a tag per transfer, or NCCL's per-peer order emulated
BOUNDARY_DTYPES = ("fp32", "bf16")      # what fp32 activations and their gradients travel between stages as
ON_NONFINITE = ("stop", "skip")         # a non-finite loss or gradient: raise naming the stage, or skip the update
STARTUP_TIMEOUT = 600.0                 # seconds a wait may take until the first step has been timed


def check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)} (got {value!r})")
    return str(value)


ADAPTIVE = f"{STARTUP_TIMEOUT:.0f} s until the first step, then max(60 s, 20 x the median step)"


def check_timeout(name: str, value: float | None, default: str = ADAPTIVE, why: str = "one exchange between ranks"
                  ) -> float | None:
    """None (``default``, adaptive for the engine's waits: see faults.adaptive_timeout) or a finite number of
    seconds > 0, at least 1 (``why``: what a shorter time could not hold)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        shown = f"{value:g}" if isinstance(value, (int, float)) else repr(value)
        raise ValueError(f"{name} must be a positive number of seconds (got {shown}); leave it out for the default "
                         f"({default})")
    if value < 1:
        raise ValueError(f"{name} {value:g} s is shorter than {why} can take; give at least 1 s")
    return float(value)


def check_grad_clip(name: str, value: float | None) -> float | None:
    """None (measure the norm only) or a finite maximum norm > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        shown = f"{value:g}" if isinstance(value, (int, float)) else repr(value)
        raise ValueError(f"{name} must be a positive, finite gradient norm (got {shown}); use None to measure the "
                         f"norm without clipping")
    return float(value)


SELECTIVE = -1   # parse_recompute's code for "selective" ([Note: recompute] in recompute.py)


def parse_recompute(spec: str, name: str = "recompute") -> int | None:
    """Layers per recompute region: ``none`` -> None, ``full`` -> 0 (the whole stage), ``every:K`` -> K,
    ``selective`` -> :data:`SELECTIVE` (each layer a region that keeps its matrix products)."""
    if spec == "none":
        return None
    if spec == "full":
        return 0
    if spec == "selective":
        return SELECTIVE
    if isinstance(spec, str) and spec.startswith("every:") and spec[6:].isdigit() and int(spec[6:]) >= 1:
        return int(spec[6:])
    raise ValueError(f"{name} must be 'none', 'selective', 'full' or 'every:K' with K >= 1 layers per region "
                     f"(got {spec!r})")


def check_engine_arguments(layers: Any, loss_fn: Any, optimizer: Any, precision: str, recompute: str, wire: str,
                           on_nonfinite: str, timeout: float | None, grad_clip: float | None, seed: Any = 0,
                           boundary_dtype: str = "fp32") -> None:
    """Every argument a user can get wrong, before any collective (so the error is the same on every rank)."""
    if not isinstance(layers, Sequence) or isinstance(layers, (str, bytes)) or not layers:
        raise TypeError(f"layers must be a non-empty list of nn.Modules or factories (got {type(layers).__name__})")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function (output, target) -> scalar Tensor (got {loss_fn!r})")
    if hasattr(optimizer, "param_groups") or not callable(optimizer):
        raise TypeError(f"optimizer must be a factory params -> Optimizer, e.g. lambda ps: torch.optim.AdamW(ps, "
                        f"lr=1e-3): each rank builds it for its own parameters (got {type(optimizer).__name__})")
    check_choice("precision", precision, PRECISIONS)
    check_choice("wire", wire, WIRE_MODES)
    check_choice("boundary_dtype", boundary_dtype, BOUNDARY_DTYPES)
    check_choice("on_nonfinite", on_nonfinite, ON_NONFINITE)
    parse_recompute(recompute)
    check_timeout("timeout", timeout)
    check_grad_clip("grad_clip", grad_clip)
    _check_no_shared_parameters(layers)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise TypeError(f"seed must be a whole number in [0, 2**63) (got {seed!r})")


def _check_no_shared_parameters(layers: Sequence[Any]) -> None:
    """A module object (or one parameter) at two layers would be split into two copies once the stages are
    built on different ranks: refused, naming both layers and the way to share weights."""
    owner: dict[int, tuple[int, str]] = {}
    for i, layer in enumerate(layers):   # built modules only: a factory (a function, a class) builds its own
        named = getattr(layer, "named_parameters", None) if not isinstance(layer, type) else None
        for name, p in (named() if callable(named) else ()):
            first = owner.setdefault(id(p), (i, name))
            if first[0] != i:
                what = (f"the same module object ({type(layer).__name__})" if layer is layers[first[0]]
                        else f"one parameter ({first[1]!r} of layer {first[0]}, {name!r} of layer {i})")
                raise ValueError(f"layers {first[0]} and {i} share {what}: stages on different ranks would train "
                                 f"two copies; give each layer its own module, and declare weights meant to be one "
                                 f"with tied=[[({first[0]}, {first[1]!r}), ({i}, {name!r})]]")


def checked_optimizer(optimizer: Any) -> Any:
    """What the optimizer factory returned, if it is an Optimizer (alike on every rank: no collective yet)."""
    import torch
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer(params) must return a torch.optim.Optimizer (got {type(optimizer).__name__}); "
                        f"e.g. lambda ps: torch.optim.AdamW(ps, lr=1e-3)")
    return optimizer
