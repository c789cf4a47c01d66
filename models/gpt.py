"""A decoder-only transformer (GPT) as a layer list, LM head tied to the token embedding.

[Note: packed rows]
Under ``--packing pack`` a row holds several documents, and so does ``ragged`` on CPU at long
contexts (a microbatch is one row of its documents end to end, ``ONE_ROW``): the input is
``(tokens, positions, segments)`` (positions restart at each document, segment -1 at padding), the
embedding passes ``(x, segments)`` on and each block attends only within a segment, causal inside
(segments are contiguous runs of a row). On CPU, where reading the segments costs no device sync, the
rows that hold one document go through the causal kernel together, and a row of several attends
document by document (``scaled_dot_product_attention``'s causal kernel on each run: the row costs its
documents' Σ len², not len(row)²) unless the kernel's cost per call would outweigh it (``MASK``,
``CALL``); such rows, and every row on an accelerator (where reading the boundaries would stall the
stream), go through one boolean mask, which sends SDPA to its dense masked kernel. ``pad`` rows, and
other ``ragged`` ones, hold one document each, padding after it, so plain causal attention never sees
the padding. The target is ``(labels, weight)``: labels -100 at padding, and the weight makes the
step's loss the mean over its real tokens (pipeengine/training/packing.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from pipeengine.training.models import Model, pick_preset
from pipeengine.training.packing import IGNORE, Packing

from .documents import Documents
from .presets import PRESETS

__all__ = ["model", "Config", "presets", "layer_factories", "build", "loss_fn", "tied_parameters"]

# CPU, forward and backward: a row of t positions through the boolean mask costs about MASK t² (the dense kernel,
# every pair), run by run Σ len² + CALL a run (the causal kernel; a call's own cost is about that of 290 positions
# attending each other). Fitted on 1,024-position rows: of 64-position documents 105 ms by mask against 128 by
# documents, of 256-position ones 112 against 54. A row takes the cheaper way.
MASK, CALL = 1.2, 85_000
# ragged on CPU: a microbatch as one row of its documents end to end (no padding, a kernel call per document) where
# a full row's positions cost (everything but attention, context x 12 n_embd) ONE_ROW calls' worth at least: with
# documents cut at the context, padding them costs more than those calls then (GPT tiny-1k, small at 1,024: yes;
# tiny at 64, small at 128: no, one a row is faster there: 23.1k against 17.7k tokens/s for the README's main job)
ONE_ROW = 8


@dataclass
class Config:
    vocab_size: int = 256   #: 256 for the byte-level corpus
    block_size: int = 64    #: context length (tokens per example)
    n_layer: int = 4        #: transformer blocks (the layer list has n_layer + 2 entries)
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0    #: on the embedding, the attention weights and each residual branch (nanoGPT's places)
    bias: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, k) < 1:
                raise ValueError(f"gpt {k} must be >= 1 (got {getattr(self, k)})")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"gpt dropout must be in [0, 1) (got {self.dropout})")


def presets() -> dict[str, Callable[[], Config]]:
    return {name: functools.partial(Config, **kw) for name, kw in PRESETS["gpt"].items()}


class Embedding(nn.Module):
    """Token + learned position embedding."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: Any) -> Any:
        if isinstance(idx, (tuple, list)):   # packed rows: [Note: packed rows]
            tokens, pos, segments = idx
            return self.drop(self.wte(tokens) + self.wpe(pos)), segments
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class Block(nn.Module):
    """Pre-norm block: x + attn(ln(x)), then x + mlp(ln(x)); causal attention."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.fc_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: Any) -> Any:
        if isinstance(x, (tuple, list)):   # packed rows: attention within each segment ([Note: packed rows])
            h, segments = x
            return self._block(h, segments), segments
        return self._block(x, None)

    def _block(self, x: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = self._attend(q, k, v, segments)
        x = x + self._drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self._drop(self.fc_proj(F.gelu(self.fc(self.ln2(x)))))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor | None,
                per_document: bool | None = None) -> torch.Tensor:
        """Causal attention, within each segment of a packed row ([Note: packed rows]). Rows of one run (a document
        filling the row) go through the causal kernel together; with ``per_document`` True every other row document
        by document, with None (on CPU) those where that costs less than the mask; the rest through one boolean
        mask."""
        p = self.dropout if self.training else 0.0
        if segments is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        b = segments.shape[0]
        runs, groups = _row_plan(segments, per_document)
        out: dict[int, torch.Tensor] = {}
        for rows, pick, mask in groups:
            y = F.scaled_dot_product_attention(q[pick], k[pick], v[pick], is_causal=mask is None, dropout_p=p,
                                               attn_mask=None if mask is None else mask.unsqueeze(1))
            if len(rows) == b:
                return y
            out.update((r, y[n:n + 1]) for n, r in enumerate(rows))
        t = segments.shape[1]
        for r, c in enumerate(runs):
            if c is not None and len(c) > 1:
                out[r] = torch.cat([F.scaled_dot_product_attention(
                    q[r:r + 1, :, s:e], k[r:r + 1, :, s:e], v[r:r + 1, :, s:e], is_causal=True, dropout_p=p)
                    for s, e in zip(c, c[1:] + [t])], dim=2)
        return torch.cat([out[r] for r in range(b)])

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout, self.training) if self.dropout else x


# the last segments tensor's plan (_row_plan): a stage's blocks all attend within the same segments; held through
# a weak reference, and forgotten with that tensor (its masks are not kept past the step)
_PLAN: list[Any] = [None, None, None]   # [weakref to segments, per_document, plan]


def _forget(ref: Any) -> None:
    if _PLAN[0] is ref:
        _PLAN[:] = [None, None, None]


def _row_plan(segments: torch.Tensor, per_document: bool | None
              ) -> tuple[list[list[int] | None], list[tuple[list[int], Any, torch.Tensor | None]]]:
    """How :meth:`Block._attend` takes the rows of ``segments``: per row where its runs start if it attends run by
    run (else None), and the groups of rows that go through one kernel call: (rows, their index, the boolean mask,
    or None for rows of one run, through the causal kernel). Computed once per segments tensor and kept for the
    next block (the same tensor goes through every block of a stage, [Note: packed rows])."""
    if _PLAN[0] is not None and _PLAN[0]() is segments and _PLAN[1] == per_document:
        return _PLAN[2]  # type: ignore[no-any-return]
    b, t = segments.shape
    runs: list[list[int] | None] = [None] * b   # where a row's runs start, if it attends run by run
    if per_document or (per_document is None and segments.device.type == "cpu"):
        cuts: list[list[int]] = [[0] for _ in range(b)]
        for r, i in (segments[:, 1:] != segments[:, :-1]).nonzero().tolist():
            cuts[r].append(i + 1)
        runs = [c if per_document or len(c) == 1 or _by_run_is_cheaper(c, t) else None for c in cuts]
    groups: list[tuple[list[int], Any, torch.Tensor | None]] = []
    for rows, whole in (([r for r, c in enumerate(runs) if c is None], False),
                        ([r for r, c in enumerate(runs) if c is not None and len(c) == 1], True)):
        if rows:
            pick = torch.tensor(rows) if len(rows) < b else slice(None)
            mask = None if whole else (segments[pick].unsqueeze(-1) == segments[pick].unsqueeze(-2)).tril_()
            groups.append((rows, pick, mask))
    _PLAN[:] = [weakref.ref(segments, _forget), per_document, (runs, groups)]
    return runs, groups


def _by_run_is_cheaper(starts: list[int], t: int) -> bool:
    """A row of ``t`` positions whose runs start at ``starts``: attending run by run costs less than through the
    mask (see MASK and CALL)."""
    return sum((e - s) ** 2 for s, e in zip(starts, starts[1:] + [t])) + CALL * len(starts) <= MASK * t * t


class Head(nn.Module):
    """Final LayerNorm and the LM head (its weight is the token embedding's)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: Any) -> torch.Tensor:
        return self.lm_head(self.ln_f(x[0] if isinstance(x, (tuple, list)) else x))


def _init(module: nn.Module, n_layer: int) -> nn.Module:
    """GPT-2 init: normal(0.02) weights, zero biases, residual projections scaled by 1/sqrt(2 n_layer)."""
    for name, p in module.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() >= 2:
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
            nn.init.normal_(p, mean=0.0, std=std)
    return module


def layer_factories(cfg: Config) -> list[Callable[[], nn.Module]]:
    """[Embedding, Block x n_layer, Head], each built and initialised on its own (see pipeengine.layers).

    The head's weight is tied to the embedding's (``tied_parameters``); the engine makes them one.
    """
    return ([lambda: _init(Embedding(cfg), cfg.n_layer)]
            + [lambda: _init(Block(cfg), cfg.n_layer) for _ in range(cfg.n_layer)]
            + [lambda: _init(Head(cfg), cfg.n_layer)])


def build(cfg: Config, seed: int = 0) -> list[nn.Module]:
    """The single-process model: the factories' layers with head.lm_head.weight IS embedding.wte.weight."""
    from pipeengine.runtime.layers import build_layers
    layers = build_layers(layer_factories(cfg), seed)
    layers[-1].lm_head.weight = layers[0].wte.weight   # type: ignore[union-attr]
    return layers


def loss_fn(output: torch.Tensor, target: Any) -> torch.Tensor:
    """Cross-entropy: the microbatch's mean for a target tensor; for ``(labels, weight)`` the sum over the real
    tokens (labels -100 at padding) times the weight ([Note: packed rows])."""
    if isinstance(target, (tuple, list)):
        labels, weight = target
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), labels.reshape(-1), ignore_index=IGNORE,
                               reduction="sum") * weight
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def tied_parameters(num_layers: int) -> list[list[tuple[int, str]]]:
    """The LM head's weight is the token embedding's (the embedding's value wins at the start)."""
    return [[(0, "wte.weight"), (num_layers - 1, "lm_head.weight")]]


def model(preset: str | None = None, data: str | None = None, dropout: float = 0.0, context: int | None = None,
          packing: str = "ragged") -> Model:
    """The trainer's protocol (``--model gpt``, see pipeengine/training/models.py): preset ``tiny`` by default;
    ``dropout`` (``--dropout``) on the embedding, the attention and each block's residual branches; ``context``
    (``--context``) its context length in tokens; ``packing`` (``--packing``) how documents become rows
    (pipeengine/training/packing.py). The data: documents, the standard library's top-level definitions by default
    (models/documents.py); the vocabulary grows to a token file's largest token."""
    cfg = dataclasses.replace(pick_preset("gpt", presets(), preset, "tiny"), dropout=dropout)
    if context is not None:
        cfg = dataclasses.replace(cfg, block_size=context)
    source = Documents(data, context=cfg.block_size)
    cfg = dataclasses.replace(cfg, vocab_size=max(cfg.vocab_size, source.vocab_size))
    layers, linear = layer_factories(cfg), 12.0 * cfg.n_embd   # a position's cost besides attention
    return Model(layers, loss_fn, source, tied_parameters(len(layers)), preset=preset or "tiny",
                 packing=Packing(packing, cfg.block_size, linear_cost=linear,
                                 one_row=packing == "ragged" and linear * cfg.block_size >= ONE_ROW * CALL))
