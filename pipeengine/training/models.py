"""Which model a run trains: ``--model NAME`` (a built-in) or ``--model package.module:function`` (yours).

The protocol: ``function(preset, data)`` returns a :class:`Model`. ``preset`` is ``--preset`` (None
when not given: pick your default) and ``data`` is ``--data`` (None: your default data); a function
that also takes ``dropout`` gets ``--dropout`` when it is given (``context`` and ``packing`` alike). Raise
``ValueError`` for a preset or
data you cannot use; the message is shown as it is. For example::

    def my_model(preset: str | None, data: str | None) -> pipeengine.Model:
        width = {"small": 256, "large": 1024}[preset or "small"]
        return pipeengine.Model(layers=[lambda: nn.Linear(32, width), lambda: nn.ReLU(),
                                        lambda: nn.Linear(width, 10)],
                                loss_fn=nn.functional.cross_entropy, data=MyExamples(data))

The built-in models (``models/`` in the source tree, installed as ``pipeengine.models``) use the
same protocol: ``--model gpt`` is ``--model pipeengine.models.gpt:model``.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from .checks import BUILTIN_MODELS
from .feed import check_data

__all__ = ["Model", "load_model", "pick_preset"]


def _cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension (classes, or a vocabulary at every position)."""
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


@dataclass
class Model:
    """A model the trainer can split into stages.

    - ``layers``: a factory per layer, called in order on each rank for the layers it holds (no rank
      builds the whole model); layer ``i`` takes layer ``i - 1``'s output (a tuple stays a tuple).
    - ``loss_fn(output, target)``: the mean loss of a microbatch (default: cross-entropy).
    - ``data``: what the trainer trains on: a ``torch.utils.data.Dataset`` giving ``(input, target)``
      pairs, an ``IterableDataset`` of them (a stream every rank reads alike), or examples by index
      (``num_examples(split)`` and ``example(split, i)``, split ``"train"`` or ``"val"``: the built-in
      models' form); see ``training/feed.py``.
    - ``val_data``: a Dataset (or IterableDataset) to validate on, for a ``data`` that is a Dataset
      (None: no validation; the protocol form brings its own ``"val"`` split).
    - ``tied``: groups of ``(layer, parameter name)`` that are one weight (e.g. the embedding and the
      LM head); each group's first entry gives the initial value.
    - ``tokens_per_example``: for tokens/s (sequence models); ``preset``: the size chosen, for logs.
    - ``packing``: a :class:`~pipeengine.training.packing.Packing` for sequences of different lengths (the
      examples are 1-D ``(input, target)`` token sequences and the data has ``lengths(split)``): each step's
      sequences become microbatches by it, and tokens/s counts real tokens.
    """

    layers: Sequence[Callable[[], nn.Module]]
    loss_fn: Callable[[Any, Any], torch.Tensor] = _cross_entropy
    data: Any = None
    tied: Sequence[Sequence[tuple[int, str]]] = field(default_factory=list)
    tokens_per_example: int | None = None
    preset: str | None = None
    val_data: Any = None
    packing: Any = None


def pick_preset(model: str, table: Mapping[str, Callable[[], Any]], preset: str | None, default: str) -> Any:
    """The config of ``preset`` (``default`` when None) from ``table``, or a ValueError listing the choices."""
    name = preset or default
    if name not in table:
        raise ValueError(f"--preset {name!r} is not a {model} preset; choose {', '.join(table)}")
    return table[name]()


def _function(spec: str) -> Callable[..., Any]:
    path = f"pipeengine.models.{spec}:model" if spec in BUILTIN_MODELS else spec
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"--model {spec!r}: no module named {exc.name!r} (is its folder on PYTHONPATH, or the "
                         f"package installed?)") from None
    except Exception as exc:   # noqa: BLE001 - the user's module failed to import: say how, in one line
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(f"--model {spec!r}: importing {module_name} raised {type(exc).__name__}: {first}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"--model {spec!r}: {module_name} has no function {attr!r}")
    return fn   # type: ignore[no-any-return]


def _takes(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):   # a builtin without a signature: try it
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _signature(fn: Callable[..., Any]) -> str:
    try:
        return f"{getattr(fn, '__name__', 'function')}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return repr(fn)


def _where(exc: BaseException) -> str:
    """The innermost ``file:line`` of an exception's traceback."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else "?"


def load_model(spec: str, preset: str | None, data: str | None, dropout: float | None = None,
               context: int | None = None, packing: str | None = None) -> Model:
    """The :class:`Model` that ``--model spec`` names, checked; a ValueError says what is wrong with it.
    ``dropout``, ``context``, ``packing`` (``--dropout`` ..., None: not given) go to the function by name."""
    fn = _function(spec)
    options = {k: v for k, v in (("dropout", dropout), ("context", context), ("packing", packing)) if v is not None}
    for name in options:
        if not _takes(fn, name):
            raise ValueError(f"--{name}: --model {spec!r} takes no {name} (its function has no {name} parameter); "
                             f"give it one, function(preset, data, {name}=...), or leave --{name} out")
    try:
        model = fn(preset, data, **options)
    except ValueError:
        raise
    except TypeError as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        try:
            inspect.signature(fn).bind(preset, data, **options)
        except (TypeError, ValueError):   # it cannot be called so: its signature is the problem
            raise ValueError(f"--model {spec!r}: it must be callable as function(preset, data) (got the signature "
                             f"{_signature(fn)}: {first})") from None
        raise ValueError(f"--model {spec!r} raised TypeError inside ({_where(exc)}): {first}") from None
    if not isinstance(model, Model):
        raise ValueError(f"--model {spec!r} returned {type(model).__name__}, not a pipeengine.Model")
    if not model.layers or not all(callable(f) for f in model.layers):
        raise ValueError(f"--model {spec!r}: Model.layers must be a non-empty list of layer factories (callables "
                         f"returning an nn.Module)")
    if not callable(model.loss_fn):
        raise ValueError(f"--model {spec!r}: Model.loss_fn must be callable as loss_fn(output, target)")
    try:
        check_data(model.data)
        check_data(model.val_data, "Model.val_data")
    except ValueError as exc:
        raise ValueError(f"--model {spec!r}: {exc}") from None
    model.layers = list(model.layers)
    return model
