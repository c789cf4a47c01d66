"""Example models as layer lists the engine can split: gpt (tied embedding), resnet, mlp."""

__all__ = ["gpt", "resnet", "mlp", "data"]
