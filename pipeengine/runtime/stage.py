"""One stage on its rank: F, B and W for a microbatch, recompute, precision, freeing buffers early.

[Note: stage boundary detach]
A stage's input arrives as fresh tensors (from a receive, or detached from the previous stage
on the same rank). In training its floating-point tensors become the outputs of one autograd node
(``_Arrival``) hanging from a tiny leaf of the stage's: no copy, and, unlike leaves that require
grad, tensors that an in-place first op may change, as it may unpipelined. Backward of the stage
therefore stops at that node, whose backward hands over exactly the gradients the previous stage
needs. The graph never spans two stages.

[Note: stage boundary dtype]
Under bf16/fp16 autocast a stage's output goes on the wire in the dtype its last layer produced:
a residual stream that autocast keeps in fp32 stays fp32, a bf16 activation stays bf16. Casting
every boundary to the low precision (as this engine once did) made the numerics depend on where
the model was split, so two runs that profiled different bounds could train differently.

[Note: one weight cast per step]
Autocast caches the low-precision copy of a leaf that requires grad (a weight) for as long as the
outermost autocast region stays open. Opened per microbatch, each microbatch's forward casts every
weight anew and saves its own copy for backward, so a stage with k microbatches in flight held k
copies (16 B/param at pp 8). The engine therefore keeps one (disabled) autocast region open around
a step's whole program (:func:`cast_cache_scope`): every microbatch's forward, recompute and
backward share one copy per weight, dropped when the region closes, before the optimizer step.
The values are those of a cast per microbatch, bit for bit.

[Note: free at the earliest point]
Per microbatch a stage keeps only what backward needs, and only as long as it needs it:

    what                         kept until        why
    input leaves (received)      B                 B computes their gradients
    output roots                 B (W if split)    autograd needs the node, not the data:
                                                   their storage is swapped for an empty one
                                                   right after F (the wire still holds the
                                                   sent alias until the send completed)
    received output gradients    B (W if split)    W re-runs the backward from them

Backward then runs from roots whose data is gone, so it calls autograd's engine directly
(``torch.autograd.backward`` would compare the gradient's shape with the emptied root), as
Megatron's ``deallocate_output_tensor`` does. An output that is a view, or that is one of the
stage's inputs, keeps its data (freeing it would free someone else's).

[Note: segments]
Under a schedule that splits the backward (zero bubble) a stage of several layers runs them as parts of one
layer each: between two layers the output goes on hanging from an ``_Arrival`` node of its own (the same
storage, no copy), so each layer's autograd graph ends there. B then runs a layer at a time from the last
(its input gradients are the next part's root gradients: the values a whole-stage backward passes, bit for
bit), and W's one autograd call per weight group walks one layer's graph, not everything below it: on 12
tiny GPT blocks W took 5.9 ms as one graph, 2.2 ms in parts (``benchmarks/split_backward.py``). The first
stage gains too: only its first layer's inputs need no gradient, so only that layer's W runs from its roots.
Not with recompute (its regions are the parts), nor when two layers share a parameter (W would then add its
gradients in another order than the fused backward), nor where W needs no autograd call (a stage past the
first of torch's layers only: [Note: W without the engine] in direct.py).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint as _checkpoint

from .arrival import Arrived
from .backward import (Recipe, WeightGroup, accumulators, backward_keeping, backward_weights, run_backward, shape_of,
                       walk, weight_groups)
from .chain import LayerChain, LayerError
from .direct import covers
from .measured import segmented as segments_apart
from .options import PRECISIONS, SELECTIVE, check_choice, parse_recompute
from .recompute import Contexts, context_fn, mutated
from .tensors import detach, device_of, floating, to_float

__all__ = ["Stage", "DTYPES", "cast_cache_scope"]

Tensors = tuple[torch.Tensor, ...]
DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
assert tuple(DTYPES) == PRECISIONS


def cast_cache_scope(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    """The region in which a step's weight casts are shared (see [Note: one weight cast per step])."""
    if DTYPES[precision] is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


def _deallocate(t: torch.Tensor, inputs: Tensors) -> None:
    """Swap a root's storage for an empty one (see [Note: free at the earliest point])."""
    if t.grad_fn is not None and t._base is None and not any(t is x for x in inputs):
        t.data = torch.empty((0,), dtype=t.dtype, device=t.device)


@dataclass
class _Saved:
    """One microbatch through one part of the stage: all its layers, or one layer ([Note: segments])."""

    inputs: Tensors                  # the first part's: the stage's received floating inputs (_Arrival outputs)
    roots: Tensors                   # where backward starts (the loss, undivided, on the last stage)
    grads: Tensors = field(default=())   # gradients of the roots (kept for W when it runs from the roots)
    groups: list[WeightGroup] = field(default_factory=list)   # split backward: what W runs from
    rest: Tensors = ()               # split backward: parameters W reaches from the roots
    arrived: Arrived | None = None  # the received inputs and, after B, their gradients

    @property
    def hangs(self) -> bool:
        """Its inputs hang from the stage's anchor (B computes their gradients; until B ran)."""
        return self.arrived is not None and self.arrived.count > 0


class Stage:
    """Stage ``index`` of ``num_stages``: runs F, B and W of its layers for one microbatch at a time."""

    def __init__(self, module: LayerChain, index: int, num_stages: int, loss_fn: Callable[[Any, Any], torch.Tensor],
                 microbatches: int, recompute: str = "none", precision: str = "fp32", segmented: bool = False) -> None:
        check_choice("precision", precision, PRECISIONS)
        self.module = module
        self.index = index
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self.loss_fn = loss_fn
        self.microbatches = microbatches        # of the whole step, over every replica: each loss divides by it
        self.dtype = DTYPES[precision]          # autocast dtype; None: fp32 throughout
        self.loss_scale = 1.0                   # fp16: the engine's dynamic loss scale
        per = parse_recompute(recompute)
        layers = list(module.layers)
        self.regions: list[LayerChain] | None = None
        self._contexts: list[Contexts] = []   # each region's checkpoint context_fn (recompute.py)
        self.selective = per == SELECTIVE
        if per is not None:
            size = 1 if self.selective else per or len(layers)
            self.regions = [LayerChain(layers[i:i + size], module.first + i) for i in range(0, len(layers), size)]
            self._contexts = [context_fn(r, self.selective) for r in self.regions]
        self.saved: dict[int, list[_Saved]] = {}   # per microbatch, its parts, first layer first
        self.peak_stored = 0
        self.losses: list[torch.Tensor] = []   # each microbatch's, not yet divided (loss_terms)
        self._seed: tuple[Any, torch.Tensor] | None = None   # the loss's gradient, made once (_root_grads)
        self.outputs: dict[int, Any] = {}     # last stage, eval with return_outputs
        # what the next training step gives the modules back: None before the first (it sets train mode), [] while
        # training, each module's own mode during eval steps (reset)
        self._back: list[tuple[torch.nn.Module, bool]] | None = None
        self.params = tuple(p for p in module.parameters() if p.requires_grad)
        self._anchor = torch.empty(0, requires_grad=True)   # what the stage's inputs hang from (_Arrival)
        # per part: its parameters and, once split, their AccumulateGrad nodes. See [Note: segments]
        per_layer = [tuple(p for p in layer.parameters() if p.requires_grad) for layer in layers]
        shared = len({id(p) for ps in per_layer for p in ps}) < sum(map(len, per_layer))
        self.segmented = segmented and segments_apart(self.is_first, len(layers), per is not None, shared,
                                                      covers(module))
        self._part_params = per_layer if self.segmented else [self.params]
        self._recipes: list[dict[tuple[Any, ...], Recipe]] = [{} for _ in self._part_params]
        self._marks: list[dict[Any, int] | None] = [None] * len(self._part_params)   # AccumulateGrad node -> param
        # while ``checking`` (a step replayed to find where it went non-finite: [Note: non-finite] in update.py), the
        # step's sums of (outputs, input gradients), one per tensor (the last stage's first flag comes from its
        # losses, see step_sums): non-finite when one held a NaN or an inf (or its values added up beyond float32's
        # range, see _count_nonfinite)
        self.checking = False
        self.sums: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])

    def reset(self, train: bool = True) -> None:
        """Forget the last step's microbatches. The layers go to train mode on the first training step (a module's
        own ``train()`` runs, e.g. one that keeps a BatchNorm frozen) and to eval mode for an eval step; after it
        each module gets back the mode it had (a layer the user put in eval mode stays there). Nothing is set
        between two training steps: the walk over every module cost 0.13 ms a step on GPT small, 0.3 ms on
        ResNet-50."""
        if train:
            if self._back is None:
                self.module.train(True)
            for m, mode in self._back or ():
                m.training = mode
            self._back = []
        elif self._back == []:   # from training: each module's mode kept for the next training step
            self._back = [(m, m.training) for m in self.module.modules()]
            self.module.eval()
        elif self._back is None:   # before the first training step (which sets train mode)
            self.module.eval()
        for sums in self.sums:
            sums.clear()
        self.saved.clear()
        self.losses.clear()
        self.outputs.clear()
        self.peak_stored = 0

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.dtype)

    def _layers(self, x: Any, key: int | None, cuts: list[tuple[Tensors, Arrived, Tensors]] | None = None) -> Any:
        if self.regions is None:
            return self.module(x, key, None if cuts is None else functools.partial(self._cut, cuts))
        # the key is an argument: the recomputation reseeds as F did (rng.py)
        for region, contexts in zip(self.regions, self._contexts):
            x = _checkpoint(region, x, key, use_reentrant=False, preserve_rng_state=key is None, context_fn=contexts,
                            respect_saved_tensors_hooks=True if self.selective else None)
        return x

    def _cut(self, cuts: list[tuple[Tensors, Arrived, Tensors]], y: Any) -> Any:
        """Between two layers of a segmented stage: ``y`` goes on hanging from an _Arrival node of its own."""
        roots = tuple(floating(y))
        arrived = Arrived(roots)
        x, inputs = arrived.through(detach(y), self._anchor)
        cuts.append((roots, arrived, inputs))
        return x

    def _run_layers(self, x: Any, key: int | None, cuts: list[tuple[Tensors, Arrived, Tensors]] | None = None) -> Any:
        try:
            return self._layers(x, key, cuts)
        except LayerError as exc:
            came = (f" (that input is the output of stage {self.index - 1}, whose last layer is layer "
                    f"{exc.layer - 1})" if not self.is_first and exc.layer == self.module.first else "")
            raise LayerError(f"stage {self.index}: {exc}{came}", exc.layer) from exc.__cause__

    def forward(self, mb: int, x: Any, target: Any, train: bool, keep_output: bool = False,
                key: int | None = None) -> Any:
        """Run F on one argument ``x``; return what to pass on (None on the last stage, which keeps its loss).
        ``key``: the microbatch's random streams (rng.py; None: the generator as it is)."""
        inputs: Tensors = ()
        arrived: Arrived | None = None
        if not self.is_first and train:   # See [Note: stage boundary detach]
            arrived = Arrived(tuple(floating(x)))
            if arrived.count:
                x, inputs = arrived.through(x, self._anchor)
        cuts: list[tuple[Tensors, Arrived, Tensors]] | None = [] if train and self.segmented else None
        with torch.set_grad_enabled(train):
            with self._autocast(device_of(x, self.params)):
                out = self._run_layers(x, key, cuts)
            if self.is_last:
                roots = self._loss(mb, out, target, train, keep_output)
            else:   # passed on in the dtype the unsplit model has here (see [Note: stage boundary dtype])
                roots = tuple(floating(out))
        if not train:
            return None if self.is_last else out
        if self.checking and not self.is_last:   # (the last stage's flag comes from its losses, see step_sums)
            self._count_nonfinite(0, roots)
        # the parts: each from its inputs (the stage's, or a cut's) to its roots (a cut's, or the stage's); a cut's
        # roots and inputs are the same storage, which lives on as long as a layer saved it ([Note: segments])
        starts = [(inputs, arrived)] + [(ins, arr) for _, arr, ins in cuts or ()]
        ends = [r for r, _, _ in cuts or ()] + [roots]
        for (ins, _), cut in zip(starts, ends[:-1]):
            for t in cut:
                _deallocate(t, ins)
        self.saved[mb] = [_Saved(ins if k == 0 else (), r, arrived=arr)
                          for k, ((ins, arr), r) in enumerate(zip(starts, ends))]
        self.peak_stored = max(self.peak_stored, len(self.saved))
        if self.is_last:
            return None
        passed = detach(out)
        for t in roots:
            _deallocate(t, inputs)
        return passed

    def _loss(self, mb: int, out: Any, target: Any, train: bool, keep_output: bool) -> Tensors:
        """The last stage's loss of microbatch ``mb``, kept undivided (:meth:`loss_terms` divides them); the backward
        roots (its gradient is divided and scaled instead: :meth:`_root_grads`)."""
        out_f = to_float(out)
        loss = self.loss_fn(out_f, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"loss_fn must return a scalar Tensor, got "
                            f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}")
        if train and not loss.requires_grad and any(t.requires_grad for t in floating(out_f)):
            raise ValueError("loss_fn returned a loss without a gradient path to the model's output (detached, "
                             "made with .item() or torch.tensor(...), or under torch.no_grad()): nothing would "
                             "train; compute the loss from the output with differentiable torch operations")
        if keep_output:
            self.outputs[mb] = detach(out)
        loss = loss if loss.dim() == 0 else loss.reshape(())
        self.losses.append(loss.detach())
        return (loss,) if train else ()   # divided by the microbatches (and scaled) in its gradient: _root_grads

    def loss_terms(self) -> torch.Tensor:
        """This step's microbatch losses, each divided by the step's microbatches over every replica (their sum is
        the global batch's mean)."""
        return torch.stack(self.losses) / self.microbatches

    def backward(self, mb: int, grads: Tensors | None, split: bool) -> Tensors:
        """Run B; return the gradients of the stage's floating-point inputs (empty on the first stage)."""
        parts = self.saved[mb]
        result = self._root_grads(mb, parts[-1], grads)
        for k in reversed(range(len(parts))):
            result = self._backward_part(k, parts[k], result, split)
        if self.checking:
            self._count_nonfinite(1, result)
        if not split:   # (split: the schedule has a W for this microbatch, even if B ran it fused)
            del self.saved[mb]
        return result

    def _backward_part(self, k: int, saved: _Saved, root_grads: Tensors, split: bool) -> Tensors:
        """B of part ``k``; the gradients of its inputs."""
        pairs = [(r, g) for r, g in zip(saved.roots, root_grads) if r.requires_grad]
        roots, rgrads = tuple(r for r, _ in pairs), tuple(g for _, g in pairs)
        anchor = (self._anchor,) if saved.hangs else ()   # autograd reaches the part's inputs through it
        custom, groups, rest = self._analyse(k, roots, anchor) if split and saved.hangs and roots else ([], [], None)
        if custom:
            split = False   # a custom autograd.Function: fused in B, W does nothing ([Note: split backward])
        if not split:
            saved.roots, saved.rest = (), ()
        if split:   # See [Note: split backward] in backward.py
            saved.rest = self._part_params[k]
            if rest is not None:
                saved.groups, saved.rest = groups, tuple(rest)
                backward_keeping(roots, rgrads, anchor, saved.groups, may_free=not saved.rest)
            if saved.rest:
                saved.grads = root_grads
            else:
                saved.roots = ()   # W starts from the branch nodes: what only the roots held can go
        elif roots:
            try:
                run_backward(roots, rgrads, (), keep_graph=False)
            except RuntimeError as exc:
                raise mutated(exc, self.index) if self.selective else exc
        result = saved.arrived.gradients() if saved.arrived is not None else ()
        saved.inputs, saved.arrived = (), None
        return result

    def _analyse(self, k: int, roots: Tensors, anchor: Tensors) -> tuple[list[str], list[WeightGroup], list[Any]]:
        """Part ``k``'s custom functions, weight groups and the parameters W runs from its roots (under recompute:
        every one), as the part's graphs of this shape had them (:class:`Recipe`: the walks once per shape)."""
        params, recipes = self._part_params[k], self._recipes[k]
        marks = self._marks[k]
        if marks is None:   # the AccumulateGrad nodes, held (as keys) so every graph uses these
            marks = self._marks[k] = {n: i for i, n in enumerate(accumulators(params)) if n is not None}
        order, key = shape_of(roots, marks)
        recipe = recipes.get(key)
        if recipe is not None:
            return (recipe.custom, *recipe.apply(order, params))
        graph = walk(roots)
        groups: list[WeightGroup]
        rest: list[torch.Tensor]
        if self.regions is not None:
            groups, rest = [], list(params)
        else:
            groups, rest = weight_groups(graph, anchor, params, accumulators(params))
        # shapes come from a layer's control flow, not from sizes (but a packed row's attention makes a node per
        # document, so a shape per document count): keep the recent
        if len(recipes) >= 16:
            del recipes[next(iter(recipes))]
        recipe = recipes[key] = Recipe.of(order, graph.custom, groups, rest, params)
        return (recipe.custom, *recipe.apply(order, params))   # (its groups carry how W runs them, direct.plan)

    def backward_weight(self, mb: int) -> None:
        """Run W after a split B: accumulate the parameter gradients and free the microbatch (nothing is left when its
        B ran the whole backward: recompute "selective" under a split schedule)."""
        for saved in self.saved.pop(mb, ()):
            backward_weights(saved.groups)
            pairs = [(r, g) for r, g in zip(saved.roots, saved.grads) if r.requires_grad]
            if pairs and saved.rest:
                run_backward(tuple(r for r, _ in pairs), tuple(g for _, g in pairs), saved.rest, keep_graph=False)

    def _count_nonfinite(self, i: int, tensors: Tensors) -> None:
        """Keep each tensor's sum in ``sums[i]``: one kernel per tensor, no host sync (NaN and inf carry). Summed in
        float32 for every dtype but float64 (a half sum would overflow at 65504; float64 made the sum 17x slower on
        CPU, 0.6 against 0.035 ms for a 512 Ki-element activation): the limit is a tensor whose finite values add
        up, on the way, beyond 3e38, taken for non-finite; the flags only name the stage, the step's decision goes
        by the loss and the gradient norm."""
        self.sums[i].extend(t.detach().sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)
                            for t in tensors)   # (no graph kept alive)

    def step_sums(self) -> torch.Tensor:
        """This step's float64 sums on the device, (the losses or the outputs, the input gradients): non-finite where
        a NaN or an inf went by (:meth:`_count_nonfinite`); the last stage's first is the step's loss."""
        outputs = self.loss_terms() if self.is_last and self.losses else _stacked(self.sums[0])
        both = (outputs, _stacked(self.sums[1]))
        device = next((x.device for x in both if x is not None), device_of((), self.params))   # (no parameters: CPU)
        return torch.stack([x.double().sum() if x is not None else torch.zeros((), dtype=torch.float64, device=device)
                            for x in both])

    def _root_grads(self, mb: int, saved: _Saved, grads: Tensors | None) -> Tensors:
        if self.is_last:   # d(loss * scale / microbatches), as autograd would compute it: (1 * scale) / microbatches
            loss = saved.roots[0]
            key = (loss.dtype, loss.device, self.loss_scale, self.microbatches)
            if self._seed is None or self._seed[0] != key:
                one = torch.ones_like(loss)
                self._seed = (key, (one if self.loss_scale == 1.0 else one * self.loss_scale) / self.microbatches)
            return (self._seed[1].clone(),)   # (a fresh tensor: a hook may change a gradient in place)
        if grads is None:
            raise RuntimeError(f"stage {self.index} microbatch {mb}: backward needs the output gradients")
        if len(grads) != len(saved.roots):
            raise RuntimeError(f"stage {self.index} microbatch {mb}: got {len(grads)} output gradients "
                               f"for {len(saved.roots)} floating-point outputs")
        return grads


def _stacked(values: list[torch.Tensor]) -> torch.Tensor | None:
    return torch.stack(values) if values else None
