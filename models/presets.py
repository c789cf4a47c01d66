"""The example models' named sizes (torch-free: the trainer's --help lists them without importing torch)."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "gpt": {"tiny": dict(block_size=64, n_layer=6, n_head=4, n_embd=64),
            "tiny-1k": dict(block_size=1024, n_layer=6, n_head=4, n_embd=64),
            "small": dict(block_size=128, n_layer=8, n_head=8, n_embd=256),
            "gpt2-124m": dict(vocab_size=256, block_size=1024, n_layer=12, n_head=12, n_embd=768)},
    "mlp": {"tiny": dict(hidden=64, depth=8), "small": dict(hidden=256, depth=14),
            "large": dict(hidden=2048, depth=30)},
    "resnet": {"tiny": {}, "resnet18": {}, "resnet18-gn": dict(norm="group"),
               "resnet50": dict(arch="resnet50", image_size=64),
               "resnet50-imagenet": dict(arch="resnet50", num_classes=1000, image_size=224)},
}

# Llama-like sizes of the GPT (GPT-2-shaped: MLP 4x, learned positions, LayerNorm, full multi-head attention, so the
# parameter count is near, not equal to, the Llama model of the name), for the dry run only: ``python -m
# pipeengine.plan`` builds them on the meta device; the trainer does not offer them.
PLAN_SIZES: dict[str, dict[str, int]] = {
    "1b": dict(n_layer=24, n_embd=2048, n_head=16, block_size=2048, vocab_size=32000),
    "7b": dict(n_layer=32, n_embd=4096, n_head=32, block_size=4096, vocab_size=32000),
    "13b": dict(n_layer=40, n_embd=5120, n_head=40, block_size=4096, vocab_size=32000),
    "30b": dict(n_layer=60, n_embd=6656, n_head=52, block_size=4096, vocab_size=32000),
    "70b": dict(n_layer=80, n_embd=8192, n_head=64, block_size=4096, vocab_size=32000),
}
