"""One model chunk on one rank: F, B and W for a microbatch, activation checkpointing, precision, freeing.

[Note: stage boundary detach]
A chunk's input arrives as fresh tensors (from a receive, or detached from the previous chunk
on the same rank) and its floating-point tensors become leaves with ``requires_grad=True``.
Backward of the chunk therefore stops at its own inputs and ``input.grad`` is exactly what the
previous stage needs. The graph never spans two chunks.

[Note: free at the earliest point]
Per microbatch a chunk keeps only what backward needs, and only as long as it needs it:

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
chunk's inputs, keeps its data (freeing it would free someone else's).

[Note: split backward]
Zero-bubble schedules split backward into B (gradients of the chunk's inputs only) and W
(gradients of the parameters). W must cost only the weight part, so it must not run the
input path again. Before B, the chunk's graph is walked once (``_weight_groups``): for each
parameter, the *branch nodes* are the first nodes on the input path (between the chunk's inputs
and its outputs) that its gradient flows through, e.g. the ``AddmmBackward`` of a Linear whose
other operand came from the input. B runs with ``inputs=`` the chunk's inputs (autograd then
computes no weight branch at all) and a pre-hook on every branch node keeps the gradient
arriving there. W starts from those nodes with the kept gradients and ``inputs=`` the parameters
of one group (parameters sharing a branch node), so autograd computes only ``dW``; the same
node functions with the same incoming gradients as one fused backward, so the gradients are
equal bit for bit. When a group has several branch nodes, one downstream of the other, pre-hooks
pin each node's incoming gradient to the kept one so nothing is counted twice.

Not covered this way, so W runs from the roots again as before (cost b + w): parameters whose
gradient reaches the outputs without crossing the input path, the first chunk (its inputs need
no gradient: B is empty and W is the whole backward), and checkpointed chunks (every separate
backward pass recomputes a region, so one pass over the roots is cheaper than one per group).

[Note: activation checkpointing]
``checkpoint="full"`` runs the chunk's layers as one ``torch.utils.checkpoint`` region
(non-reentrant, RNG state preserved), so a microbatch keeps only its chunk input until its
backward recomputes the rest; ``"every:K"`` makes one region of every K consecutive layers.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node
from torch.utils.checkpoint import checkpoint as _checkpoint

__all__ = ["LayerChain", "LayerError", "StageChunk", "PRECISIONS", "parse_checkpoint"]

Tensors = tuple[torch.Tensor, ...]
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class LayerError(ValueError):
    """A layer could not run on its input; the message names the layer, its stage and the input's shapes."""

    def __init__(self, message: str, layer: int) -> None:
        super().__init__(message)
        self.layer = layer


class LayerChain(nn.Module):
    """Layers applied in order, one argument each, exactly as ``nn.Sequential`` does (a tuple stays a tuple).

    ``first`` is the model index of the first layer (for messages). Until the chain has run once,
    a layer that raises (typically on a shape or dtype it cannot take) raises :class:`LayerError`
    naming it and its input; later errors pass unchanged (a bug, not an input that does not fit).
    """

    def __init__(self, layers: list[nn.Module], first: int = 0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.first = first
        self.ran = False

    def forward(self, x: Any) -> Any:
        if self.ran:
            for layer in self.layers:
                x = layer(x)
            return x
        i = 0
        try:
            for i, layer in enumerate(self.layers):
                x = layer(x)
            self.ran = True
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            if isinstance(exc, (LayerError, torch.OutOfMemoryError)):
                raise
            raise LayerError(f"layer {self.first + i} ({type(self.layers[i]).__name__}) cannot take its input "
                             f"{describe_value(x)}: {(str(exc).splitlines() or [''])[0]}", self.first + i) from exc
        return x


def describe_value(x: Any) -> str:
    """Shapes and dtypes of the tensors in ``x``, e.g. ``(4, 16) float32``."""
    parts = [f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in _flat(x)]
    return "[" + ", ".join(parts) + "]" if len(parts) != 1 else parts[0]


def parse_checkpoint(spec: str) -> int | None:
    """Layers per checkpoint region: ``none`` -> None, ``full`` -> 0 (the whole chunk), ``every:K`` -> K."""
    if spec == "none":
        return None
    if spec == "full":
        return 0
    if spec.startswith("every:") and spec[6:].isdigit() and int(spec[6:]) >= 1:
        return int(spec[6:])
    raise ValueError(f"checkpoint must be 'none', 'full' or 'every:K' with K >= 1 layers per region (got {spec!r})")


def _deallocate(t: torch.Tensor, inputs: Tensors) -> None:
    """Swap a root's storage for an empty one (see [Note: free at the earliest point])."""
    if t.grad_fn is not None and t._base is None and not any(t is x for x in inputs):
        t.data = torch.empty((0,), dtype=t.dtype, device=t.device)


def _keep(store: dict[int, tuple[torch.Tensor | None, ...]], i: int,
          grads: tuple[torch.Tensor | None, ...]) -> None:
    store[i] = grads


def _pin(grads: tuple[torch.Tensor | None, ...], _incoming: tuple[torch.Tensor | None, ...]) -> Any:
    return grads


def _run_backward(roots: Any, grads: Tensors, inputs: Tensors, keep_graph: bool) -> None:
    torch.autograd.Variable._execution_engine.run_backward(
        roots, grads, keep_graph, False, inputs, allow_unreachable=True, accumulate_grad=True)


def _grad_node(t: torch.Tensor) -> Node | None:
    """The autograd node of ``t``: its grad_fn, or the AccumulateGrad of a leaf."""
    if t.grad_fn is not None or not t.requires_grad:
        return t.grad_fn
    with torch.enable_grad():
        view = t.view_as(t).grad_fn
        return view.next_functions[0][0] if view is not None else None


@dataclass
class _WeightGroup:
    """Parameters whose gradients leave the input path at the same branch nodes (see [Note: split backward])."""

    nodes: list[Node]
    params: list[torch.Tensor]
    grads: dict[int, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)   # node index -> kept grads


def _weight_groups(roots: Tensors, inputs: Tensors,
                   params: Tensors) -> tuple[list[_WeightGroup], list[torch.Tensor]]:
    """Group ``params`` by the branch nodes where their gradients leave the input path; also return the
    parameters with a gradient that never crosses the input path (W must run from the roots for them)."""
    consumers: dict[Node, list[Node]] = {}
    stack = [n for n in map(_grad_node, roots) if n is not None]
    seen = set(stack)
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is not None:
                consumers.setdefault(nxt, []).append(node)
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
    on_path: set[Node] = set()         # nodes between the inputs and the roots
    stack = [n for n in map(_grad_node, inputs) if n is not None]
    while stack:
        for c in consumers.get(stack.pop(), ()):
            if c not in on_path:
                on_path.add(c)
                stack.append(c)
    groups: dict[Node, _WeightGroup] = {}
    elsewhere: list[torch.Tensor] = []
    for p in params:
        start = _grad_node(p)
        if start not in consumers:
            continue   # no gradient in this microbatch
        branch: set[Node] = set()
        walked, stack = {start}, [start]
        while stack:
            for c in consumers.get(stack.pop(), ()):
                if c in on_path:
                    branch.add(c)
                elif c not in walked:
                    walked.add(c)
                    stack.append(c)
        if not branch or walked & set(map(_grad_node, roots)):
            elsewhere.append(p)
            continue
        merged = {id(g): g for n in branch if (g := groups.get(n)) is not None}
        group = _WeightGroup(sorted(branch, key=id), [p])
        for g in merged.values():
            group.params += g.params
            group.nodes = list({id(n): n for n in group.nodes + g.nodes}.values())
        for n in group.nodes:
            groups[n] = group
    return list({id(g): g for g in groups.values()}.values()), elsewhere


@dataclass
class _Saved:
    inputs: Tensors                  # leaves that need gradients (floating inputs of a non-first chunk)
    roots: Tensors                   # where backward starts (the scaled loss on the last stage)
    grads: Tensors = field(default=())   # gradients of the roots (kept for W when it runs from the roots)
    groups: list[_WeightGroup] = field(default_factory=list)   # split backward: what W runs from
    rest: Tensors = ()               # split backward: parameters W reaches from the roots


class StageChunk:
    """Runs one chunk (pipeline stage ``stage`` of ``num_stages``) for individual microbatches."""

    def __init__(self, module: LayerChain, stage: int, num_stages: int, loss_fn: Callable[[Any, Any], torch.Tensor],
                 microbatches: int, checkpoint: str = "none", precision: str = "fp32") -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} (got {precision!r})")
        self.module = module
        self.stage = stage
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        self.loss_fn = loss_fn
        self.microbatches = microbatches
        self.dtype = PRECISIONS[precision]      # autocast and wire dtype; None: fp32 throughout
        self.loss_scale = 1.0                   # fp16: the engine's dynamic loss scale
        per = parse_checkpoint(checkpoint)
        layers = list(module.layers)
        self.regions: list[LayerChain] | None = None
        if per is not None:
            size = per or len(layers)
            self.regions = [LayerChain(layers[i:i + size], module.first + i) for i in range(0, len(layers), size)]
        self.saved: dict[int, _Saved] = {}
        self.peak_stored = 0
        self.losses: list[torch.Tensor] = []
        self.outputs: dict[int, Any] = {}     # last stage, eval with return_outputs
        self._params = tuple(p for p in module.parameters() if p.requires_grad)
        self.nonfinite = torch.zeros(2)         # this step: (non-finite outputs or loss, non-finite input grads)

    def reset(self) -> None:
        self.nonfinite = torch.zeros(2, dtype=torch.float64, device=_device_of((), self._params))
        self.saved.clear()
        self.losses.clear()
        self.outputs.clear()
        self.peak_stored = 0

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.dtype)

    def _layers(self, x: Any) -> Any:
        if self.regions is None:
            return self.module(x)
        for region in self.regions:
            x = _checkpoint(region, x, use_reentrant=False, preserve_rng_state=True)
        return x

    def forward(self, mb: int, x: Any, target: Any, train: bool, keep_output: bool = False) -> Any:
        """Run F on one argument ``x``; return what to pass on (None on the last stage, which keeps its loss)."""
        inputs: Tensors = ()
        if not self.is_first:   # See [Note: stage boundary detach]
            inputs = tuple(_leaves(x))
            for t in inputs:
                t.requires_grad_(train)
        with torch.set_grad_enabled(train):
            with self._autocast(_device_of(x, self._params)):
                try:
                    out = self._layers(x)
                except LayerError as exc:
                    came = (f" (that input is the output of stage {self.stage - 1}, whose last layer is layer "
                            f"{exc.layer - 1})" if not self.is_first and exc.layer == self.module.first else "")
                    raise LayerError(f"stage {self.stage}: {exc}{came}", exc.layer) from exc.__cause__
            if self.is_last:
                loss = self.loss_fn(_to_float(out), target)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise TypeError(f"loss_fn must return a scalar Tensor, got "
                                    f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}")
                if keep_output:
                    self.outputs[mb] = _detach(out)
                loss = loss.reshape(()) / self.microbatches
                self.losses.append(loss.detach())
                roots: Tensors = (loss * self.loss_scale,) if train else ()
            else:
                if self.dtype is not None:   # activations travel in the low precision
                    out = _map(out, lambda t: t.to(self.dtype) if t.is_floating_point() else t)
                roots = tuple(t for t in _flat(out) if t.is_floating_point())
        if not train:
            return None if self.is_last else out
        self._count_nonfinite(0, roots)
        self.saved[mb] = _Saved(inputs, roots)
        self.peak_stored = max(self.peak_stored, len(self.saved))
        if self.is_last:
            return None
        passed = _detach(out)
        for t in roots:
            _deallocate(t, inputs)
        return passed

    def backward(self, mb: int, grads: Tensors | None, split: bool) -> Tensors:
        """Run B; return the gradients of the chunk's floating-point inputs (empty on the first stage)."""
        saved = self.saved[mb]
        root_grads = self._root_grads(mb, saved, grads)
        pairs = [(r, g) for r, g in zip(saved.roots, root_grads) if r.requires_grad]
        roots, rgrads = tuple(r for r, _ in pairs), tuple(g for _, g in pairs)
        if split:   # See [Note: split backward]
            saved.rest = self._params
            if saved.inputs and roots:
                if self.regions is None:
                    saved.groups, rest = _weight_groups(roots, saved.inputs, self._params)
                    saved.rest = tuple(rest)
                handles = [n.register_prehook(functools.partial(_keep, g.grads, i))
                           for g in saved.groups for i, n in enumerate(g.nodes)]
                try:
                    _run_backward(roots, rgrads, saved.inputs, keep_graph=True)
                finally:
                    for h in handles:
                        h.remove()
            if saved.rest:
                saved.grads = root_grads
            else:
                saved.roots = ()   # W starts from the branch nodes: what only the roots held can go
        elif roots:
            _run_backward(roots, rgrads, (), keep_graph=False)
        result = tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in saved.inputs)
        self._count_nonfinite(1, result)
        saved.inputs = ()
        if not split:
            del self.saved[mb]
        return result

    def backward_weight(self, mb: int) -> None:
        """Run W after a split B: accumulate the parameter gradients and free the microbatch."""
        saved = self.saved.pop(mb)
        for group in saved.groups:
            edges = [(GradientEdge(n, k), g) for i, n in enumerate(group.nodes)
                     for k, g in enumerate(group.grads.get(i, ())) if g is not None]
            if not edges:
                continue
            pins = [n.register_prehook(functools.partial(_pin, group.grads[i]))
                    for i, n in enumerate(group.nodes) if len(group.nodes) > 1 and i in group.grads]
            try:
                _run_backward(tuple(e for e, _ in edges), tuple(g for _, g in edges), tuple(group.params),
                              keep_graph=True)
            finally:
                for h in pins:
                    h.remove()
        pairs = [(r, g) for r, g in zip(saved.roots, saved.grads) if r.requires_grad]
        if pairs and saved.rest:
            _run_backward(tuple(r for r, _ in pairs), tuple(g for _, g in pairs), saved.rest, keep_graph=False)

    def _count_nonfinite(self, i: int, tensors: Tensors) -> None:
        """Count tensors holding a NaN or inf into ``nonfinite[i]`` (a sum per tensor, no host sync)."""
        for t in tensors:
            total = t.sum(dtype=torch.float32) if t.dtype in (torch.float16, torch.bfloat16) else t.sum()
            self.nonfinite[i] += (~torch.isfinite(total)).double()

    def _root_grads(self, mb: int, saved: _Saved, grads: Tensors | None) -> Tensors:
        if self.is_last:
            return (torch.ones_like(saved.roots[0]),)
        if grads is None:
            raise RuntimeError(f"stage {self.stage} microbatch {mb}: backward needs the output gradients")
        if len(grads) != len(saved.roots):
            raise RuntimeError(f"stage {self.stage} microbatch {mb}: got {len(grads)} output gradients "
                               f"for {len(saved.roots)} floating-point outputs")
        return grads


def _flat(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for t in x:
            yield from _flat(t)


def _leaves(x: Any) -> Iterator[torch.Tensor]:
    return (t for t in _flat(x) if t.is_floating_point())


def _map(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return type(x)(_map(t, fn) for t in x)
    return x


def to_device(x: Any, device: torch.device) -> Any:
    """A tensor, or the tensors of a (nested) tuple or list, on ``device``."""
    return _map(x, lambda t: t.to(device))


def _detach(x: Any) -> Any:
    return _map(x, lambda t: t.detach())


def _to_float(x: Any) -> Any:
    return _map(x, lambda t: t.float() if t.dtype in (torch.bfloat16, torch.float16) else t)


def _device_of(x: Any, params: Tensors) -> torch.device:
    for t in _flat(x):
        return t.device
    return params[0].device if params else torch.device("cpu")
