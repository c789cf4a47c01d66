"""The engine's training state as one flat dict keyed by global names: what a checkpoint saves and loads.

Keys never name a rank or a stage, so a state saved under one pp, dp, chunks or partition loads
under any other:

    layers.<global layer index>.<name>           parameters and buffers (``layers.7.qkv.weight``)
    optim.layers.<i>.<name>.<state>              optimizer state of that parameter (``...exp_avg``)
    train.step, train.loss_scale, .good_steps    where training stands (data and LR follow the step)
    rng.rank<r>.cpu / .cuda                      this rank's RNG state (restored when the world matches)

A tied parameter's copies share one optimizer state, saved under its first key on the saving rank;
loading finds it under any key of its tie.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch

if TYPE_CHECKING:
    from .engine import PipelineEngine

__all__ = ["EngineState", "TensorInfo", "state_device"]

TensorInfo = tuple[tuple[int, ...], torch.dtype]   # what a saved tensor is: (shape, dtype)


def state_device(optimizer: torch.optim.Optimizer, p: torch.Tensor, name: str) -> torch.device:
    """Where ``optimizer`` keeps state ``name`` of parameter ``p``: with the parameter, except Adam's ``step``
    counter, which lives on the CPU unless the group is fused or capturable (then on the device)."""
    group = next((g for g in optimizer.param_groups if any(q is p for q in g["params"])), {})
    if name == "step" and not (group.get("fused") or group.get("capturable")):
        return torch.device("cpu")
    return p.device


class EngineState:
    """Reads and writes the flat state of ``engine`` (see the module docstring)."""

    def __init__(self, engine: PipelineEngine) -> None:
        self.engine = engine
        self._optim_keys: dict[int, dict[str, str]] = {}   # param id -> state name -> key, set by template()

    def model_entries(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers by global key (detached views: loading writes into them)."""
        out: dict[str, torch.Tensor] = {}
        for stage in self.engine.stages:
            start = self.engine.plan.bounds[stage.index]
            for j, layer in enumerate(stage.module.layers):
                for name, t in layer.state_dict(keep_vars=True).items():
                    out[f"layers.{start + j}.{name}"] = t.detach()
        return out

    def param_keys(self) -> dict[int, str]:
        """Parameter id -> its first global key (a tied parameter's copies share one optimizer state)."""
        keys: dict[int, str] = {}
        for stage in self.engine.stages:
            start = self.engine.plan.bounds[stage.index]
            for j, layer in enumerate(stage.module.layers):
                for name, p in layer.named_parameters(remove_duplicate=False):
                    keys.setdefault(id(p), f"layers.{start + j}.{name}")
        return keys

    def state_dict(self) -> dict[str, Any]:
        e = self.engine
        e.parameters_ready()
        sd: dict[str, Any] = dict(self.model_entries())
        keys = self.param_keys()
        if e.zero is not None:   # this replica's parts, as DCP shards with global offsets (zero.py)
            sd.update(e.zero.state_entries(keys))
        for p in e.parameters if e.zero is None else ():
            for name, value in e.optimizer.state.get(p, {}).items():
                sd[f"optim.{keys[id(p)]}.{name}"] = value
        sd["train.step"] = torch.tensor(e.step_count)
        sd["train.loss_scale"] = torch.tensor(e.loss_scale.value, dtype=torch.float64)
        sd["train.good_steps"] = torch.tensor(e.loss_scale.good_steps)
        sd[f"rng.rank{e.rank}.cpu"] = torch.get_rng_state()
        if e.device.type == "cuda":
            sd[f"rng.rank{e.rank}.cuda"] = torch.cuda.get_rng_state(e.device)
        return sd

    def template(self, saved: Mapping[str, TensorInfo | None], restore_rng: bool) -> dict[str, Any]:
        """What this rank loads from a state whose keys are ``saved`` (key -> shape and dtype, None for a
        non-tensor): its model entries, the optimizer state saved for its parameters (found under any key
        of a tie), the training counters and, with ``restore_rng``, its RNG state. Fill it, then
        :meth:`load_state_dict` it."""
        e = self.engine
        e.parameters_ready()
        sd: dict[str, Any] = dict(self.model_entries())
        by_param: dict[str, dict[str, str]] = {}   # parameter key -> state name -> saved key
        for key in saved:
            if key.startswith("optim."):
                param_key, _, name = key[len("optim."):].rpartition(".")
                by_param.setdefault(param_key, {})[name] = key
        aliases = e.ties.aliases()
        keys = self.param_keys()
        self._optim_keys = {}
        for p in e.parameters:
            found = next((by_param[k] for k in [keys[id(p)], *aliases.get(keys[id(p)], [])] if k in by_param), {})
            self._optim_keys[id(p)] = found
            for name, key in found.items() if e.zero is None else ():
                info = saved[key]
                sd[key] = None if info is None else torch.empty(
                    info[0], dtype=info[1], device=state_device(e.optimizer, p, name))
        if e.zero is not None:
            sd.update(e.zero.template_entries(self._optim_keys, saved,
                                              lambda p, name: state_device(e.optimizer, p, name)))
        sd["train.step"] = torch.tensor(0)
        sd["train.loss_scale"] = torch.tensor(1.0, dtype=torch.float64)
        if "train.good_steps" in saved:
            sd["train.good_steps"] = torch.tensor(0)
        if restore_rng:
            for key in [k for k in saved if k.startswith(f"rng.rank{e.rank}.")]:
                sd[key] = torch.empty(saved[key][0], dtype=torch.uint8)   # type: ignore[index]
        return sd

    def load_state_dict(self, sd: Mapping[str, Any], fp16_scale: bool) -> None:
        """Take a filled :meth:`template` (model entries were loaded in place). ``fp16_scale``: the state
        was saved with fp16's loss scale, which then continues (else it starts afresh)."""
        e = self.engine
        if e.zero is not None:
            e.zero.load_entries(self._optim_keys, sd)
        for p in e.parameters if e.zero is None else ():
            if self._optim_keys.get(id(p)):
                e.optimizer.state[p] = {name: sd[key] for name, key in self._optim_keys[id(p)].items()}
        if e.loss_scale.enabled and fp16_scale:
            e.loss_scale.value = float(sd["train.loss_scale"])
            e.loss_scale.good_steps = int(sd.get("train.good_steps", 0))
        for key in [k for k in sd if k.startswith(f"rng.rank{e.rank}.")]:
            if key.endswith(".cpu"):
                torch.set_rng_state(sd[key])
            elif e.device.type == "cuda":
                torch.cuda.set_rng_state(sd[key], e.device)
        e.step_count = int(sd["train.step"])
