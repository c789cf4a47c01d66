"""bf16 weights: what a stage saves for backward with k microbatches in flight, and its step time, three ways.

    python -m benchmarks.bf16_weights                 # 4 Linear(1024, 1024), k = 1, 4, 8 in flight, 8 rows each

One process, one stage of the engine (runtime/stage.py) running k forwards then k backwards (what
GPipe's first stage, or 1F1B's at pp = k, has in flight), then an AdamW step:

* ``per microbatch``: autocast entered per microbatch (the engine before), each forward casts every
  weight again and saves its own bf16 copy;
* ``per step``: one autocast cache region around the step (the engine now, stage.cast_cache_scope):
  one bf16 copy per weight, shared by every microbatch, dropped before the optimizer step;
* ``bf16 weights``: persistent bf16 compute weights with fp32 master weights (the alternative): the
  stage's parameters are bf16 (nothing to cast, grads bf16), the step copies grads to fp32 masters,
  steps them and copies the weights back.

Saved MiB: distinct storages autograd saved for backward during the step (parameters excluded);
kept MiB: what stays allocated between steps beyond the fp32 model, its grads and AdamW state.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any, Callable

import torch
from torch import nn

from pipeengine.runtime.chain import LayerChain
from pipeengine.runtime.stage import Stage, cast_cache_scope

MIB = 2**20


def saved_storages(params: set[int]) -> tuple[dict[int, int], Any]:
    """({storage pointer: bytes} filled as autograd saves tensors for backward, parameters left out; the hook
    context that fills it)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t
    return saved, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def run(variant: str, k: int, rows: int, width: int, steps: int) -> dict[str, float]:
    torch.manual_seed(0)
    layers = [nn.Linear(width, width) for _ in range(4)]
    masters: list[nn.Parameter] = []
    if variant == "bf16 weights":
        masters = [nn.Parameter(p.detach().clone()) for m in layers for p in m.parameters()]
        for m in layers:
            m.to(torch.bfloat16)
    stage = Stage(LayerChain(layers, 1), 1, 3, None, k, precision="fp32" if variant == "bf16 weights" else "bf16")
    opt = torch.optim.AdamW(masters or list(stage.params), lr=1e-3)
    dtype = torch.bfloat16 if variant == "bf16 weights" else torch.float32
    xs = [torch.randn(rows, width, dtype=dtype) for _ in range(k)]
    gys = [torch.randn(rows, width, dtype=torch.bfloat16) for _ in range(k)]
    scope: Callable[[], Any] = (lambda: cast_cache_scope(torch.device("cpu"), "bf16")) if variant == "per step" \
        else contextlib.nullcontext
    times, saved_bytes = [], 0
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        stage.reset()
        saved, hooks = saved_storages({p.untyped_storage().data_ptr() for p in stage.params})
        with scope(), hooks:
            for mb in range(k):
                stage.forward(mb, xs[mb].clone(), None, True)
            for mb in range(k):
                stage.backward(mb, (gys[mb],), split=False)
        if masters:   # grads to the fp32 masters, step them, weights back to bf16
            for master, p in zip(masters, stage.params):
                master.grad = p.grad.float()
                p.grad = None
            opt.step()
            with torch.no_grad():
                for master, p in zip(masters, stage.params):
                    p.copy_(master)
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        saved_bytes = sum(saved.values())
    params = sum(p.numel() for p in stage.params)
    kept = params * 2 if masters else 0   # the persistent bf16 copy beside the fp32 masters
    return {"saved_mib": saved_bytes / MIB, "kept_mib": kept / MIB, "step_ms": 1e3 * statistics.median(times[1:])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--in-flight", type=int, nargs="+", default=[1, 4, 8], help="microbatches in flight")
    p.add_argument("--rows", type=int, default=8, help="rows (tokens) per microbatch")
    p.add_argument("--width", type=int, default=1024, help="Linear(width, width) x 4")
    p.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up)")
    a = p.parse_args()
    torch.set_num_threads(1)
    weights = 4 * a.width * a.width * 4 / MIB
    print(f"4 Linear({a.width}, {a.width}): {weights:.1f} MiB of fp32 weights ({weights / 2:.1f} MiB in bf16); "
          f"{a.rows} rows per microbatch; one thread; median of {a.steps} steps")
    print("\n| in flight | variant | saved for backward (MiB) | kept between steps (MiB) | step (ms) |")
    print("|---|---|---|---|---|")
    for k in a.in_flight:
        for variant in ("per microbatch", "per step", "bf16 weights"):
            r = run(variant, k, a.rows, a.width, a.steps)
            print(f"| {k} | {variant} | {r['saved_mib']:.1f} | {r['kept_mib']:.1f} | {r['step_ms']:.1f} |")


if __name__ == "__main__":
    main()
