"""The engine's state: where loaded optimizer state goes."""

from __future__ import annotations

from typing import Any

import torch

from pipeengine.runtime.state import state_device


class FakeOptimizer:
    def __init__(self, params: list[torch.Tensor], **flags: Any) -> None:
        self.param_groups = [{"params": params, **flags}]


def test_adam_step_counter_is_loaded_where_the_optimizer_keeps_it() -> None:
    """A fused or capturable Adam keeps ``step`` on the parameters' device (a CUDA tensor there); loading it
    to the CPU made its first step fail. No GPU here: the meta device stands in for one."""
    p = torch.empty(3, device="meta")
    plain, fused, capturable = FakeOptimizer([p]), FakeOptimizer([p], fused=True), FakeOptimizer([p], capturable=True)
    assert state_device(plain, p, "step").type == "cpu"                    # torch's default Adam
    assert state_device(fused, p, "step").type == "meta" and state_device(capturable, p, "step").type == "meta"
    assert state_device(plain, p, "exp_avg").type == "meta"                # moments live with the parameter
