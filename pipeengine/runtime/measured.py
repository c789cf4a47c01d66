"""What the profile measured of each layer, and what the split search chose from it (torch-free data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..schedule import Costs, Schedule

__all__ = ["LayerCost", "Choice", "position_sizes", "with_transfers", "sized", "segmented"]


def segmented(first: bool, layers: int, recompute: bool, shared: bool, covered: bool) -> bool:
    """Whether a split-backward stage runs B and W a layer at a time ([Note: segments] in stage.py): it has several
    layers, no recompute and no parameter in two of them, and is the first stage or has a layer whose W needs
    autograd (``covered``: every layer's W needs no autograd call, direct.covers)."""
    return layers > 1 and not recompute and not shared and (first or not covered)


@dataclass
class LayerCost:
    """One layer on one microbatch, as the engine runs it: seconds of F, of B and W (split backward, see
    stage.py) and of the fused backward, the bytes it keeps for backward (its output included) and the
    bytes of its parameters."""

    f: float
    b: float
    w: float
    fused: float
    activation_bytes: int
    param_bytes: int
    noise: float = 0.0   # the spread of its timed runs: interquartile range / median of F + B + W
    kind: str = ""       # layers of one kind (same modules, parameters and input shapes) cost the same
    output_bytes: int = 0   # its output per microbatch: what crosses a link when a stage ends with it
    # the engine's own cost around any layer, measured beside it on a layer that computes nothing (seconds of F, B,
    # W and the fused backward): a stage of k layers pays it once, not k times (the twin, twin.py)
    host: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    held_for_w: int = 0   # bytes a split backward's B keeps until W (gradients for the weights), when timed split
    freed_at_b: int = 0   # bytes of what it keeps that a split B frees (W does not read them; backward.py)
    grad_bytes: int | None = None   # bytes of its trainable parameters (their gradients); None: all of them
    direct_w: bool = False   # its W needs no autograd call (direct.covers): a stage of such layers runs in one part
    # under recompute "selective" (measured when asked): bytes a microbatch keeps (its input and its matrix products'
    # outputs; None: not measured) and the seconds the recompute adds to its backward
    selective_bytes: int | None = None
    selective_s: float = 0.0
    # on the last layer, when asked (a memory budget): how the loss adds up over k equal pieces of a microbatch,
    # (k, "mean" or "sum") for each k it is one of (microbatches.loss_pieces)
    loss_pieces: tuple[tuple[int, str], ...] = ()

    @property
    def trainable_bytes(self) -> int:
        return self.param_bytes if self.grad_bytes is None else self.grad_bytes

    @property
    def total(self) -> float:
        return self.f + self.b + self.w

    def phases(self, split: bool) -> tuple[float, float, float]:
        """(f, b, w) as the simulator takes them: without a split, B runs b + w = the fused backward."""
        return (self.f, self.b, self.w) if split else (self.f, max(0.0, self.fused - self.w), self.w)

    def host_phases(self, split: bool) -> tuple[float, float, float]:
        """:meth:`phases` of the engine's own cost around the layer (``host``)."""
        f, b, w, fused = self.host
        return (f, b, w) if split else (f, max(0.0, fused - w), w)

    def own_phases(self, split: bool) -> tuple[float, float, float]:
        """:meth:`phases` less :meth:`host_phases`, never below 0 (on a busy machine a nearly empty layer can time
        shorter than the engine's cost beside it); without a split, B + W is the fused backward less the engine's."""
        hf, hb, hw, hfused = self.host
        if split:
            return max(0.0, self.f - hf), max(0.0, self.b - hb), max(0.0, self.w - hw)
        whole = max(0.0, self.fused - hfused)
        w = min(max(0.0, self.w - hw), whole)
        return max(0.0, self.f - hf), whole - w, w


@dataclass
class Choice:
    """What the profile partition chose: bounds, the per-stage costs (seconds per microbatch) and the
    simulated step (seconds, compute only) and peak memory estimate per position (bytes)."""

    bounds: list[int]
    stage_costs: list[tuple[float, float, float]]
    makespan: float
    memory: list[float]
    candidates: int
    split: bool = False   # the schedule splits backward into B and W
    kept_equal: str = ""  # why the equal split was kept over a faster-looking one (its gain was noise)
    comm: list[float] = field(default_factory=list)   # [s]: seconds of a transfer between stage s and s + 1

    def costs(self) -> list[Costs]:
        """Per stage, its F, B, W and the transfer to the next stage: what the step was simulated with."""
        return with_transfers(self.stage_costs, self.comm)

    def mean_costs(self) -> Costs:
        """One stage's average F, B, W and transfer (over the hops between positions, not the V's turn, which costs
        nothing): what the schedule is lowered with."""
        n = len(self.stage_costs)
        hops = [c for c in self.comm if c > 0]
        comm = sum(hops) / len(hops) if hops else 0.0
        f, b, w = (sum(c[k] for c in self.stage_costs) / n for k in range(3))
        return Costs(f, b, w, comm)

    def describe(self, schedule_name: str) -> str:
        with_links = " (compute and transfers)" if any(self.comm) else ""
        lines = [f"partition profile: bounds {self.bounds} ({self.candidates} splits scored), "
                 f"predicted step{with_links} {1e3 * self.makespan:.1f} ms with {schedule_name}"]
        if self.kept_equal:
            lines.append(f"  {self.kept_equal}")
        for s, (f, b, w) in enumerate(self.stage_costs):
            back = f"B {1e3 * b:.2f} ms  W {1e3 * w:.2f} ms" if self.split else f"backward {1e3 * (b + w):.2f} ms"
            hop = (f"  transfer to stage {s + 1} {1e3 * self.comm[s]:.3f} ms"
                   if s < len(self.comm) and self.comm[s] > 0 else "")
            lines.append(f"  stage {s}: layers {self.bounds[s]}..{self.bounds[s + 1] - 1}  per microbatch "
                         f"F {1e3 * f:.2f} ms  {back}{hop}")
        lines.append("  model memory estimate per position (4 x parameters + activations in flight; not the "
                     "process's baseline): " + ", ".join(f"{m / 2**30:.2f} GiB" for m in self.memory))
        return "\n".join(lines)


def sized(sizes: Sequence[float] | None, microbatches: int) -> list[float] | None:
    """``sizes`` as the simulator takes them: one per microbatch, else None (microbatches of the measured size)."""
    return list(sizes) if sizes is not None and len(sizes) == microbatches else None


def position_sizes(costs: Sequence[LayerCost], bounds: Sequence[int], schedule: Schedule) -> list[tuple[float, float]]:
    """Per position of ``schedule``: (its parameter bytes, the activation bytes of its largest stage) for a split.

    The memory estimate everywhere is state_factor x the first + peak chunk activations in flight x the second."""
    params = [0.0] * schedule.pp
    act = [0.0] * schedule.pp
    for s in range(schedule.num_stages):
        p = schedule.placement(s)[0]
        layers = costs[bounds[s]:bounds[s + 1]]
        params[p] += sum(c.param_bytes for c in layers)
        act[p] = max(act[p], float(sum(c.activation_bytes for c in layers)))
    return list(zip(params, act))


def with_transfers(stage_costs: Sequence[tuple[float, float, float]], comm: Sequence[float]) -> list[Costs]:
    """Per stage its (F, B, W) and ``comm[s]``, the transfer to the next stage (none after the last, none at all
    when ``comm`` is empty)."""
    return [Costs(f, b, w, comm[s] if s < len(comm) else 0.0) for s, (f, b, w) in enumerate(stage_costs)]
