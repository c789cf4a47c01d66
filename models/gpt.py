"""A decoder-only transformer (GPT) as a layer list, LM head tied to the token embedding."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from pipeengine.training.models import Model, pick_preset

from .data import ByteCorpus
from .presets import PRESETS

__all__ = ["model", "Config", "presets", "layer_factories", "build", "loss_fn", "tied_parameters", "make_source"]


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

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self._drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self._drop(self.fc_proj(F.gelu(self.fc(self.ln2(x)))))

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout, self.training) if self.dropout else x


class Head(nn.Module):
    """Final LayerNorm and the LM head (its weight is the token embedding's)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


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


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def tied_parameters(num_layers: int) -> list[list[tuple[int, str]]]:
    """The LM head's weight is the token embedding's (the embedding's value wins at the start)."""
    return [[(0, "wte.weight"), (num_layers - 1, "lm_head.weight")]]


def make_source(cfg: Config, data_path: str | None) -> ByteCorpus:
    if cfg.vocab_size < 256:
        raise ValueError(f"the byte corpus needs vocab_size >= 256 (got {cfg.vocab_size})")
    return ByteCorpus(data_path, block_size=cfg.block_size)


def model(preset: str | None = None, data: str | None = None, dropout: float = 0.0) -> Model:
    """The trainer's protocol (``--model gpt``, see pipeengine/training/models.py): preset ``tiny`` by default;
    ``dropout`` (``--dropout``) on the embedding, the attention and each block's residual branches."""
    cfg = dataclasses.replace(pick_preset("gpt", presets(), preset, "tiny"), dropout=dropout)
    layers = layer_factories(cfg)
    return Model(layers, loss_fn, make_source(cfg, data), tied_parameters(len(layers)),
                 tokens_per_example=cfg.block_size, preset=preset or "tiny")
