"""Activation recompute: what a ``torch.utils.checkpoint`` region runs under, in F and when it is recomputed.

[Note: recompute]
``recompute="full"`` runs the stage's layers as one ``torch.utils.checkpoint`` region
(non-reentrant; each layer's random stream is keyed, rng.py, so the recomputation draws F's masks
without a stashed RNG state), so a microbatch keeps only its stage input until its
backward recomputes the rest; ``"every:K"`` makes one region of every K consecutive layers;
``"selective"`` makes each layer a region that keeps the outputs of its matrix products and attention
(torch's selective activation checkpoint, :data:`KEPT_OPS`) and recomputes only the cheap rest (norms,
activations, elementwise): a GPT block (width 768, 128 positions) kept 16.5 of its 51 MiB for 4% more
time, where ``full`` kept 1.5 MiB for 22% more; at width 256 (GPT small) 11.3 of 16.4 MiB for 12-22% more (the
norms and GELU weigh more beside narrower products). torch allows one backward through such a region, so under
a schedule that splits B and W a selective stage runs its whole backward in B (its W does nothing). A
recomputation leaves the region's buffers (BatchNorm's running statistics) as it found them: they moved
once, in F, as without recompute.
(Recompute is what torch calls activation checkpointing; in pipeengine a checkpoint is a saved
training state.)
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["KEPT_OPS", "Contexts", "context_fn", "mutated"]


class _BuffersKept:
    """While a region is recomputed, its persistent buffers (BatchNorm's running statistics) change nothing:
    they are put back as they were when the recomputation began (it ran once already, in F)."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers
        self.saved: list[torch.Tensor] = []

    def __enter__(self) -> None:
        self.saved = [b.clone() for b in self.buffers]

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for b, value in zip(self.buffers, self.saved):
                b.copy_(value)
        self.saved = []


_aten = torch.ops.aten
# what "selective" keeps of a layer: the outputs of its matrix products, convolutions and attention (the rest is
# recomputed in backward: cheap per byte kept)
KEPT_OPS = frozenset(getattr(_aten, name).default for name in (
    "mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention") if hasattr(_aten, name))


def _keep_products(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


@contextlib.contextmanager
def _both(outer: contextlib.AbstractContextManager[Any],
          inner: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
    with outer, inner:
        yield


Contexts = Callable[[], tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]]


def context_fn(region: nn.Module, selective: bool) -> Contexts:
    """torch.utils.checkpoint's ``context_fn`` for ``region``, worked out once (it runs per region and microbatch):
    around the forward nothing, or torch's selective checkpoint keeping :data:`KEPT_OPS`; around a recompute the
    region's persistent buffers kept (saved and put back outside torch's selective mode)."""
    ids = {id(b) for b in region.buffers()}   # the persistent ones: state, not masks or caches
    buffers = [t for t in region.state_dict(keep_vars=True).values() if id(t) in ids]

    def contexts() -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
        if not selective:
            return contextlib.nullcontext(), _BuffersKept(buffers)
        forward, again = create_selective_checkpoint_contexts(_keep_products)   # type: ignore[no-untyped-call]
        return forward, _both(_BuffersKept(buffers), again)
    return contexts


def mutated(exc: RuntimeError, stage: int) -> Exception:
    """The error to raise for ``exc`` from a "selective" stage's backward: torch's refusal of a kept output changed in
    place, said in the user's terms (anything else as it was)."""
    if "has been mutated" not in str(exc):
        return exc
    return ValueError(f"stage {stage}: recompute 'selective' keeps the outputs of matrix products, convolutions and "
                      f"attention, and a layer changed one in place (an in-place activation such as "
                      f"ReLU(inplace=True), or += on it); make that operation out of place, or use recompute 'full' "
                      f"or 'every:K'")
