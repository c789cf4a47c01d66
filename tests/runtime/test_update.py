"""The end of a step's helpers (pipeengine/runtime/update.py) that need no process group."""

from __future__ import annotations

import torch

from pipeengine.runtime.update import zero_grads


def test_zero_grads_clears_the_optimizers_gradients_and_calls_an_optimizers_own_zero_grad() -> None:
    """torch's zero_grad done as its loop: every gradient of every group None, a tensor outside the optimizer kept (as
    torch's leaves it); an optimizer with a zero_grad of its own (one that keeps master copies, say) gets it called."""
    a, b, outside = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    opt = torch.optim.AdamW([{"params": [a]}, {"params": [b], "weight_decay": 0.0}], lr=0.1)
    for p in (a, b, outside):
        p.grad = torch.ones(2)
    zero_grads(opt)
    assert a.grad is None and b.grad is None and outside.grad is not None

    class Master(torch.optim.SGD):
        calls: list[bool] = []

        def zero_grad(self, set_to_none: bool = True) -> None:
            self.calls.append(set_to_none)
            super().zero_grad(set_to_none)

    own = Master([a], lr=0.1)
    a.grad = torch.ones(2)
    zero_grads(own)
    assert Master.calls == [True] and a.grad is None
    patched = torch.optim.SGD([a], lr=0.1)   # an instance's own zero_grad, set on it
    patched.zero_grad = lambda set_to_none=True: Master.calls.append(set_to_none)  # type: ignore[method-assign]
    zero_grads(patched)
    assert Master.calls == [True, True]
