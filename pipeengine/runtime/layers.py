"""Layer lists given as modules or factories: per-layer deterministic construction, sizing on meta, fingerprints.

[Note: per-stage construction]
A model too big for one device is given as *layer factories*: zero-argument callables that each
build one layer. A rank calls only the factories of its own stages, each under its own RNG seed
``layer_seed(seed, i)`` (forked, so the caller's RNG is untouched), so layer ``i`` gets the same
weights whatever pp, dp, chunks or partition, and :func:`build_layers` gives the single-process
model with exactly those weights. Partitioning by parameter count needs every layer's size: the
factories are run on the ``meta`` device for that, which allocates nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import torch
from torch import nn

__all__ = ["LayerSpec", "LayerSpecError", "layer_seed", "build_layer", "build_layers", "sizing_layers", "fingerprint",
           "model_mismatch"]

LayerSpec = Union[nn.Module, Callable[[], nn.Module]]
"""One entry of a model's layer list: a built module, or a zero-argument factory building it."""


class LayerSpecError(TypeError, ValueError):
    """A layer list entry that is not a module or a factory of one: bad input (a ValueError, said in one line by
    the trainer), and a TypeError for callers that catch those."""


def layer_seed(seed: int, index: int) -> int:
    """The RNG seed layer ``index`` is built under."""
    return (seed * 1_000_003 + index) % (2**63)


def _is_factories(specs: Sequence[LayerSpec]) -> bool:
    kinds = {isinstance(s, nn.Module) for s in specs}
    if len(kinds) > 1:
        i = next(i for i, s in enumerate(specs) if isinstance(s, nn.Module) != isinstance(specs[0], nn.Module))
        raise LayerSpecError(f"the layer list mixes modules and factories (entry 0 is {type(specs[0]).__name__}, "
                             f"entry {i} is {type(specs[i]).__name__}); give all modules or all factories")
    bad = [i for i, s in enumerate(specs) if not isinstance(s, nn.Module) and not callable(s)]
    if bad:
        raise LayerSpecError(f"layer {bad[0]} is a {type(specs[bad[0]]).__name__}: each entry must be an nn.Module "
                             f"or a zero-argument callable returning one")
    return kinds == {False}


def build_layer(spec: LayerSpec, index: int, seed: int) -> nn.Module:
    """Layer ``index`` of a list: the module itself, or the factory's module built under ``layer_seed``."""
    if isinstance(spec, nn.Module):
        return spec
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(seed, index))
        module = spec()
    if not isinstance(module, nn.Module):
        raise LayerSpecError(f"the factory of layer {index} returned {type(module).__name__}, not an nn.Module; "
                             f"a factory takes no argument and returns the layer (e.g. lambda: nn.Linear(8, 8))")
    return module


def build_layers(specs: Sequence[LayerSpec], seed: int = 0) -> list[nn.Module]:
    """Every layer, built as the engine builds each one: the single-process model of a factory list."""
    _is_factories(specs)
    return [build_layer(s, i, seed) for i, s in enumerate(specs)]


def sizing_layers(specs: Sequence[LayerSpec]) -> list[nn.Module]:
    """Modules to measure (parameter counts): the modules themselves, or each factory's on ``meta``."""
    if not _is_factories(specs):
        return list(specs)  # type: ignore[arg-type]
    with torch.device("meta"):
        return [build_layer(s, i, 0) for i, s in enumerate(specs)]


def fingerprint(layer: nn.Module) -> str:
    """What identifies a layer across ranks: its type and its parameters' names, shapes and dtypes."""
    params = ", ".join(f"{n} {tuple(p.shape)}" + ("" if p.dtype == torch.float32 else f" {p.dtype}")
                       for n, p in layer.named_parameters())
    return f"{type(layer).__qualname__}({params})"


def model_mismatch(fingerprints: Sequence[tuple[int, list[str]]]) -> str | None:
    """Compare every rank's ``(seed, layer fingerprints)``; None if all agree, else what differs and where."""
    def ranks(rs: list[int]) -> str:
        return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))

    def split(key: Any) -> str:
        groups: dict[Any, list[int]] = {}
        for r, fp in enumerate(fingerprints):
            groups.setdefault(key(fp), []).append(r)
        return " but ".join(f"{v} on {ranks(rs)}" for v, rs in groups.items())

    hint = "; every rank must be given the same layer list (same code, model, preset and seed)"
    if len({s for s, _ in fingerprints}) > 1:
        return f"the ranks were given different seeds: {split(lambda fp: fp[0])}{hint}"
    if len({len(f) for _, f in fingerprints}) > 1:
        return f"the ranks were given layer lists of different length: {split(lambda fp: len(fp[1]))} layers{hint}"
    for i in range(len(fingerprints[0][1])):
        if len({f[i] for _, f in fingerprints}) > 1:
            return f"the ranks were given different models: layer {i} is {split(lambda fp: fp[1][i])}{hint}"
    return None
