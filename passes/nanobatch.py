"""Nanobatch split of a Dynamo-level FX graph (paper section 2.2; docs/design.md data flow step 2).

:func:`split_nanobatches` rewrites the graph a ``torch.compile`` backend receives into one that
runs two independent copies of the computation, nanobatch A on the first ``ceil(B/2)`` batch
elements and nanobatch B on the rest, and recombines their outputs so that the module returns
exactly what the original returns. It runs *before* ``aot_autograd``, so the backward graph that
``aot_autograd`` derives is nanobatched too (each nanobatch's backward is independent; parameter
gradients are summed over the two nanobatches by autograd).

What splits and what is shared comes from batch-dimension propagation
(:mod:`kareus_fx.passes.batch_dims`; custom ``autograd.Function`` and activation-checkpoint
bodies get per-nanobatch copies, DTensor ``from_local``/``redistribute``/``to_local`` are handled
while no placement shards the batch dim). Outputs are recombined only where the graph proves
what they are: a batch-carrying output is concatenated; a sum over the batch is the sum of the
halves' sums; a mean over the batch is the halves' means weighted by their sizes; a class-index
cross-entropy mean is ``(sum_A + sum_B) / (count_A + count_B)`` over per-token losses and the
(class-weighted) counts of non-ignored targets, so ``ignore_index`` padding, class weights,
label smoothing and a nanobatch with no counted token stay exact. Recombination accumulates in
fp32 for bf16/fp16 values. A reduction over the batch may only feed the outputs (shared work),
never batch work. Anything the propagation cannot prove falls back to the unsplit graph with one
:class:`NanobatchFallbackWarning` naming the op and the reason (one per call; Python's warning
filter then shows each distinct reason once). Never wrong numbers.

Assumptions (torch 2.13 Dynamo graphs):

* Parameters and buffers are graph inputs (``inline_inbuilt_nn_modules``). They are recognised by
  any of: the example input is an ``nn.Parameter``; Dynamo tagged the placeholder as a static
  input (``meta["tensor_dict"]["_dynamo_static_input_type"]``, set for parameters, buffers and
  ``mark_static_address`` tensors); its source names ``._parameters[`` / ``._buffers[``.
* The batch size is dim 0 of the first other tensor input (or ``batch_size_hint``); every other
  non-parameter tensor input whose dim 0 equals it carries the batch on dim 0 (activations, ids,
  attention masks, position ids, labels). A wrong guess cannot give wrong numbers: the rules prove
  the graph separable along the chosen dims or the split is refused.
* Only the batch size must be a number. Other sizes may be symbolic (Dynamo's automatic dynamic
  recompile after the sequence length changed, ``mark_dynamic``, ``dynamic=True``): the rules
  compare them as sympy expressions (``s38``, ``4*s38``) without installing guards, and sizes of
  the split graph along symbolic dims (``view(2, s38, 2, 16)``, the narrow of a flattened
  ``(B*T, V)``) are rebuilt as graph nodes from the SymInt inputs or input sizes. A symbolic batch
  size (``dynamic=True``) is specialised with a guard on its value, so another batch size
  recompiles.
* Data-dependent sizes (unbacked symbols, bound by ``.item()``/``.tolist()`` under
  ``capture_scalar_outputs``) are split only along an expert-parallel exchange by token counts
  (:mod:`~kareus_fx.passes.batch_dims.exchange`): each nanobatch's copy of the binding node binds
  its own symbols in the verification's fake run (recorded as ``unbacked_bindings``, as Dynamo
  does, so ``aot_autograd``'s re-trace rebinds its own to them), and the verification refuses a
  node that reads another nanobatch's symbols. A graph that binds them any other way falls back,
  the reason naming the binding.
* Random ops on batch-carrying data fall back unless ``allow_rng=True``: each nanobatch then draws
  its own numbers (a valid draw, but not the unsplit graph's). Random ops on shared values (a mask
  from ``torch.rand(b, s)``) are drawn once, as before, and sliced.

Issue order (the nanobatching baseline, "communication as soon as possible"): nodes are ordered by
a list scheduler that (1) issues a collective as soon as its input is ready, (2) runs the current
nanobatch's computation until it issues a collective (or a custom ``autograd.Function`` that
contains one), then switches to the other nanobatch, whose computation does not depend on that
collective and so can overlap it, and (3) places every ``wait_tensor`` immediately before the first
use of its result. Graph-state switches (grad mode, autocast), in-place ops and random ops are
barriers: nothing moves across them. ``aot_autograd`` traces the forward in this order; the aten
graphs are reordered again later by the scheduler passes.

Every node of the new graph carries ``meta["kareus_nanobatch"]`` (0 = A, 1 = B, None = shared or
both). Nanobatch nodes also carry ``meta["custom"]["kareus_nanobatch"]``, which ``aot_autograd``
copies onto the aten nodes they produce (forward, and backward by ``seq_nr``);
:mod:`kareus_fx.passes.nanobatch_labels` uses it to find the nanobatch entry points in aten graphs.
"""

from __future__ import annotations

import heapq
import operator
import warnings
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx._lazy_graph_module import _make_graph_module
from torch.fx.experimental.symbolic_shapes import guard_int
from torch.utils._sympy.functions import FloorDiv

from kareus_fx.passes.batch_dims import (
    BatchAnalysis,
    BatchDim,
    Body,
    Call,
    FromHalf,
    IndexOffsetBody,
    SliceOf,
    Step,
    Unsupported,
    Whole,
    is_barrier,
    is_symbolic,
    op_name,
)
from kareus_fx.passes.batch_dims.values import _shape, _size
from kareus_fx.passes.nanobatch_verify import FakeRun, verify_split
from kareus_fx.passes.unbacked_symbols import unbacked_symbol_binding

__all__ = [
    "NANOBATCH_META",
    "NanobatchFallbackWarning",
    "NanobatchResult",
    "split_nanobatches",
]

NANOBATCH_META = "kareus_nanobatch"
"""``node.meta`` key (and ``node.meta["custom"]`` key) holding 0 (A), 1 (B) or None."""

# Attributes Dynamo sets on the GraphModule it hands to a backend; copied onto the split module.
_DYNAMO_GM_ATTRS = ("meta", "shape_env", "compile_subgraph_reason", "_param_name_to_source", "_source_to_user_stacks")


# Metadata of a node's traced value: the verification's fake run records the copy's own (a copy
# of an ``.item()`` binds its own unbacked symbol, never the original's).
_TRACE_VALUES = ("example_value", "val", "unbacked_bindings")


class NanobatchFallbackWarning(UserWarning):
    """The nanobatch split was refused; the graph runs unsplit (sequentially)."""


@dataclass(frozen=True)
class NanobatchResult:
    """What :func:`split_nanobatches` did.

    ``gm`` is the split module, or the original one when ``split`` is False (then ``reason`` says
    why). ``batch_inputs`` names the placeholders treated as batch-carrying (all on dim 0);
    ``halves`` are the nanobatch sizes (A, B). ``outputs`` says how each output was recombined:
    ``"cat(dim=d)"``, ``"sum"``, ``"mean"``, ``"ce_mean"`` or ``"shared"``.
    """

    gm: fx.GraphModule
    split: bool
    reason: str | None
    batch_size: int | None
    halves: tuple[int, int] | None
    batch_inputs: tuple[str, ...]
    outputs: tuple[str, ...] = ()


def split_nanobatches(
    gm: fx.GraphModule,
    example_inputs: list,
    *,
    batch_size_hint: int | None = None,
    allow_rng: bool = False,
) -> NanobatchResult:
    """Split a Dynamo-level graph into two nanobatches (see the module docstring).

    ``example_inputs`` are the backend's example inputs (one per placeholder). The input module is
    not modified. On fallback, one :class:`NanobatchFallbackWarning` names the blocking op.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    try:
        batch, batch_phs = _batch_inputs(placeholders, example_inputs, batch_size_hint)
    except Unsupported as e:
        return _fallback(gm, str(e), None, ())
    names = tuple(p.name for p in batch_phs)
    if batch < 2:
        return _fallback(gm, f"batch of {batch} cannot be split", batch, names)
    halves = ((batch + 1) // 2, batch // 2)
    try:
        fake_mode, fake_inputs = _fake_inputs(placeholders, example_inputs)
        vals = _values(gm, placeholders, fake_mode, fake_inputs)
        an = BatchAnalysis(gm, {p: BatchDim(0) for p in batch_phs}, vals, halves, allow_rng=allow_rng).run()
        emitter = _Emitter(an)
        new_gm = emitter.build()
        verify_split(new_gm, fake_mode, fake_inputs, an.halves, emitter.expected, emitter.body_of)
        _interleave(new_gm.graph)
        new_gm.graph.lint()
        new_gm.recompile()
    except Unsupported as e:
        binding = unbacked_symbol_binding(gm)
        if binding is not None:  # data-dependent sizes the split could not give each nanobatch
            return _fallback(gm, f"{binding}, a data-dependent size the split cannot halve: {e}", batch, names)
        return _fallback(gm, str(e), batch, names)
    except Exception as e:  # noqa: BLE001 - a bug here must not break the user's compile: run unsplit
        return _fallback(gm, f"internal error in the nanobatch split: {type(e).__name__}: {e}", batch, names)
    return NanobatchResult(new_gm, True, None, batch, halves, names, tuple(emitter.outputs))


def _fallback(gm, reason: str, batch, names) -> NanobatchResult:
    warnings.warn(
        f"nanobatch split skipped, running the graph unsplit: {reason}", NanobatchFallbackWarning, stacklevel=3
    )
    return NanobatchResult(gm, False, reason, batch, None, names)


# --------------------------------------------------------------------------------------------
# Inputs


def _is_param(node: fx.Node, example: Any) -> bool:
    if isinstance(example, torch.nn.Parameter):
        return True
    if "_dynamo_static_input_type" in node.meta.get("tensor_dict", {}):
        return True
    ev = node.meta.get("example_value")
    if isinstance(ev, torch.nn.Parameter):
        return True
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is not None:
        name = source.name if isinstance(source.name, str) else source.name()
        return "._parameters[" in name or "._buffers[" in name
    return False


def _batch_inputs(placeholders, example_inputs, hint):
    if len(placeholders) != len(example_inputs):
        raise Unsupported(f"{len(example_inputs)} example inputs for {len(placeholders)} placeholders")
    data = []
    for node, ex in zip(placeholders, example_inputs):
        v = node.meta.get("example_value", ex)
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and not _is_param(node, ex):
            data.append((node, v))
    if not data:
        raise Unsupported("no non-parameter tensor input to take the batch from")
    if hint is None:
        _specialize_batch(data[0][0], data[0][1])
    shapes = [(n, _shape(v)) for n, v in data]
    batch = hint if hint is not None else shapes[0][1][0]
    phs = [n for n, s in shapes if s[0] == batch]
    if not phs:
        raise Unsupported(f"no input has batch size {batch} on dim 0")
    return batch, phs


def _specialize_batch(node: fx.Node, value: torch.Tensor) -> None:
    """Make a symbolic batch size concrete (``dynamic=True`` makes every size symbolic).

    The split needs the batch as a number: this guards on its current value through the graph's
    ShapeEnv, so Dynamo recompiles for another batch size while other dims stay symbolic."""
    size = value.shape[0]
    if not isinstance(size, torch.SymInt) or not is_symbolic(_size(size)):
        return
    if size.node.hint is None:
        raise Unsupported(f"the batch dim of {node.name} is symbolic ({size}) with no value to specialize it to")
    guard_int(size)


def _fake_inputs(placeholders, example_inputs):
    fakes = [n.meta.get("example_value") for n in placeholders]
    modes = {id(f.fake_mode): f.fake_mode for f in fakes if isinstance(f, FakeTensor)}
    mode = next(iter(modes.values())) if len(modes) == 1 else None
    if mode is None or any(f is None for f in fakes):
        mode = detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
        fakes = [
            mode.from_tensor(x)
            if isinstance(x, torch.Tensor) and not isinstance(x, torch._subclasses.FakeTensor)
            else x
            for x in example_inputs
        ]
    return mode, fakes


def _values(gm, placeholders, mode, fake_inputs) -> dict[fx.Node, Any]:
    """Full-batch fake values: Dynamo's ``example_value`` metadata, or a fake run without it."""
    tensor_nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    if all("example_value" in n.meta for n in tensor_nodes + placeholders):
        return {n: n.meta.get("example_value") for n in gm.graph.nodes}
    run = FakeRun(gm, mode)
    run.run(*fake_inputs)
    return {
        **run.vals,
        **{n: n.meta.get("example_value") for n in gm.graph.nodes if n not in run.vals and "example_value" in n.meta},
    }


# --------------------------------------------------------------------------------------------
# Emission


class _Emitter:
    """Writes the split graph: shared nodes once, split nodes once per nanobatch."""

    def __init__(self, an: BatchAnalysis, only: int | None = None):
        self.an = an
        self.graph = fx.Graph()
        self.only = only  # emit a single nanobatch (a per-nanobatch HOP body)
        self.shared: dict[fx.Node, fx.Node] = {}
        self.half: list[dict[fx.Node, fx.Node]] = [{}, {}]
        self.slices: dict[tuple, fx.Node] = {}
        self.bodies: dict[tuple, str] = {}
        self.new_attrs: dict[str, Any] = {}
        # new node -> (full-batch fake value of the node it copies, its info, its nanobatch)
        self.expected: dict[fx.Node, tuple[Any, Any, int | None]] = {}
        self.body_of: dict[fx.Node, tuple[fx.GraphModule, fx.GraphModule]] = {}
        self.outputs: list[str] = []  # how each output was recombined
        # Where each shape symbol can be read in the new graph: a SymInt placeholder, or a
        # (tensor placeholder, dim) whose size it is; and the nodes already built for expressions.
        self.symbol_sources: dict[sympy.Symbol, fx.Node | tuple[fx.Node, int]] = {}
        self.sym_nodes: dict[sympy.Expr, fx.Node] = {}

    # ---- node creation -------------------------------------------------------------------

    def _new(self, op, target, args, kwargs, h, like: fx.Node | None = None, name=None) -> fx.Node:
        n = self.graph.create_node(op, target, args, kwargs, name=name)
        if like is not None:
            n.meta = {k: v for k, v in like.meta.items() if k not in _TRACE_VALUES}
        n.meta[NANOBATCH_META] = h
        if h is not None:
            n.meta["custom"] = {**n.meta.get("custom", {}), NANOBATCH_META: h}
        elif isinstance(n.meta.get("custom"), dict) and NANOBATCH_META in n.meta["custom"]:
            n.meta["custom"] = {k: v for k, v in n.meta["custom"].items() if k != NANOBATCH_META}
        return n

    def _fn(self, fn, *args, h=None, **kwargs) -> fx.Node:
        return self._new("call_function", fn, args, kwargs, h)

    def lookup(self, a: Any, h: int | None) -> Any:
        if isinstance(a, fx.Node):
            if h is not None and a in self.half[h]:
                return self.half[h][a]
            if a not in self.shared:
                raise Unsupported(f"internal: {a.name} has no shared value")
            return self.shared[a]
        if isinstance(a, sympy.Basic):
            return self._sym(a)
        if isinstance(a, (SliceOf, Body, IndexOffsetBody)):
            if h is None:
                raise Unsupported(f"internal: {a!r} belongs to one nanobatch but is used in a shared call")
            if isinstance(a, IndexOffsetBody):
                return self._index_offset_body(a, h)
            return self._slice(a, h) if isinstance(a, SliceOf) else self._body(a, h)
        if isinstance(a, FromHalf):
            return self.half[a.h][a.node]
        if isinstance(a, Whole):
            return self.shared[a.node]
        return a

    def _map(self, args: Any, h: int | None) -> Any:
        return fx.node.map_aggregate(args, lambda a: self.lookup(a, h))

    def _slice(self, s: SliceOf, h: int) -> fx.Node:
        key = (s.node, s.batch, h)
        if key not in self.slices:
            b = s.batch
            start = 0 if h == 0 else self.an.halves[0] * b.k
            length = self.an.halves[h] * b.k
            self.slices[key] = self._fn(
                torch.narrow, self.lookup(s.node, None), b.dim, self.lookup(start, None), self.lookup(length, None), h=h
            )
        return self.slices[key]

    def _sym(self, expr: sympy.Basic) -> int | fx.Node:
        """A symbolic size as an int or as graph nodes computing it from the graph's inputs
        (a size of the split graph along a symbolic dim, ``2*s38`` for a nanobatch)."""
        if expr.is_Integer:
            return int(expr)
        if expr in self.sym_nodes:
            return self.sym_nodes[expr]
        if expr.is_Symbol:
            source = self.symbol_sources.get(expr)
            if source is None:
                raise Unsupported(f"symbolic size {expr} is not readable from any graph input")
            node = source if isinstance(source, fx.Node) else self._new("call_method", "size", source, {}, None)
        elif expr.is_Add or expr.is_Mul:
            fold = operator.add if expr.is_Add else operator.mul
            parts = [self._sym(a) for a in expr.args]  # two or more: sympy flattens a sum or product
            node = self._fn(fold, parts[0], parts[1])
            for part in parts[2:]:
                node = self._fn(fold, node, part)
        elif isinstance(expr, FloorDiv):
            node = self._fn(operator.floordiv, self._sym(expr.args[0]), self._sym(expr.args[1]))
        else:
            raise Unsupported(f"symbolic size {expr} has a form the split does not rebuild")
        self.sym_nodes[expr] = node
        return node

    def _note_symbols(self, placeholder: fx.Node, value: Any) -> None:
        """Record which shape symbols a new placeholder gives access to (first one wins)."""
        if isinstance(value, torch.SymInt):
            expr = value.node.expr
            if expr.is_Symbol:
                self.symbol_sources.setdefault(expr, placeholder)
        elif isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            for d, size in enumerate(_shape(value)):
                if is_symbolic(size) and size.is_Symbol:
                    self.symbol_sources.setdefault(size, (placeholder, d))

    def _body(self, body: Body, h: int) -> fx.Node:
        key = (body.target, h)
        if key not in self.bodies:
            name = f"{body.target}_nb{h}"
            sub = _Emitter(body.analysis, only=h)
            self.new_attrs[name] = sub.build_body()
            self.bodies[key] = name
            self.expected.update(sub.expected)
            self.body_of.update(sub.body_of)
        return self._new("get_attr", self.bodies[key], (), {}, h)

    def _index_offset_body(self, body: IndexOffsetBody, h: int) -> fx.Node:
        """A flex_attention score/mask function whose batch index is nanobatch ``h``'s global one."""
        offset = sum(self.an.halves[:h])
        if offset == 0:
            return self._new("get_attr", body.target, (), {}, h)
        key = (body.target, h)
        if key not in self.bodies:
            name = f"{body.target}_nb{h}"
            self.new_attrs[name] = _shift_batch_index(_fetch(self.an.gm, body.target), body.pos, offset)
            self.bodies[key] = name
        return self._new("get_attr", self.bodies[key], (), {}, h)

    # ---- graphs --------------------------------------------------------------------------

    def _emit_node(self, node: fx.Node, step: Step, h: int | None) -> fx.Node:
        call = (
            step.call(h if h is not None else 0)
            if step.call is not None
            else Call(node.op, node.target, tuple(node.args), dict(node.kwargs))
        )
        new = self._new(call.op, call.target, self._map(call.args, h), self._map(call.kwargs, h), h, like=node)
        info = step.info if h is not None else None
        like = node
        if step.combine is not None:  # a nanobatch's part of a recombined reduction
            info = step.combine_args.get("half_info")  # per-token losses are laid out like
            like = step.combine_args.get("half_like", node)  # the targets; else full shape
        self.expected[new] = (self.an.vals.get(like), info, h)
        if h is not None and call.args and isinstance(call.args[0], Body):
            self.body_of[new] = tuple(
                self.new_attrs[str(a.target)] for a in new.args if isinstance(a, fx.Node) and a.op == "get_attr"
            )
        return new

    def _emit_all(self) -> None:
        for node in self.an.graph.nodes:
            if node.op == "output":
                self._emit_output(node)
                continue
            step = self.an.steps[node]  # the analysis decided every node but the output
            if node.op == "placeholder":
                new = self._new("placeholder", node.target, (), {}, None, like=node, name=node.name)
                new.type = node.type
                if hasattr(node, "_dynamo_source"):  # aot_autograd maps inputs to sources by it
                    new._dynamo_source = node._dynamo_source
                self.shared[node] = new
                self._note_symbols(new, self.an.vals.get(node))
                if self.only is not None:  # a body's inputs are already one nanobatch's values
                    self.half[self.only][node] = new
                    self.expected[new] = (self.an.vals.get(node), step.info, self.only)
                    continue
                self.expected[new] = (self.an.vals.get(node), None, None)
                if isinstance(step.info, BatchDim):
                    for h in self._halves():
                        self.half[h][node] = self._slice(SliceOf(node, step.info), h)
            elif not step.split:
                self.shared[node] = self._emit_node(node, step, None)
            else:
                for h in self._halves():
                    self.half[h][node] = self._emit_node(node, step, h)
                if step.combine is not None:
                    self.shared[node] = self._combine(node, step)

    def _halves(self):
        return (0, 1) if self.only is None else (self.only,)

    def build(self) -> fx.GraphModule:
        self._emit_all()
        self._drop_unused_attrs()
        gm = _graph_module(self.an.gm, self.graph, self.new_attrs)
        for attr in _DYNAMO_GM_ATTRS:
            if hasattr(self.an.gm, attr):
                setattr(gm, attr, getattr(self.an.gm, attr))
        return gm

    def build_body(self) -> fx.GraphModule:
        self._emit_all()
        self._drop_unused_attrs()
        return _graph_module(self.an.gm, self.graph, self.new_attrs)

    def _drop_unused_attrs(self) -> None:
        """The original HOP bodies once every HOP call uses its per-nanobatch copies."""
        for n in list(self.graph.nodes):
            if n.op == "get_attr" and not n.users:
                self.graph.erase_node(n)

    # ---- recombination -------------------------------------------------------------------

    def _combine(self, node: fx.Node, step: Step) -> fx.Node:
        """One shared value from the two nanobatches' parts, accumulated in fp32 at least."""
        a, b = self.half[0][node], self.half[1][node]
        dtype = self.an.vals[node].dtype
        acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

        def up(x: fx.Node, h: int) -> fx.Node:
            return x if dtype == acc else self._new("call_method", "to", (x, acc), {}, h)

        b_a, b_b = self.an.halves
        if step.combine == "sum":
            out = self._fn(operator.add, up(a, 0), up(b, 1))
        elif step.combine == "mean":
            total = b_a + b_b
            out = self._fn(
                operator.add,
                self._fn(operator.mul, up(a, 0), b_a / total, h=0),
                self._fn(operator.mul, up(b, 1), b_b / total, h=1),
            )
        else:  # ce_mean: (sum_A + sum_B) / (count_A + count_B), counts of non-ignored targets
            ignore = step.combine_args["ignore_index"]
            weight = step.combine_args["weight"]
            per_token_call = step.call
            if per_token_call is None:  # the cross-entropy rule sets it with its ce_mean combine
                raise Unsupported(f"{node.name}: a ce_mean recombination without the per-token loss call")
            sums, counts = [], []
            for h, part in ((0, a), (1, b)):
                sums.append(self._new("call_method", "sum", (up(part, h),), {}, h))
                call = per_token_call(h)
                tgt = self._map(call.args[1] if len(call.args) > 1 else call.kwargs["target"], h)
                valid = self._fn(operator.ne, tgt, ignore, h=h)
                if weight is not None:  # mean over the class weights of the counted targets
                    safe = self._new("call_method", "clamp", (tgt,), {"min": 0}, h)
                    picked = self._fn(operator.getitem, self.lookup(weight, None), safe, h=h)
                    valid = self._fn(operator.mul, picked, valid, h=h)
                counts.append(self._new("call_method", "sum", (valid,), {}, h))
            out = self._fn(operator.truediv, self._fn(operator.add, *sums), self._fn(operator.add, *counts))
        if dtype != acc:
            out = self._new("call_method", "to", (out, dtype), {}, None)
        self.expected[out] = (self.an.vals.get(node), None, None)
        return out

    def _emit_output(self, node: fx.Node) -> None:
        cache: dict[fx.Node, fx.Node] = {}

        def one(a):
            if not isinstance(a, fx.Node):
                self.outputs.append("constant")
                return a
            step = self.an.steps[a]
            info = self.an.infos.get(a)
            how: str = "shared" if step.combine is None else step.combine
            if isinstance(info, BatchDim):
                if a.op == "placeholder":
                    out = self.shared[a]
                elif a in cache:
                    out = cache[a]
                else:
                    if info.p != 1:
                        raise Unsupported(f"output {a.name} holds the batch {info.p} times over")
                    if info.order is not None:
                        raise Unsupported(f"output {a.name} holds routed rows, not in batch order")
                    out = self._fn(torch.cat, [self.half[0][a], self.half[1][a]], info.dim)
                    self.expected[out] = (self.an.vals.get(a), None, None)
                    cache[a] = out
                how = f"cat(dim={info.dim})"
            elif info is None:
                out = self.shared[a]
            else:
                raise Unsupported(f"output {a.name} ({op_name(a)}) is a {info!r} value")
            self.outputs.append(how)
            return out

        if self.only is not None:
            out_args = fx.node.map_aggregate(node.args[0], lambda a: self.lookup(a, self.only))
        else:
            out_args = fx.node.map_aggregate(node.args[0], one)
        out = self.graph.output(out_args)
        out.meta = {**node.meta, NANOBATCH_META: None}


def _graph_module(orig: fx.GraphModule, graph: fx.Graph, new_attrs: dict) -> fx.GraphModule:
    """A module for ``graph``, of the class Dynamo itself builds (``_make_graph_module``): a
    ``_LazyGraphModule`` unless ``TORCH_COMPILE_USE_LAZY_GRAPH_MODULE=0``. Its Python code is
    generated only if something calls or prints it; ``aot_autograd`` and the HOPs run graphs
    through ``fx.Interpreter``, so the several hundred HOP bodies of a deep model never need it."""
    root = {}
    for n in graph.nodes:
        if n.op in ("get_attr", "call_module"):
            root[n.target] = new_attrs[n.target] if n.target in new_attrs else _fetch(orig, n.target)
    return _make_graph_module(root, graph, class_name=type(orig).__name__)


def _shift_batch_index(fn: fx.GraphModule, pos: int, offset: int) -> fx.GraphModule:
    """A copy of ``fn`` in which placeholder ``pos`` (a batch index) reads as itself + ``offset``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(fn.graph, env))
    index = [n for n in graph.nodes if n.op == "placeholder"][pos]
    with graph.inserting_after(index):
        shifted = graph.call_function(operator.add, (index, offset))
    index.replace_all_uses_with(shifted, delete_user_cb=lambda user: user is not shifted)
    return _make_graph_module(fn, graph, class_name=type(fn).__name__)


def _fetch(mod, target: str):
    for part in target.split("."):
        mod = getattr(mod, part)
    return mod


# --------------------------------------------------------------------------------------------
# Issue order


def _node_kind(n: fx.Node) -> str:
    name = op_name(n)
    if name == "c10d.wait_tensor":
        return "wait"
    if name.startswith("c10d."):
        return "collective"
    if _has_collective(n):
        return "comm_compute"  # a HOP (autograd.Function, checkpoint) with a collective inside
    return "compute"


def graph_communicates(gm: fx.GraphModule, example_inputs: list) -> bool:
    """Whether a Dynamo-level graph issues collectives (the only reason to split it).

    Collectives show up as functional-collective calls, inside higher-order ops (autograd.Function
    bodies, checkpoints), or, for DTensor models, only after dispatch: a DTensor input counts.
    """
    from torch.distributed.tensor import DTensor

    if any(isinstance(x, DTensor) for x in example_inputs):
        return True
    return any(op_name(n).startswith("c10d.") or _has_collective(n) for n in gm.graph.nodes)


def _has_collective(n: fx.Node) -> bool:
    if not isinstance(n.target, torch._ops.HigherOrderOperator):
        return False
    gm = n.graph.owning_module
    for a in n.args:
        if isinstance(a, fx.Node) and a.op == "get_attr":
            body = _fetch(gm, str(a.target))
            if isinstance(body, fx.GraphModule) and any(
                op_name(m).startswith("c10d.") or _has_collective(m) for m in body.graph.nodes
            ):
                return True
    return False


def _interleave(graph: fx.Graph) -> None:
    """Reorder ``graph`` in place into the nanobatching issue order (module docstring)."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    segments: list[list[fx.Node]] = []
    cur: list[fx.Node] = []
    for n in nodes:
        if is_barrier(n):
            segments += [cur, [n]]
            cur = []
        else:
            cur.append(n)
    segments.append(cur)
    order = []
    for seg in segments:
        order += _schedule_segment(seg)
    anchor = (
        next(n for n in reversed(graph.nodes) if n.op == "placeholder")
        if any(n.op == "placeholder" for n in graph.nodes)
        else None
    )
    for n in order:
        if anchor is None:
            graph._root.append(n)  # pragma: no cover - graphs always have placeholders here
        else:
            anchor.append(n)
        anchor = n


def _schedule_segment(seg: list[fx.Node]) -> list[fx.Node]:
    index = {n: i for i, n in enumerate(seg)}
    waiting = {n: sum(1 for a in n.all_input_nodes if a in index) for n in seg}
    label = {n: n.meta.get(NANOBATCH_META) for n in seg}
    kind = {n: _node_kind(n) for n in seg}
    issued: dict[fx.Node, int] = {}
    heaps: dict[Any, list] = {"collective": [], "wait": [], 0: [], 1: [], None: []}

    def push(n):
        k = kind[n]
        if k == "collective":
            heapq.heappush(heaps["collective"], (index[n], n))
        elif k == "wait":
            src = n.args[0]
            heapq.heappush(heaps["wait"], (issued.get(src, -1) if isinstance(src, fx.Node) else -1, index[n], n))
        else:
            heapq.heappush(heaps[label[n]], (index[n], n))

    for n in seg:
        if waiting[n] == 0:
            push(n)
    order: list[fx.Node] = []
    current = 0

    def emit(n):
        order.append(n)
        if kind[n] == "collective":
            issued[n] = len(order)
        for u in n.users:
            if u in waiting:
                waiting[u] -= 1
                if waiting[u] == 0:
                    push(u)

    while len(order) < len(seg):
        if heaps["collective"]:
            n = heapq.heappop(heaps["collective"])[-1]
            emit(n)
            if label[n] == current:
                current = 1 - current
            continue
        mine = [h for h in (current, None) if heaps[h]]
        if mine:
            h = min(mine, key=lambda x: heaps[x][0][0])
            n = heapq.heappop(heaps[h])[-1]
            emit(n)
            if kind[n] == "comm_compute" and label[n] == current:
                current = 1 - current
            continue
        if heaps[1 - current]:
            current = 1 - current
            continue
        n = heapq.heappop(heaps["wait"])[-1]
        emit(n)
        h = label[n]
        if h is not None:
            current = h
    return order
