"""The propagation driver (:class:`BatchAnalysis`) and the rule registry the op families fill.

The driver walks a graph in order and decides every node (a :class:`~.values.Step`). A node whose
inputs are all shared needs no rule: it runs once, exactly as before. A node that touches the batch
is decided by the rule registered for its canonical name (:func:`~.op_names.op_name`); nothing is
assumed about an op without one, so it is refused (:class:`~.values.Unsupported`) and the caller
keeps the unsplit graph. Three policies stay in the driver because they hold for every op: in-place
ops on batch data are refused unless an in-place rule (:func:`register_inplace_rule`) proves them
exact, random ops on batch data are refused unless the caller allows them,
and inside an ``autograd.Function`` backward a nanobatch's part of a batch sum
(:data:`~.values.PARTIAL`) may pass only through ops that register a partial-sum rule (linear ops).

Rules register with :func:`register_batch_rule` / :func:`register_partial_rule`, one module per op
family, the way ``torch.distributed.tensor._ops`` registers sharding strategies; the package
``__init__`` imports every family, so importing anything from the package sees all rules. Shared
rule helpers live here too: the generic elementwise rule (:meth:`BatchAnalysis._pointwise`), the
slicing of shared operands, the recombined reduction over the batch, and argument readers that
refuse what they cannot read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx as fx

from kareus_fx.passes.batch_dims.node_args import _arg, _same_call
from kareus_fx.passes.batch_dims.op_names import (
    dropout_inactive,
    is_exchanged,
    is_inplace,
    is_rng,
    name_torch_objects,
    op_name,
)
from kareus_fx.passes.batch_dims.values import (
    PARTIAL,
    BatchDim,
    Call,
    Combine,
    Info,
    SliceOf,
    Step,
    Unsupported,
    _is_split,
    _shape,
)

BatchRule = Callable[["BatchAnalysis", fx.Node, str], Step]
"""``rule(analysis, node, name) -> Step`` for a node that touches the batch (``name`` is the node's
canonical op name); it raises :class:`~.values.Unsupported` (``analysis._fail``) when the split is
not provably exact."""


class BatchRuleRegistry:
    """Canonical op name -> batch rule, and -> partial-sum rule.

    One rule per name, so a family cannot shadow another by accident: registering a name twice is
    an error unless the later registration says ``replace=True``, which in turn requires the name to
    be registered already. A module that refines a rule (e.g. ``sort`` when it routes tokens)
    imports the module that registered it, reads the old rule with :meth:`rule` to fall back on,
    and replaces it. Registering a name also makes :func:`~.op_names.op_name` call the ``torch``,
    ``torch.nn.functional`` and ``Tensor`` objects of that name by it.
    """

    def __init__(self) -> None:
        self._rules: dict[str, BatchRule] = {}
        self._partial_rules: dict[str, BatchRule] = {}
        self._inplace_rules: dict[str, BatchRule] = {}

    def register(self, *names: str, replace: bool = False) -> Callable[[BatchRule], BatchRule]:
        """Decorator: the rule decides every node whose op is one of ``names``."""
        return _registrar(self._rules, names, replace)

    def register_partial(self, *names: str, replace: bool = False) -> Callable[[BatchRule], BatchRule]:
        """Decorator: the rule decides a node of one of ``names`` whose batch inputs are parts of a
        batch sum (:data:`~.values.PARTIAL`); an op without one refuses them as non-linear."""
        return _registrar(self._partial_rules, names, replace)

    def register_inplace(self, *names: str, replace: bool = False) -> Callable[[BatchRule], BatchRule]:
        """Decorator: the rule decides an in-place op of one of ``names`` on batch data (the driver
        refuses an in-place op without one: a mutation is exact per nanobatch only when the rule
        proves the mutated tensor aliases the same data split and unsplit)."""
        return _registrar(self._inplace_rules, names, replace)

    def rule(self, name: str) -> BatchRule | None:
        """The batch rule of op ``name``, if one is registered."""
        return self._rules.get(name)

    def partial_rule(self, name: str) -> BatchRule | None:
        """The partial-sum rule of op ``name``, if one is registered."""
        return self._partial_rules.get(name)

    def inplace_rule(self, name: str) -> BatchRule | None:
        """The in-place rule of op ``name``, if one is registered."""
        return self._inplace_rules.get(name)

    def rule_to_refine(self, name: str, inplace: bool = False) -> BatchRule:
        """The registered (in-place) rule of op ``name`` that a later family wraps; a family that
        refines a rule nobody registered is a wiring error, raised at import."""
        rule = self.inplace_rule(name) if inplace else self.rule(name)
        if rule is None:
            raise ValueError(f"no rule for {name!r} to refine")
        return rule


def _registrar(table: dict[str, BatchRule], names: Sequence[str], replace: bool) -> Callable[[BatchRule], BatchRule]:
    def register(rule: BatchRule) -> BatchRule:
        for name in names:
            if replace and name not in table:
                raise ValueError(f"no rule for {name!r} to replace")
            if not replace and name in table:
                raise ValueError(f"{name!r} already has a rule ({table[name].__qualname__}); pass replace=True")
        name_torch_objects(*names)
        table.update(dict.fromkeys(names, rule))
        return rule

    return register


BATCH_RULES = BatchRuleRegistry()
"""The rules :class:`BatchAnalysis` applies; the op-family modules of this package fill it."""
register_batch_rule = BATCH_RULES.register
register_partial_rule = BATCH_RULES.register_partial
register_inplace_rule = BATCH_RULES.register_inplace


def passes_partial(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """Partial-sum rule of ops that act entry by entry and linearly (views, copies, conversions,
    negation): a part of a batch sum stays one."""
    return Step(PARTIAL, True)


@dataclass(frozen=True)
class Body:
    """Marker in a rewritten argument: a per-nanobatch copy of a HOP body (``get_attr`` target)."""

    target: str
    analysis: BatchAnalysis


class BatchAnalysis:
    """Batch propagation over one graph (the Dynamo graph, or a HOP body in ``mode="body"``).

    ``vals`` maps nodes to their fake values for the full batch (``node.meta["example_value"]``).
    ``halves`` are the two nanobatch sizes. After :meth:`run`, ``steps[node]`` holds the decision.
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        input_infos: dict[fx.Node, Info],
        vals: dict[fx.Node, Any],
        halves: tuple[int, int],
        *,
        mode: Literal["main", "body"] = "main",
        allow_rng: bool = False,
    ) -> None:
        self.gm = gm
        self.graph = gm.graph
        self.vals = vals
        self.halves = halves
        self.batch = halves[0] + halves[1]
        self.mode = mode
        self.allow_rng = allow_rng
        self.infos: dict[fx.Node, Info] = dict(input_infos)
        self.steps: dict[fx.Node, Step] = {}
        self.output_infos: Any = None

    # ---- helpers -------------------------------------------------------------------------

    def info(self, a: Any) -> Info:
        return self.infos.get(a) if isinstance(a, fx.Node) else None

    def shape(self, a: fx.Node) -> tuple[int, ...]:
        v = self.vals.get(a)
        if not isinstance(v, torch.Tensor):
            raise Unsupported(f"no tensor metadata for node {a.name!r}")
        return _shape(v)

    def half_shape(self, shape: tuple[int, ...], info: BatchDim, h: int) -> tuple[int, ...]:
        if is_exchanged(info):
            raise Unsupported(f"a size of {info}, rows received by an exchange, is known only when the graph runs")
        s = list(shape)
        s[info.dim] = info.size(self.halves[h])
        return tuple(s)

    def _fail(self, node: fx.Node, why: str) -> Unsupported:
        return Unsupported(f"{op_name(node)} ({node.name}): {why}")

    # ---- driver --------------------------------------------------------------------------

    def run(self) -> BatchAnalysis:
        for node in self.graph.nodes:
            if node.op == "placeholder":
                info = self.infos.get(node)
                self.infos[node] = info
                self.steps[node] = Step(info, _is_split(info))
            elif node.op == "output":
                self.output_infos = fx.node.map_arg(node.args[0], self.info)
            else:
                step = self._step(node)
                self.steps[node] = step
                self.infos[node] = step.info
        if self.mode == "main":
            self._check_reductions_are_sinks()
        return self

    def _step(self, node: fx.Node) -> Step:
        if node.op == "get_attr":
            return Step(None, False)
        inputs = node.all_input_nodes
        touched = [i for i in inputs if _is_split(self.infos.get(i))]
        if is_inplace(node):
            if not touched:
                return Step(None, False)
            inplace = BATCH_RULES.inplace_rule(op_name(node))
            if inplace is None:
                raise self._fail(node, "in-place op on a batch-carrying tensor")
            return inplace(self, node, op_name(node))
        if not touched:
            # Runs once on shared values, exactly as in the original graph.
            return Step(None, False)
        if node.op != "call_function" and node.op != "call_method":
            raise self._fail(node, "module calls have no batch rule")
        name = op_name(node)
        if any(self.infos.get(i) is PARTIAL for i in touched):
            return self._partial_step(node, name)
        random = is_rng(node)
        if random and not self.allow_rng and not dropout_inactive(node, name):
            raise self._fail(
                node,
                "random op on batch-carrying data (each nanobatch would "
                "draw different numbers); pass allow_rng=True to split anyway",
            )
        rule = BATCH_RULES.rule(name)
        if rule is None:
            raise self._fail(node, "random op with no batch rule" if random else "no batch rule for this op")
        return rule(self, node, name)

    def _check_reductions_are_sinks(self) -> None:
        """A reduction over the batch may only feed shared work (the loss), never batch work:
        otherwise nanobatch B would wait on A (batch-norm style) and the split buys nothing."""
        for node, step in self.steps.items():
            if step.combine is None:
                continue
            todo, seen = list(node.users), set()
            while todo:
                u = todo.pop()
                if u in seen or u.op == "output":
                    continue
                seen.add(u)
                if self.steps[u].split:
                    raise Unsupported(
                        f"{op_name(node)} ({node.name}): reduction over the batch dim inside the "
                        f"graph feeds batch computation ({op_name(u)} at {u.name})"
                    )
                todo.extend(u.users)

    # ---- generic rules -------------------------------------------------------------------

    def _pointwise(self, node: fx.Node, operands: list[Any], out_shape=None) -> Step:
        """Broadcasting elementwise op over ``operands`` (the tensor arguments that take part)."""
        out_shape = out_shape if out_shape is not None else self.shape(node)
        nd = len(out_shape)
        out: BatchDim | None = None
        for a in operands:
            i = self.info(a)
            if isinstance(i, BatchDim):
                d = i.dim + nd - len(self.shape(a))
                cand = i.moved(d)
                if out is not None and out != cand:
                    raise self._fail(node, f"operands carry the batch on different dims ({out} vs {cand})")
                out = cand
            elif i is not None:
                raise self._fail(node, f"unexpected operand kind {i!r}")
        if out is None:
            raise self._fail(node, "no batch-carrying operand")
        slices = self._shared_slices(node, operands, out, out_shape)
        return Step(out, True, self._with_slices(node, slices))

    def _shared_slices(self, node, operands, out: BatchDim, out_shape) -> dict[int, SliceOf]:
        """Shared operands with a batch-sized dim where the output has the batch: slice them."""
        nd = len(out_shape)
        slices = {}
        for a in operands:
            if not isinstance(a, fx.Node) or self.info(a) is not None:
                continue
            v = self.vals.get(a)
            if not isinstance(v, torch.Tensor):
                continue
            s = self.shape(a)
            j = out.dim - (nd - len(s))
            if j < 0 or s[j] == 1:
                continue
            if s[j] != out_shape[out.dim] or out.p != 1 or out.order is not None:
                raise self._fail(node, f"shared operand {a.name} cannot be sliced along dim {j}")
            slices[id(a)] = SliceOf(a, out.moved(j))
        return slices

    def _with_slices(self, node: fx.Node, slices: dict[int, SliceOf], base=None):
        if not slices and base is None:
            return None

        def call(h: int) -> Call:
            c = base(h) if base is not None else _same_call(node)
            sub = lambda a: slices.get(id(a), a)  # noqa: E731
            c.args = tuple(_map_nested(c.args, sub))
            c.kwargs = dict(zip(c.kwargs, _map_nested(tuple(c.kwargs.values()), sub)))
            return c

        return call

    def _partial_step(self, node: fx.Node, name: str) -> Step:
        """Ops on a nanobatch's part of a batch sum (backward bodies only): the op's partial-sum
        rule decides; an op without one is taken as non-linear and refused."""
        ins = [self.info(a) for a in node.all_input_nodes]
        if any(isinstance(i, BatchDim) for i in ins):
            raise self._fail(node, "mixes a partial batch sum with batch-carrying data")
        rule = BATCH_RULES.partial_rule(name)
        if rule is None:
            raise self._fail(node, "non-linear op on a partial batch sum")
        return rule(self, node, name)

    def _reduction_over_batch(self, node: fx.Node, kind: Combine, **combine_args: Any) -> Step:
        if any(is_exchanged(self.info(a)) for a in node.all_input_nodes):
            # the halves' shares of the rows are data-dependent: a size-weighted mean would be wrong
            raise self._fail(node, "reduction over rows received by an exchange")
        if self.mode == "body":
            if kind == "sum":
                return Step(PARTIAL, True)
            raise self._fail(node, f"{kind} over the batch dim inside an autograd.Function")
        return Step(None, True, combine=kind, combine_args=combine_args)


def _map_nested(args: tuple, fn) -> list:
    out = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out.append(type(a)(_map_nested(tuple(a), fn)))
        else:
            out.append(fn(a))
    return out


# --------------------------------------------------------------------------------------------
# Argument readers for rules: Unsupported (the graph stays unsplit) when an argument is not what
# the rule can reason about.


def _node_arg(an: BatchAnalysis, node: fx.Node, pos: int, name: str = "") -> fx.Node:
    """Argument ``pos`` (or keyword ``name``) of ``node`` as a graph node (a tensor the rules read
    the shape of). Unsupported, so the graph is left unsplit, when it is a constant instead."""
    a = _arg(node, pos, name)
    if not isinstance(a, fx.Node):
        raise an._fail(node, f"argument {name or pos} is {a!r}, not a tensor")
    return a


def _int_arg(an: BatchAnalysis, node: fx.Node, pos: int, name: str = "", default: int | None = None) -> int:
    """Argument ``pos`` (or keyword ``name``, else ``default``) of ``node`` as a Python int (a
    dim, a group size). Unsupported when it is anything else (a symbolic size, a tensor)."""
    a = _arg(node, pos, name, default)
    if not isinstance(a, int):
        raise an._fail(node, f"argument {name or pos} is {a!r}, not an int")
    return a


def _seq_arg(an: BatchAnalysis, node: fx.Node, pos: int, name: str) -> Sequence[fx.node.Argument]:
    """Argument ``pos`` (or keyword ``name``) of ``node`` as a list or tuple (sizes, tensors).
    Unsupported when it is anything else."""
    a = _arg(node, pos, name)
    if not isinstance(a, (list, tuple)):
        raise an._fail(node, f"argument {name} is {a!r}, not a list")
    return a


def _int_list(an: BatchAnalysis, node: fx.Node, value: object) -> list[int]:
    """A dims argument of ``node`` (an int, or a list or tuple of ints) as a list; Unsupported
    otherwise."""
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        ints = [v for v in value if isinstance(v, int)]
        if len(ints) == len(value):
            return ints
    raise an._fail(node, f"dims {value!r} are not a list of ints")
