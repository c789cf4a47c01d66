"""Helpers over what a layer passes on: a Tensor, or a (nested) tuple or list of Tensors."""

from __future__ import annotations

import zlib

from typing import Any, Callable, Iterator

import torch

__all__ = ["flat", "floating", "tree_map", "detach", "to_device", "to_float", "device_of", "describe_value", "crc32"]

Tensors = tuple[torch.Tensor, ...]


def flat(x: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``x``, depth first."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for t in x:
            yield from flat(t)


def floating(x: Any) -> Iterator[torch.Tensor]:
    """The floating-point tensors in ``x`` (the ones that carry gradients)."""
    return (t for t in flat(x) if t.is_floating_point())


def tree_map(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``x`` with ``fn`` applied to every tensor (tuples stay tuples, lists lists)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return type(x)(tree_map(t, fn) for t in x)
    return x


def to_device(x: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """A tensor, or the tensors of a (nested) tuple or list, on ``device``."""
    return tree_map(x, lambda t: t.to(device, non_blocking=non_blocking))


def detach(x: Any) -> Any:
    return tree_map(x, lambda t: t.detach())


def to_float(x: Any) -> Any:
    """Half-precision tensors as float32 (the loss is computed in fp32)."""
    return tree_map(x, lambda t: t.float() if t.dtype in (torch.bfloat16, torch.float16) else t)


def device_of(x: Any, params: Tensors) -> torch.device:
    """Where ``x`` lives (its first tensor), else where the parameters live, else the CPU."""
    for t in flat(x):
        return t.device
    return params[0].device if params else torch.device("cpu")


def describe_value(x: Any) -> str:
    """Shapes and dtypes of the tensors in ``x``, e.g. ``(4, 16) float32``."""
    parts = [f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in flat(x)]
    return "[" + ", ".join(parts) + "]" if len(parts) != 1 else parts[0]


def crc32(t: torch.Tensor, crc: int = 0) -> int:
    """CRC-32 of a tensor's dtype, shape and bytes (on the host: a device tensor is copied there). The bytes go
    to zlib as one buffer (numpy comes with torchvision and tensorboard), at memory speed."""
    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return zlib.crc32(flat.numpy().data, zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode(), crc))
