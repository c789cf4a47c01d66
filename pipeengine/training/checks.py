"""Checks of one setting's value (torch-free): each takes the setting's name as the user knows it (the flag)
and the value, and returns the value or raises a ValueError that names both."""

from __future__ import annotations

import math
import os
import re
from typing import Any, Callable

from ..runtime.options import check_grad_clip, check_timeout, parse_recompute

__all__ = ["BUILTIN_MODELS", "model_spec", "Check", "at_least", "finite", "probability", "seed", "grad_clip",
           "recompute", "timeout", "seconds", "partition", "partition_arg", "output_problem", "writable_folder"]

BUILTIN_MODELS = ("gpt", "resnet", "mlp")
Check = Callable[[str, Any], Any]   # (the setting's name as the user knows it, value) -> value, or ValueError


def at_least(low: int, what: str | None = None) -> Check:
    """A whole number >= ``low`` (``what`` says it in words: "a positive number of examples")."""
    def check(name: str, value: Any) -> Any:
        if value is not None and value < low:
            raise ValueError(f"{name} must be {what or f'>= {low}'} (got {value})")
        return value
    return check


def zero(name: str, value: Any) -> Any:
    if value not in (0, 1):
        raise ValueError(f"{name} must be 0 (a whole optimizer state per replica) or 1 (sharded over the replicas: "
                         f"ZeRO-1), got {value}; stages 2 and 3 (sharded gradients and parameters) are not built")
    return value


def finite(low: float = -math.inf, *, above: bool = False, what: str = "number") -> Check:
    """A finite number >= ``low`` (> ``low`` with ``above``)."""
    def check(name: str, value: Any) -> Any:
        if value is None:
            return value
        if not math.isfinite(value) or (value <= low if above else value < low):
            wanted = (f"a positive {what}" if above and low == 0 else
                      f"a finite {what} {'>' if above else '>='} {low:g}")
            raise ValueError(f"{name} must be {wanted} (got {value:g})")
        return value
    return check


def probability(name: str, value: Any) -> Any:
    """A probability of dropping an element: 0 <= p < 1 (None: the model's own)."""
    if value is not None and not 0 <= value < 1:
        raise ValueError(f"{name} must be at least 0 and below 1 (got {value:g})")
    return value


def seed(name: str, value: Any) -> Any:
    if not 0 <= value < 2**63:
        raise ValueError(f"{name} must be a whole number from 0 to 2**63 - 1 (got {value})")
    return value


def grad_clip(name: str, value: Any) -> Any:
    if value is not None and math.isfinite(value) and value <= 0:
        return None   # "<= 0: off"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite gradient norm (got {value!r}); 0 turns clipping off")
    return check_grad_clip(name, value)


def recompute(name: str, value: Any) -> Any:
    parse_recompute(value, name)
    return value


def timeout(name: str, value: Any) -> Any:
    return check_timeout(name, value)


def seconds(default: str, why: str) -> Check:
    """A number of seconds >= 1 whose message quotes its own ``default`` and ``why`` (what less could not hold)."""
    def check(name: str, value: Any) -> Any:
        return check_timeout(name, value, default, why)
    return check


def partition(name: str, value: Any) -> Any:
    partition_arg(value, name)
    return value


def partition_arg(value: str, name: str = "--partition") -> str | list[int]:
    """``--partition`` for the engine: a method name, or explicit stage bounds."""
    if value in ("profile", "parameters", "uniform"):
        return value
    try:
        return [int(b) for b in value.split(",")]
    except ValueError:
        raise ValueError(f"{name} must be profile, parameters, uniform or stage bounds like 0,3,6,10 (got "
                         f"{value!r})") from None


def model_spec(name: str, value: Any) -> Any:
    """A built-in model's name, or ``package.module:function``."""
    if value in BUILTIN_MODELS or re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", str(value)):
        return value
    raise ValueError(f"{name} {value!r} is not {', '.join(BUILTIN_MODELS)} or package.module:function (a function "
                     f"returning a pipeengine.Model)")


def output_problem(out: str) -> str | None:
    """Why the file ``out`` cannot be written later (a folder, a missing or read-only folder), or None."""
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        return f"{out!r} is a folder; give the file to write, e.g. {os.path.join(out, 'model.pt')}"
    if not os.path.isdir(folder):
        return f"cannot write {out!r}: the folder {folder!r} does not exist; create it first"
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(out) and not os.access(out, os.W_OK)):
        return f"cannot write {out!r}: the folder {folder!r} is not writable; give another path"
    return None


def writable_folder(path: str, flag: str) -> None:
    """``path`` exists (made if need be) and this process may write in it; else ValueError naming ``flag``."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{flag} {path!r} cannot be created: {exc.strerror}; choose a writable folder") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path!r} is not writable; choose a writable folder")
