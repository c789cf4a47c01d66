"""Split backward for zero-bubble schedules: B computes input gradients only, W only the weight gradients.

[Note: split backward]
Zero-bubble schedules split backward into B (gradients of the stage's inputs only) and W
(gradients of the parameters). W must cost only the weight part, so it must not run the
input path again. Before B, the stage's graph is walked once (:func:`weight_groups`): for each
parameter, the *branch nodes* are the first nodes on the input path (between the stage's inputs
and its outputs) that its gradient flows through, e.g. the ``AddmmBackward`` of a Linear whose
other operand came from the input. B runs with ``inputs=`` the stage's inputs (autograd then
computes no weight branch at all) and a pre-hook on every branch node keeps the gradient arriving
there (after any tensor hooks on the node's outputs, as the node sees it). W starts from those
nodes with the kept gradients and ``inputs=`` the parameters of one group (parameters sharing a
branch node), so autograd computes only ``dW``; the same node functions with the same incoming
gradients as one fused backward, so the gradients are equal bit for bit. Pre-hooks pin each node's
incoming gradient in W to the kept one, so nothing is counted twice when a group has several branch
nodes, one downstream of the other, and no tensor hook's result is applied twice.

Not covered this way, so W runs from the roots again (cost b + w): parameters whose gradient
reaches the outputs without crossing the input path, the first stage (its inputs need no
gradient: B is empty and W is the whole backward), and recomputed stages (every separate
backward pass recomputes a region, so one pass over the roots is cheaper than one per group).

[Note: B frees what W does not read]
The graph holds every tensor the forward saved until its last backward pass releases it. Kept for W, it
held a microbatch's whole activations from F until W, and the gradients at the branch nodes beside them
from B on: a split schedule held more than a fused one (GPT small: 16 MiB of activations a block, 11 of
gradients). W of a group that runs without autograd reads only a few of those tensors (a Linear's input,
a LayerNorm's input and statistics: 9 of the 16 MiB). So when every group of a part runs that way and no
parameter is left for W to reach from the roots, B reads them off the nodes (:func:`direct.bind`: a
reference to each) and releases the graph as a fused backward does: what only the input path needed
(attention's saved tensors, an activation function's input) goes at B. A parameter given a tensor hook
between B and W is not seen then (register it before the step).

A group of one node of torch's common layers (Linear, LayerNorm, Conv) needs no autograd call in W
at all ([Note: W without the engine] in direct.py). Otherwise W makes one autograd call per group, all
under one ``GraphExecGroup``, so a layer that recomputes
itself recomputes once in W, not once per group. Each call's cost grows with the graph below its branch
nodes (autograd walks it to find what is needed), so a stage of several layers runs B and W a layer at a
time, unless it is past the first stage and every layer's W needs no autograd call ([Note: segments] in
stage.py). The groups are found once per graph shape (:class:`Recipe`: node types, edges and which parameter each
AccumulateGrad is, checked per microbatch by a cheaper walk, :func:`shape_of`), and the parameters'
AccumulateGrad nodes once per stage.

A graph holding a custom ``autograd.Function`` is split at all only if nothing proves it unsafe,
and nothing can: its backward may change its incoming gradient in place (a gradient B kept for W
would change under it: wrong dW) or compute dW in B and again in W. Such a microbatch runs its
backward fused in B (:func:`walk` finds them) and W does nothing: never wrong, and
never slower than unsplit. A Function whose author promises both (its backward leaves its incoming
gradient alone and computes only the gradients asked of it) says so with a class attribute
``split_backward_safe = True`` (``SPLIT_SAFE``), and is split like torch's own nodes.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch.autograd.graph import GradientEdge, Node

from . import direct

SPLIT_SAFE = "split_backward_safe"   # a custom autograd.Function's promise, see the module docstring

__all__ = ["SPLIT_SAFE", "WeightGroup", "Graph", "walk", "shape_of", "Recipe", "accumulators", "weight_groups",
           "run_backward", "backward_keeping", "backward_weights"]

Tensors = tuple[torch.Tensor, ...]
Grads = tuple[torch.Tensor | None, ...]


def run_backward(roots: Any, grads: Tensors, inputs: Tensors, keep_graph: bool) -> None:
    """Autograd's engine called directly: the roots' data may have been freed (see [Note: free at the
    earliest point] in stage.py), so ``torch.autograd.backward``'s shape check cannot be used."""
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
class WeightGroup:
    """Parameters whose gradients leave the input path at the same branch nodes (see [Note: split backward])."""

    nodes: list[Node]
    params: list[torch.Tensor]
    grads: dict[int, Grads] = field(default_factory=dict)   # node index -> the gradients kept in B
    bound: direct.Bound | None = None   # what W reads, kept by a B that freed the graph (before ``direct``: the name)
    direct: direct.Plan | None = None   # how W runs it without autograd, if it can ([Note: W without the engine])


@dataclass
class Graph:
    """The autograd graph behind a microbatch's roots, walked once: who feeds gradient into each node, and the
    custom ``autograd.Function`` nodes met on the way (their class names; see the module docstring)."""

    roots: list[Node]
    consumers: dict[Node, list[Node]]
    custom: list[str]


def walk(roots: Tensors) -> Graph:
    """One pass over the graph reachable from ``roots``."""
    consumers: dict[Node, list[Node]] = {}
    custom: list[str] = []
    starts = [n for n in map(_grad_node, roots) if n is not None]
    stack, seen = list(starts), set(starts)
    while stack:
        node = stack.pop()
        if (isinstance(node, torch.autograd.function.BackwardCFunction) and type(node).__name__ != "_ArrivalBackward"
                and not getattr(getattr(type(node), "_forward_cls", None), SPLIT_SAFE, False)):
            custom.append(type(node).__name__)   # (the stage's own _Arrival node only hands gradients over)
        for nxt, _ in node.next_functions:
            if nxt is not None:
                consumers.setdefault(nxt, []).append(node)
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
    return Graph(starts, consumers, custom)


def shape_of(roots: Tensors, params: dict[Node, int]) -> tuple[list[Node], tuple[Any, ...]]:
    """The nodes behind ``roots`` in a fixed visiting order, and the graph's shape: each node's type (and for a
    parameter's AccumulateGrad, its place in ``params``, node -> index) and, per edge, the order of the node it
    leads to. Two graphs of one shape split alike (:class:`Recipe`)."""
    order: list[Node] = [n for n in map(_grad_node, roots) if n is not None]
    index = {n: i for i, n in enumerate(order)}
    key: list[Any] = [len(order)]
    i = 0
    while i < len(order):
        node = order[i]
        key.append(type(node))
        key.append(params.get(node, -1))
        for nxt, _ in node.next_functions:
            if nxt is None:
                key.append(-1)
                continue
            j = index.get(nxt)
            if j is None:
                j = index[nxt] = len(order)
                order.append(nxt)
            key.append(j)
        i += 1
    return order, tuple(key)


@dataclass
class Recipe:
    """How one graph shape splits (:func:`shape_of`): its custom functions, and its weight groups and the parameters
    W runs from the roots, as positions in the visiting order and in the parameter list."""

    custom: list[str]
    groups: list[tuple[list[int], list[int], direct.Plan | None]]
    rest: list[int]

    @staticmethod
    def of(order: list[Node], custom: list[str], groups: list[WeightGroup],
           rest: list[torch.Tensor], params: Tensors) -> "Recipe":
        at, where = {n: i for i, n in enumerate(order)}, {id(p): i for i, p in enumerate(params)}
        return Recipe(custom, [([at[n] for n in g.nodes], [where[id(p)] for p in g.params],
                                direct.plan(g.nodes, g.params)) for g in groups],
                      [where[id(p)] for p in rest])

    def apply(self, order: list[Node], params: Tensors) -> tuple[list[WeightGroup], list[torch.Tensor]]:
        return ([WeightGroup([order[i] for i in nodes], [params[j] for j in ps], direct=plan)
                 for nodes, ps, plan in self.groups], [params[j] for j in self.rest])


def _downstream(starts: list[Node], consumers: dict[Node, list[Node]]) -> set[Node]:
    """Every node between ``starts`` and the roots (``starts`` excluded)."""
    found: set[Node] = set()
    stack = list(starts)
    while stack:
        for c in consumers.get(stack.pop(), ()):
            if c not in found:
                found.add(c)
                stack.append(c)
    return found


def accumulators(params: Tensors) -> list[Node | None]:
    """The parameters' AccumulateGrad nodes. Held, they stay the ones every graph uses (as DDP holds them), so a
    stage finds them once, not once per microbatch."""
    return [_grad_node(p) for p in params]


def weight_groups(graph: Graph, inputs: Tensors, params: Tensors,
                  nodes: list[Node | None]) -> tuple[list[WeightGroup], list[torch.Tensor]]:
    """Group ``params`` by the branch nodes where their gradients leave the input path; also return the
    parameters with a gradient that never crosses the input path (W must run from the roots for them).
    ``nodes``: the parameters' :func:`accumulators`."""
    consumers = graph.consumers
    on_path = _downstream([n for n in map(_grad_node, inputs) if n is not None], consumers)
    root_nodes = set(graph.roots)
    groups: dict[Node, WeightGroup] = {}
    elsewhere: list[torch.Tensor] = []
    for p, start in zip(params, nodes):
        if start is None or start not in consumers:
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
        if not branch or walked & root_nodes:
            elsewhere.append(p)
            continue
        group = WeightGroup(sorted(branch, key=id), [p])
        for g in {id(g): g for n in branch if (g := groups.get(n)) is not None}.values():
            group.params += g.params
            group.nodes = list({id(n): n for n in group.nodes + g.nodes}.values())
        for n in group.nodes:
            groups[n] = group
    return list({id(g): g for g in groups.values()}.values()), elsewhere


def _keep(store: dict[int, Grads], i: int, grads: Grads) -> None:
    store[i] = grads


def _pin(grads: Grads, _incoming: Grads) -> Any:
    return grads


def backward_keeping(roots: Tensors, grads: Tensors, inputs: Tensors, groups: list[WeightGroup],
                     may_free: bool = False) -> None:
    """B of a split backward: the inputs' gradients, keeping what arrives at every group's branch nodes (a node
    pre-hook: after the tensor hooks a user put on the node's outputs, as the node itself sees it). With
    ``may_free`` (W needs nothing from the roots), the graph goes with B where every group binds ([Note: B frees
    what W does not read]; each group's ``bound`` says so). Else the hooks stay with the graph, which goes after
    W: there a node autograd runs again stores its gradient again, but W pins it to the tuple B kept (bound before
    W's call)."""
    bound = direct.bind_all(groups) if may_free else None
    for k, g in enumerate(groups):
        g.bound = bound[k] if bound is not None else None
        for i, n in enumerate(g.nodes):
            n.register_prehook(functools.partial(_keep, g.grads, i))
    run_backward(roots, grads, inputs, keep_graph=bound is None)


def backward_weights(groups: list[WeightGroup]) -> None:
    """W of a split backward: every group's weight gradients from its kept branch gradients.

    A group of one node of torch's common layers without autograd (direct.py); any other, one autograd call
    per group (one call for all would also run the input path between them again), all under one
    ``GraphExecGroup``: a layer that recomputes itself (``torch.utils.checkpoint``, non-reentrant) recomputes
    once in W, not once per group.
    """
    with _exec_group(), torch.no_grad():   # (autograd's engine sets its own grad mode; direct W runs without)
        for group in groups:
            if group.bound is not None:
                direct.run_bound(group.bound, group.grads.get(0))
                continue
            if group.direct is not None and direct.run(group.direct, group.nodes[0], group.grads.get(0)):
                continue
            edges = [(GradientEdge(n, k), g) for i, n in enumerate(group.nodes)
                     for k, g in enumerate(group.grads.get(i, ())) if g is not None]
            if not edges:
                continue
            # each node gets what B kept, nothing added on the way (several nodes: one downstream of another) and no
            # tensor hook applied twice (B kept the gradient after them, the node runs them again)
            pins = [n.register_prehook(functools.partial(_pin, group.grads[i]))
                    for i, n in enumerate(group.nodes) if i in group.grads]
            try:
                run_backward(tuple(e for e, _ in edges), tuple(g for _, g in edges), tuple(group.params),
                             keep_graph=True)
            finally:
                for h in pins:
                    h.remove()


def _exec_group() -> contextlib.AbstractContextManager[Any]:
    group = getattr(torch.utils.checkpoint, "GraphExecGroup", None)   # torch >= 2.9
    return group() if group is not None else contextlib.nullcontext()
