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
