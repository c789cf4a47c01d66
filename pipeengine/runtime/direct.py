"""W of a split backward without autograd's engine, for the layers most models are made of.

[Note: W without the engine]
An autograd call costs about 20 µs of host time before any arithmetic (a graph task, its dependencies,
the walk for what ``inputs=`` needs), and W made one per weight group ([Note: split backward] in
backward.py): 72 for 12 GPT blocks, more host time than their whole fused backward. A group that is one
branch node of a kind below, its parameters' AccumulateGrad nodes right behind it (through a transpose
for a matmul's weight, and under autocast through the weight's cast, ``ToCopyBackward0``), needs none of
it: W calls the kernel the node's own backward calls, with the output mask autograd gives it in W (the
input path off), casts the result back as ToCopyBackward0 would, and accumulates as AccumulateGrad does
(the gradient taken when the parameter had none, else added in place; then the parameter's
post-accumulate hooks, which the gradient all-reduce uses).

- ``AddmmBackward0`` (``nn.Linear`` with a bias) and ``MmBackward0`` (without): the weight's gradient is
  ``mm_mat2_backward``'s product, the bias's the gradient summed to its shape (the engine's ``sum_to``).
- ``NativeLayerNormBackward0``: ``native_layer_norm_backward`` with the mask [False, weight, bias].
- ``ConvolutionBackward0``: ``convolution_backward`` with the mask [False, weight, bias].

Same kernels, same arguments: the gradients are autograd's bit for bit (``tests/runtime/test_direct.py``
checks Linear, LayerNorm and Conv1d, with and without a bias, frozen parts, and under bf16 autocast, against the fused
backward). Anything else goes through autograd as before: another node kind, a view or another op
between the node and a parameter, a group of several branch nodes, a saved tensor with hooks
(``torch.utils.checkpoint``, offloading: their unpacking belongs to the engine), a parameter with a
tensor hook (``register_hook``). Not seen: a hook registered on a parameter's AccumulateGrad node itself
(use ``register_post_accumulate_grad_hook``).

A stage whose every trained parameter is in such a layer (:func:`covers`) is not cut into segments
([Note: segments] in stage.py) unless it is the first: with no autograd call in W, a layer at a time would
only add host time (12 tiny GPT blocks: B + W 1.45-1.47x the fused backward in one part, 1.71-1.78x a
layer at a time when W first ran without autograd; ``benchmarks/split_backward.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.autograd.graph import Node

__all__ = ["Plan", "Bound", "MODULES", "covers", "plan", "bind", "bind_all", "read_bytes", "run_bound", "run"]

Grads = list["torch.Tensor | None"]     # per output of a branch node: the gradient for the parameter it feeds


@dataclass
class Plan:
    """One weight group of a graph shape: its node's kind and the parameter each of the node's outputs feeds (None:
    none; the output mask asks for exactly those)."""

    kind: str
    targets: list[torch.Tensor | None]

    @property
    def mask(self) -> list[bool]:
        return [t is not None for t in self.targets]


MODULES = (nn.Linear, nn.LayerNorm, nn.Conv1d, nn.Conv2d, nn.Conv3d)   # torch's layers whose nodes are the kinds above


def covers(module: nn.Module) -> bool:
    """Every parameter of ``module`` that trains is one of a layer in :data:`MODULES` (that type exactly: a subclass
    may compute otherwise), so W can run every group of its graph without autograd."""
    return all(type(m) in MODULES for m in module.modules() if any(p.requires_grad for p in m.parameters(False)))


def _param(edge: tuple[Node | None, int], transposed: bool) -> torch.Tensor | None:
    """The parameter behind a node's output edge: an AccumulateGrad right there, or behind one TBackward0 when
    ``transposed``, and then behind autocast's cast (ToCopyBackward0); None if the edge is empty or leads
    elsewhere."""
    node = edge[0]
    if node is not None and transposed:
        node = node.next_functions[0][0] if type(node).__name__ == "TBackward0" else None
    if node is not None and type(node).__name__ == "ToCopyBackward0":
        node = node.next_functions[0][0]
    if node is None or type(node).__name__ != "AccumulateGrad":
        return None
    variable: torch.Tensor = node.variable   # type: ignore[attr-defined]
    return variable


def _weights(node: Node) -> list[torch.Tensor | None] | None:
    """Per output of ``node``: the parameter it feeds (None: the input path, or nothing), if its kind is one W
    computes directly and its layout is the one listed in the module docstring; else None."""
    kind, edges = type(node).__name__, node.next_functions
    if kind == "AddmmBackward0":   # (bias, input, weight.t())
        return [_param(edges[0], False), None, _param(edges[2], True)]
    if kind == "MmBackward0":      # (input, weight.t())
        return [None, _param(edges[1], True)]
    if kind in ("NativeLayerNormBackward0", "ConvolutionBackward0"):   # (input, weight, bias)
        return [None, _param(edges[1], False), _param(edges[2], False)]
    return None


def plan(nodes: list[Node], params: list[torch.Tensor]) -> Plan | None:
    """How W computes a group of branch ``nodes`` and ``params`` without autograd, or None (see the module
    docstring): one node, whose outputs feed exactly the group's parameters, one each."""
    found = _weights(nodes[0]) if len(nodes) == 1 else None
    if found is None:
        return None
    mine = [id(p) for p in found if p is not None]
    if len(mine) != len(params) or set(mine) != {id(p) for p in params}:
        return None
    return Plan(type(nodes[0]).__name__, found)


@dataclass
class Bound:
    """One group's W read off its node: the saved tensors and arguments its kernel takes (a reference to each keeps
    it when the graph goes; see [Note: B frees what W does not read] in backward.py)."""

    plan: Plan
    args: tuple[Any, ...]


def _transposed(node: Any) -> bool:
    """Whether a matmul's ``mat2`` (the transpose of its weight) is column-major: W's product is then taken as
    ``grad.t() @ x`` (see :func:`_weight`)."""
    sizes, strides = node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides
    return bool(strides[0] == 1 and strides[1] == sizes[0])


def _bind_addmm(node: Any, plan: Plan) -> tuple[Any, ...] | None:
    """``AddmmBackward0`` (outputs: bias, input, weight.t()). Not here: alpha or beta not 1, or a 2-D bias (of the
    output's own shape its gradient would be the kept gradient itself: autograd decides whether that may become its
    .grad)."""
    bias, weight = plan.targets[0], plan.targets[2]
    if node._raw_saved_mat1.unpack_hook is not None or node._saved_alpha != 1 or node._saved_beta != 1:
        return None
    if bias is not None and bias.dim() == 2:   # (as the output, [rows, out], or broadcast from [1, out]: rare)
        return None
    return (None, False) if weight is None else (node._saved_mat1, _transposed(node))


def _addmm(grad: torch.Tensor, args: tuple[Any, ...], plan: Plan) -> Grads:
    """The bias's gradient is ``grad`` summed to the bias's shape, as the engine's ``sum_to`` does (over the leading
    dimension of a [rows, out] gradient: its sum over dim 0)."""
    bias, x, transposed = plan.targets[0], *args
    bias_grad = None
    if bias is not None:
        bias_grad = grad.sum(0) if grad.dim() == 2 and bias.dim() == 1 else grad.sum_to_size(bias.shape)
    return [bias_grad, None, None if x is None else _weight(grad, x, transposed)]


def _bind_mm(node: Any, plan: Plan) -> tuple[Any, ...] | None:
    """``MmBackward0`` (outputs: input, weight.t())."""
    if node._raw_saved_self.unpack_hook is not None:
        return None
    return (node._saved_self, _transposed(node))


def _mm(grad: torch.Tensor, args: tuple[Any, ...], plan: Plan) -> Grads:
    return [None, _weight(grad, *args)]


def _weight(grad: torch.Tensor, x: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The gradient of W in ``x @ W.t()``: autograd's ``mm_mat2_backward`` (alpha 1) transposed back by TBackward0:
    for a column-major ``mat2`` (the transpose of a contiguous W) ``grad.t() @ x`` transposed, else ``x.t() @
    grad``."""
    return grad.t().mm(x) if transposed else x.t().mm(grad).t()


def _bind_layer_norm(node: Any, plan: Plan) -> tuple[Any, ...] | None:
    """``NativeLayerNormBackward0`` (outputs: input, weight, bias)."""
    if (node._raw_saved_input.unpack_hook is not None or node._raw_saved_result1.unpack_hook is not None
            or node._raw_saved_result2.unpack_hook is not None):
        return None
    return (node._saved_input, node._saved_normalized_shape, node._saved_result1, node._saved_result2,
            node._saved_weight, node._saved_bias)


def _layer_norm(grad: torch.Tensor, args: tuple[Any, ...], plan: Plan) -> Grads:
    return list(torch.ops.aten.native_layer_norm_backward(grad, *args, plan.mask))


def _bind_convolution(node: Any, plan: Plan) -> tuple[Any, ...] | None:
    """``ConvolutionBackward0`` (outputs: input, weight, bias)."""
    if node._raw_saved_input.unpack_hook is not None:
        return None
    return (node._saved_input, node._saved_weight, node._saved_bias_sym_sizes_opt, node._saved_stride,
            node._saved_padding, node._saved_dilation, node._saved_transposed, node._saved_output_padding,
            node._saved_groups)


def _convolution(grad: torch.Tensor, args: tuple[Any, ...], plan: Plan) -> Grads:
    return list(torch.ops.aten.convolution_backward(grad, *args, plan.mask))


# per node kind: what W reads off the node (None: not this way), and its kernel on those arguments
_Bind = Callable[[Any, Plan], "tuple[Any, ...] | None"]
_Kernel = Callable[[torch.Tensor, tuple[Any, ...], Plan], Grads]
_KINDS: dict[str, tuple[_Bind, _Kernel]] = {
    "AddmmBackward0": (_bind_addmm, _addmm), "MmBackward0": (_bind_mm, _mm),
    "NativeLayerNormBackward0": (_bind_layer_norm, _layer_norm),
    "ConvolutionBackward0": (_bind_convolution, _convolution)}


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    """What AccumulateGrad does with ``g``, first cast to the parameter's dtype and device as autocast's cast
    (ToCopyBackward0) or the engine would: taken as the gradient, in the parameter's layout, when there is none,
    else added in place; then the parameter's post-accumulate hooks."""
    if g.dtype != p.dtype or g.device != p.device:
        g = g.to(device=p.device, dtype=p.dtype)
    if p.grad is None:
        p.grad = g if g.stride() == p.stride() else torch.empty_like(p).copy_(g)
    else:
        p.grad.add_(g)
    hooks: dict[Any, Callable[[torch.Tensor], None]] | None = p._post_accumulate_grad_hooks
    for hook in (hooks or {}).values():
        hook(p)


def bind(plan: Plan, node: Any) -> Bound | None:
    """What W of one group (its one branch node) needs, read off the node while its saved tensors are there; None
    where autograd must run it instead (a parameter with a tensor hook, a saved tensor with hooks, the cases of the
    kind above)."""
    for p in plan.targets:
        if p is not None and p._backward_hooks:
            return None
    args = _KINDS[plan.kind][0](node, plan)
    return None if args is None else Bound(plan, args)


def bind_all(groups: Sequence[Any]) -> list[Bound] | None:
    """Each of ``groups`` (backward.WeightGroup: its ``direct`` plan and branch ``nodes``) bound, or None as soon as
    one cannot be (W then needs the graph)."""
    out = []
    for g in groups:
        bound = bind(g.direct, g.nodes[0]) if g.direct is not None else None
        if bound is None:
            return None
        out.append(bound)
    return out


def read_bytes(bounds: Iterable[Bound], params: Iterable[torch.Tensor]) -> int:
    """Bytes of the saved tensors ``bounds`` read (each storage once), the parameters' aside: what a split B keeps
    for W when it frees the graph."""
    mine = {p.untyped_storage()._cdata for p in params}
    read = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for b in bounds for t in b.args
            if isinstance(t, torch.Tensor)}
    return sum(n for key, n in read.items() if key not in mine)


def run_bound(bound: Bound, grads: tuple[torch.Tensor | None, ...] | None) -> None:
    """W of one bound group from the gradients kept at its node in B, without autograd. Call it with grad mode
    off."""
    grad = grads[0] if grads else None
    if grad is None:
        return   # no gradient arrived: nothing to add (as autograd with no edges)
    plan = bound.plan
    for p, g in zip(plan.targets, _KINDS[plan.kind][1](grad, bound.args, plan)):
        if p is not None and g is not None:
            _accumulate(p, g)


def run(plan: Plan, node: Any, grads: tuple[torch.Tensor | None, ...] | None) -> bool:
    """W of one group whose graph B kept: :func:`bind` then :func:`run_bound`; False where autograd must run it."""
    bound = bind(plan, node)
    if bound is None:
        return False
    run_bound(bound, grads)
    return True
