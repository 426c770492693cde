"""Batch-dimension propagation over a Dynamo-level FX graph (the analysis half of the nanobatch split).

Given which graph inputs carry the batch (and along which dim), decide for every node whether its
value carries the batch and where, so that the graph can be run as two independent copies on the
two halves of the batch (:mod:`kareus_fx.passes.nanobatch` does the rewriting).

The graph is the one a ``torch.compile`` backend receives: torch-level calls (``call_function`` on
``torch.*`` / ``torch.nn.functional.*`` / ``operator.*``, ``call_method`` on tensors), functional
collectives (``torch.ops._c10d_functional.*``) and the ``autograd_function_apply`` higher-order op
that Dynamo emits for a custom ``torch.autograd.Function``.

What a value can be (:data:`Info`):

* ``None``: shared. It does not depend on the batch (parameters, buffers, constants, masks made
  from ``torch.ones(t, t)``): computed once and used by both nanobatches. A shared tensor that has
  a batch-sized dim aligned with a batch dim of the op it feeds is sliced per nanobatch there.
* :class:`BatchDim`: dim ``dim`` holds the batch, laid out ``(p, B, k)``: ``p`` outer copies
  (an all-gather along the batch dim makes ``p`` = group size), the ``B`` batch elements, then
  ``k`` consecutive entries per element (``flatten(0, 1)`` of ``(B, T, V)`` gives ``k = T``).
  A nanobatch of ``b`` elements has size ``p * b * k`` there. Every entry depends only on its own
  batch element, so slicing commutes with the op: that is what the rules below check.
* :data:`PARTIAL`: only inside the backward of an ``autograd.Function``: a shared-shaped value that
  is a nanobatch's *part* of a sum over the batch (the weight gradient ``x^T g``). Autograd adds the
  two parts because the shared input is used by both nanobatch calls; so a part may only flow
  through linear ops to the gradient of a shared input.
* a tuple of the above, for ops that return several values (``chunk``, ``max(dim)``, the HOP).

A rule either returns a :class:`Step` or raises :class:`Unsupported` naming the op; the caller then
falls back to the unsplit graph. Nothing is assumed about ops without a rule: a node whose inputs
are all shared needs no rule (it runs once, exactly as before); one that touches the batch does.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.nn.functional as F

from kareus_fx.errors import UnsupportedGraphError

__all__ = [
    "PARTIAL",
    "BatchAnalysis",
    "BatchDim",
    "Body",
    "Call",
    "Info",
    "Size",
    "SliceOf",
    "Step",
    "Unsupported",
    "is_symbolic",
    "op_name",
]


class Unsupported(UnsupportedGraphError):
    """The graph cannot be proved safe to split; the message names the op and the reason."""


@dataclass(frozen=True)
class BatchDim:
    """Dim ``dim`` carries the batch, laid out ``(p, B, k)`` (see the module docstring)."""

    dim: int
    k: int = 1
    p: int = 1

    def size(self, b: int) -> int:
        """Size of the dim for a (nano)batch of ``b`` elements."""
        return self.p * b * self.k

    def moved(self, dim: int) -> BatchDim:
        return BatchDim(dim, self.k, self.p)


class _Partial:
    def __repr__(self) -> str:
        return "PARTIAL"


PARTIAL = _Partial()
Info = Any  # None | BatchDim | PARTIAL | tuple[Info, ...]


def _is_split(info: Info) -> bool:
    """Whether a value has one copy per nanobatch."""
    if isinstance(info, tuple):
        return any(_is_split(i) for i in info)
    return info is not None


@dataclass(frozen=True)
class SliceOf:
    """Marker in a rewritten argument: the nanobatch's slice of a shared tensor along ``batch``."""

    node: fx.Node
    batch: BatchDim


@dataclass(frozen=True)
class Body:
    """Marker in a rewritten argument: a per-nanobatch copy of a HOP body (``get_attr`` target)."""

    target: str
    analysis: BatchAnalysis


@dataclass
class Call:
    """How one nanobatch's copy of a node is emitted (arguments may hold markers)."""

    op: str
    target: Any
    args: tuple
    kwargs: dict


Combine = Literal["sum", "mean", "ce_mean"]


@dataclass
class Step:
    """The decision for one node.

    ``info`` is the node's value in the split graph (``None`` = one shared value). ``split`` means
    one copy per nanobatch; ``call(h)`` gives nanobatch ``h``'s copy (``None``: same call, with
    arguments mapped to that nanobatch). ``combine`` (main graph only) recombines the two copies of
    a reduction over the whole batch into one shared value.
    """

    info: Info
    split: bool
    call: Callable[[int], Call] | None = None
    combine: Combine | None = None
    combine_args: dict = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# Op names. Dynamo calls the same op through many objects (torch.add, operator.add, Tensor.add,
# torch._C._nn.linear = F.linear); rules are keyed by one canonical name. A target is mapped only
# if it *is* the torch / F / Tensor object of that name, never by a name that merely matches.

_OPERATOR_NAMES = {
    operator.add: "add",
    operator.sub: "sub",
    operator.mul: "mul",
    operator.truediv: "div",
    operator.floordiv: "floor_divide",
    operator.mod: "remainder",
    operator.pow: "pow",
    operator.matmul: "matmul",
    operator.neg: "neg",
    operator.pos: "positive",
    operator.invert: "bitwise_not",
    operator.abs: "abs",
    operator.eq: "eq",
    operator.ne: "ne",
    operator.lt: "lt",
    operator.le: "le",
    operator.gt: "gt",
    operator.ge: "ge",
    operator.and_: "bitwise_and",
    operator.or_: "bitwise_or",
    operator.xor: "bitwise_xor",
    operator.getitem: "getitem",
}
_NAMESPACES = (torch, F, torch._C._nn, torch._C._VariableFunctions, torch.special, torch.Tensor)
_target_names: dict[int, str] = {}


def op_name(node: fx.Node) -> str:
    """Canonical name of what a node calls: ``"linear"``, ``"c10d.all_reduce"``, ``"view"``...

    Unknown targets get a descriptive name that no rule matches.
    """
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_module":
        return f"module:{node.target}"
    if node.op != "call_function":
        return node.op
    t = node.target
    if t in _OPERATOR_NAMES:
        return _OPERATOR_NAMES[t]
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        qualified = t._qualified_op_name if isinstance(t, torch._ops.OpOverloadPacket) else t._schema.name
        ns, base = qualified.split("::")
        if ns in ("_c10d_functional", "_c10d_functional_autograd"):
            return f"c10d.{base}"
        return f"{ns}.{base}"
    if isinstance(t, torch._ops.HigherOrderOperator):
        return f"hop.{t.name()}"
    name = _target_names.get(id(t))
    if name is not None:
        return name
    return f"{getattr(t, '__module__', '?')}.{getattr(t, '__qualname__', repr(t))}"


# --------------------------------------------------------------------------------------------
# Argument access


def _arg(node: fx.Node, pos: int, name: str, default: fx.node.Argument = None) -> fx.node.Argument:
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


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


def _set_arg(call: Call, pos: int, name: str, value: Any) -> None:
    if len(call.args) > pos:
        args = list(call.args)
        args[pos] = value
        call.args = tuple(args)
    else:
        call.kwargs = {**call.kwargs, name: value}


def _same_call(node: fx.Node) -> Call:
    return Call(node.op, node.target, tuple(node.args), dict(node.kwargs))


Size = Any  # int, or a sympy expression over Dynamo's shape symbols (a symbolic size)


def _size(s: Any) -> Size:
    """A size as an int, or as its sympy expression when it is symbolic (``s38``, ``4*s38``).

    Reading the expression installs no guard: the rules compare sizes structurally (sympy
    canonical forms), so an equality they cannot prove is refused, never assumed."""
    if isinstance(s, torch.SymInt):
        as_int = s.node.maybe_as_int()
        return s.node.expr if as_int is None else as_int
    return int(s)


def _shape(v: Any) -> tuple[Size, ...]:
    """A tensor's shape with symbolic sizes as sympy expressions (see :func:`_size`)."""
    return tuple(_size(s) for s in v.shape)


def is_symbolic(size: Size) -> bool:
    """Whether a size from :func:`_shape` is symbolic."""
    return not isinstance(size, int)


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _dims_arg(d: Any, ndim: int) -> tuple[int, ...] | None:
    """A ``dim`` argument as a tuple of non-negative dims; ``None`` for "all dims"."""
    if d is None:
        return None
    if isinstance(d, int):
        return (_norm_dim(d, ndim),)
    d = tuple(d)
    if not d:
        return None
    return tuple(_norm_dim(x, ndim) for x in d)


# --------------------------------------------------------------------------------------------
# Op tables


_POINTWISE = {
    # unary
    "abs",
    "neg",
    "positive",
    "exp",
    "exp2",
    "expm1",
    "log",
    "log2",
    "log10",
    "log1p",
    "sqrt",
    "rsqrt",
    "sin",
    "cos",
    "tan",
    "tanh",
    "sinh",
    "cosh",
    "asin",
    "acos",
    "atan",
    "sigmoid",
    "relu",
    "gelu",
    "silu",
    "mish",
    "softplus",
    "elu",
    "selu",
    "celu",
    "leaky_relu",
    "hardtanh",
    "relu6",
    "hardswish",
    "hardsigmoid",
    "logsigmoid",
    "softsign",
    "tanhshrink",
    "erf",
    "erfc",
    "erfinv",
    "reciprocal",
    "square",
    "sign",
    "sgn",
    "floor",
    "ceil",
    "round",
    "trunc",
    "frac",
    "logical_not",
    "bitwise_not",
    "isnan",
    "isinf",
    "isfinite",
    "nan_to_num",
    "clamp",
    "clip",
    "clamp_min",
    "clamp_max",
    "threshold",
    "contiguous",
    "clone",
    "zeros_like",
    "ones_like",
    "full_like",
    "empty_like",
    "conj",
    "real",
    "imag",
    "angle",
    "xlogy",
    "hypot",
    "heaviside",
    # binary / ternary, broadcasting
    "add",
    "sub",
    "mul",
    "div",
    "true_divide",
    "floor_divide",
    "remainder",
    "fmod",
    "pow",
    "maximum",
    "minimum",
    "fmax",
    "fmin",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "bitwise_and",
    "bitwise_or",
    "bitwise_xor",
    "logical_and",
    "logical_or",
    "logical_xor",
    "atan2",
    "copysign",
    "rsub",
    "lerp",
    "addcmul",
    "addcdiv",
    "where",
    "masked_fill",
}
# Only the first argument is data; the others give a dtype or device.
_CONVERT = {
    "float",
    "half",
    "bfloat16",
    "double",
    "int",
    "long",
    "short",
    "bool",
    "byte",
    "char",
    "to",
    "type",
    "type_as",
    "detach",
}
# (position, keyword, default) of the dim an op works along; the batch must not be that dim.
_ALONG_DIM = {
    "softmax": (1, "dim", None),
    "log_softmax": (1, "dim", None),
    "cumsum": (1, "dim", None),
    "cumprod": (1, "dim", None),
    "logcumsumexp": (1, "dim", None),
    "normalize": (2, "dim", 1),
    "glu": (1, "dim", -1),
    "argsort": (1, "dim", -1),
    "sort": (1, "dim", -1),
    "topk": (2, "dim", -1),
    "diff": (2, "dim", -1),
    "flip": (1, "dims", None),
    "cummax": (1, "dim", None),
    "cummin": (1, "dim", None),
}
_LAST_TWO = {"tril", "triu"}
_REDUCTIONS = {
    "sum",
    "nansum",
    "mean",
    "amax",
    "amin",
    "max",
    "min",
    "argmax",
    "argmin",
    "prod",
    "var",
    "std",
    "logsumexp",
    "all",
    "any",
    "count_nonzero",
    "norm",
}
_RESHAPES = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as"}
_PERMUTES = {"transpose", "swapaxes", "swapdims", "t", "permute", "movedim", "moveaxis"}
_RNG = {
    "dropout",
    "dropout1d",
    "dropout2d",
    "dropout3d",
    "alpha_dropout",
    "feature_alpha_dropout",
    "rand_like",
    "randn_like",
    "randint_like",
    "bernoulli",
    "multinomial",
    "normal",
    "poisson",
    "rrelu",
    "gumbel_softmax",
    "native_dropout",
}
_POINTWISE_LOSSES = {
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "soft_margin_loss",
}
_COLLECTIVES_POINTWISE = {"c10d.all_reduce", "c10d.wait_tensor", "c10d.broadcast"}
_GLOBAL_STATE = {"_set_grad_enabled", "_enter_autocast", "_exit_autocast", "set_grad_enabled"}
_LINEAR_ON_PARTIAL = {
    "add",
    "sub",
    "mul",
    "div",
    "true_divide",
    "neg",
    "positive",
    "contiguous",
    "clone",
    "c10d.all_reduce",
    "c10d.wait_tensor",
}

_ALL_NAMES = (
    _POINTWISE
    | _CONVERT
    | set(_ALONG_DIM)
    | _LAST_TWO
    | _REDUCTIONS
    | _RESHAPES
    | _PERMUTES
    | _RNG
    | _POINTWISE_LOSSES
    | {
        "linear",
        "matmul",
        "mm",
        "bmm",
        "addmm",
        "baddbmm",
        "embedding",
        "scaled_dot_product_attention",
        "rms_norm",
        "layer_norm",
        "cross_entropy",
        "nll_loss",
        "cat",
        "concat",
        "concatenate",
        "stack",
        "chunk",
        "split",
        "tensor_split",
        "unbind",
        "narrow",
        "select",
        "expand",
        "expand_as",
        "repeat",
        "index_select",
        "gather",
        "pad",
        "new_ones",
        "new_zeros",
        "new_full",
        "new_empty",
        "new_tensor",
        "conv1d",
        "conv2d",
        "conv3d",
        "batch_norm",
        "_set_grad_enabled",
        "set_grad_enabled",
    }
)
for _ns in _NAMESPACES:
    for _name in _ALL_NAMES:
        _obj = getattr(_ns, _name, None)
        if _obj is not None and id(_obj) not in _target_names:
            _target_names[id(_obj)] = _name
try:
    from torch.distributed.tensor import DTensor as _DTensor

    _target_names[id(_DTensor.from_local)] = "dtensor.from_local"
    _target_names[id(torch.distributed.tensor._api.from_local)] = "dtensor.from_local"
except (ImportError, AttributeError):  # pragma: no cover - torch built without distributed
    pass
for _obj, _name in (
    (torch.amp.autocast_mode._enter_autocast, "_enter_autocast"),
    (torch.amp.autocast_mode._exit_autocast, "_exit_autocast"),
    (torch._C._set_grad_enabled, "_set_grad_enabled"),
):
    _target_names[id(_obj)] = _name


def is_global_state_op(node: fx.Node) -> bool:
    """Grad-mode / autocast switches: no tensor data, but order matters."""
    return node.op == "call_function" and op_name(node) in _GLOBAL_STATE


def is_inplace(node: fx.Node) -> bool:
    """Mutating calls: ``x.add_(y)``, ``x[i] = v`` and friends."""
    if node.op == "call_method":
        t = str(node.target)
        return t.endswith("_") and not t.startswith("__")
    if node.op == "call_function":
        if node.target in (operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv):
            return True
        if node.target in _OPERATOR_NAMES:
            return False
        name = getattr(node.target, "__name__", "")
        return bool(name) and name.endswith("_") and not name.startswith("_")
    return False


def is_rng(node: fx.Node) -> bool:
    name = op_name(node)
    if name in _RNG:
        return True
    return node.op == "call_function" and getattr(node.target, "__name__", "") in (
        "rand",
        "randn",
        "randint",
        "randperm",
        "rand_like",
        "randn_like",
        "randint_like",
    )


def is_barrier(node: fx.Node) -> bool:
    """Nothing may move across a global-state switch, an in-place op or a random op."""
    return is_global_state_op(node) or is_inplace(node) or (node.op != "placeholder" and is_rng(node))


# --------------------------------------------------------------------------------------------


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
            if touched:
                raise self._fail(node, "in-place op on a batch-carrying tensor")
            return Step(None, False)
        if not touched:
            # Runs once on shared values, exactly as in the original graph.
            return Step(None, False)
        if node.op != "call_function" and node.op != "call_method":
            raise self._fail(node, "module calls have no batch rule")
        name = op_name(node)
        if any(self.infos.get(i) is PARTIAL for i in touched):
            return self._partial_rule(node, name)
        if is_rng(node) and not self._rng_inactive(node, name):
            if not self.allow_rng:
                raise self._fail(
                    node,
                    "random op on batch-carrying data (each nanobatch would "
                    "draw different numbers); pass allow_rng=True to split anyway",
                )
            if name in (
                "dropout",
                "dropout1d",
                "dropout2d",
                "dropout3d",
                "alpha_dropout",
                "feature_alpha_dropout",
                "rand_like",
                "randn_like",
                "randint_like",
                "bernoulli",
                "normal",
                "poisson",
                "rrelu",
                "native_dropout",
            ):
                return self._pointwise(node, [node.args[0]])
            raise self._fail(node, "random op with no batch rule")
        rule = _RULES.get(name)
        if rule is None:
            for table, fn in _TABLE_RULES:
                if name in table:
                    rule = fn
                    break
        if rule is None:
            raise self._fail(node, "no batch rule for this op")
        return rule(self, node, name)

    def _rng_inactive(self, node: fx.Node, name: str) -> bool:
        if name in ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"):
            p = _arg(node, 1, "p", 0.5)
            training = _arg(node, 2, "training" if node.op == "call_function" else "train", True)
            if node.op == "call_function" and node.target is torch.dropout:
                training = _arg(node, 2, "train", True)
            return bool(p == 0) or training is False
        return False

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
            if s[j] != out_shape[out.dim] or out.p != 1:
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

    def _partial_rule(self, node: fx.Node, name: str) -> Step:
        """Ops on a nanobatch's part of a batch sum (backward bodies only): linear ops only."""
        ins = [self.info(a) for a in node.all_input_nodes]
        if any(isinstance(i, BatchDim) for i in ins):
            raise self._fail(node, "mixes a partial batch sum with batch-carrying data")
        if name in _RESHAPES or name in _PERMUTES or name in _CONVERT or name == "getitem":
            return Step(PARTIAL, True)
        if name in _LINEAR_ON_PARTIAL:
            tensor_args = [a for a in node.args if isinstance(a, fx.Node)]
            parts = [a for a in tensor_args if self.info(a) is PARTIAL]
            if name in ("add", "sub") and len(parts) != len(tensor_args):
                raise self._fail(node, "adds a shared tensor to a partial batch sum")
            if name in ("mul", "div", "true_divide") and len(parts) != 1:
                raise self._fail(node, "product of two partial batch sums")
            if name in ("div", "true_divide") and self.info(node.args[0]) is not PARTIAL:
                raise self._fail(node, "divides by a partial batch sum")
            if name == "c10d.all_reduce" and node.args[1] not in ("sum", "avg"):
                raise self._fail(node, "non-linear all_reduce of a partial batch sum")
            return Step(PARTIAL, True)
        raise self._fail(node, "non-linear op on a partial batch sum")

    def _reduction_over_batch(self, node: fx.Node, kind: Combine, **combine_args: Any) -> Step:
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
# Rules: (analysis, node, name) -> Step


def _rule_pointwise(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    ops = [a for a in node.args if isinstance(a, fx.Node)]
    ops += [a for a in node.kwargs.values() if isinstance(a, fx.Node)]
    return an._pointwise(node, ops)


def _rule_convert(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    src = node.args[0]
    i = an.info(src)
    if not isinstance(i, BatchDim):
        raise an._fail(node, "batch enters only through a dtype/device argument")
    return Step(i, True)


def _rule_along_dim(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    if not isinstance(i, BatchDim):
        raise an._fail(node, "batch enters through a non-data argument")
    pos, kw, default = _ALONG_DIM[name]
    d = _arg(node, pos, kw, default)
    if d is None:
        raise an._fail(node, "implicit dim")
    dims = _dims_arg(d, len(an.shape(x)))
    if dims is None or i.dim in dims:  # None: an empty dim list, read as every dim
        raise an._fail(node, "works along the batch dim")
    out = an.vals.get(node)
    if isinstance(out, (tuple, list)):
        return Step(tuple(i for _ in out), True)
    return Step(i, True)


def _rule_last_two(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    if not isinstance(i, BatchDim) or i.dim >= len(an.shape(x)) - 2:
        raise an._fail(node, "batch in the last two dims")
    return Step(i, True)


def _rule_reduction(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    if not isinstance(i, BatchDim):
        raise an._fail(node, "batch enters through a non-data argument")
    nd = len(an.shape(x))
    if name in ("max", "min") and len(node.args) > 1 and isinstance(node.args[1], fx.Node):
        return _rule_pointwise(an, node, name)  # torch.max(a, b): elementwise
    if name == "norm":
        d, keepdim = _arg(node, 2, "dim"), _arg(node, 3, "keepdim", False)
    elif name in ("var", "std"):  # var(x, dim, unbiased, keepdim) or var(x, unbiased)
        d = _arg(node, 1, "dim")
        keepdim = _arg(node, 3, "keepdim", False)
    elif name == "count_nonzero":
        d, keepdim = _arg(node, 1, "dim"), False
    else:
        d, keepdim = _arg(node, 1, "dim"), _arg(node, 2, "keepdim", False)
    if isinstance(d, (bool, str, torch.dtype)):
        d = None
    dims = _dims_arg(d, nd)
    if dims is None or i.dim in dims:
        if name in ("sum", "nansum"):
            return an._reduction_over_batch(node, "sum")
        if name == "mean":
            return an._reduction_over_batch(node, "mean")
        raise an._fail(node, "reduction over the batch dim (only sums and means are recombined)")
    out_dim = i.dim if keepdim else i.dim - sum(1 for x_ in dims if x_ < i.dim)
    out = i.moved(out_dim)
    v = an.vals.get(node)
    if isinstance(v, (tuple, list)):  # max/min(dim) -> (values, indices)
        return Step(tuple(out for _ in v), True)
    return Step(out, True)


def _reshape_batch(an: BatchAnalysis, node, in_shape, i: BatchDim, out_shape) -> BatchDim:
    """Where the batch lands after a reshape: the output must keep the ``(P, B, R)`` layout."""
    big_p = math.prod(in_shape[: i.dim]) * i.p
    b = an.batch
    rest = math.prod(in_shape) // (big_p * b)
    for d in range(len(out_shape)):
        pre = math.prod(out_shape[:d])
        if pre > big_p:
            break
        if big_p % pre:
            continue
        p2 = big_p // pre
        if out_shape[d] % (p2 * b):
            continue
        k2 = out_shape[d] // (p2 * b)
        if k2 * math.prod(out_shape[d + 1 :]) == rest:
            return BatchDim(d, k2, p2)
    raise an._fail(node, f"reshape {in_shape} -> {out_shape} mixes the batch with other dims")


def _rule_reshape(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    if not isinstance(i, BatchDim):
        if name in ("view_as", "reshape_as"):
            raise an._fail(node, "batch enters through the shape argument")
        raise an._fail(node, "batch enters through a non-data argument")
    if name == "view" and any(isinstance(a, torch.dtype) for a in node.args[1:]):
        raise an._fail(node, "view as another dtype")
    in_shape, out_shape = an.shape(x), an.shape(node)
    out = _reshape_batch(an, node, in_shape, i, out_shape)

    if name in ("flatten", "squeeze", "unsqueeze"):
        return Step(out, True)  # dim arguments only

    def call(h: int) -> Call:
        hs = an.half_shape(out_shape, out, h)
        if name in ("view", "reshape"):
            return Call(node.op, node.target, (x, hs), {})
        if name == "unflatten":
            d = _norm_dim(_int_arg(an, node, 1, "dim"), len(in_shape))
            n = len(_seq_arg(an, node, 2, "sizes"))
            return Call(node.op, node.target, (x, d, hs[d : d + n]), {})
        # view_as / reshape_as
        return Call("call_method", "reshape", (x, hs), {})

    return Step(out, True, call)


def _rule_permute(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    if not isinstance(i, BatchDim):
        raise an._fail(node, "batch enters through a non-data argument")
    nd = len(an.shape(x))
    perm = list(range(nd))
    if name in ("transpose", "swapaxes", "swapdims"):
        a, b = _norm_dim(_int_arg(an, node, 1), nd), _norm_dim(_int_arg(an, node, 2), nd)
        perm[a], perm[b] = perm[b], perm[a]
    elif name == "t":
        perm = perm[::-1]
    elif name == "permute":
        dims: object = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
        if node.op == "call_function" or "dims" in node.kwargs:
            dims = _arg(node, 1, "dims")
        perm = [_norm_dim(d, nd) for d in _int_list(an, node, dims)]
    else:  # movedim
        src = [_norm_dim(s, nd) for s in _int_list(an, node, _arg(node, 1, "source"))]
        dst = [_norm_dim(s, nd) for s in _int_list(an, node, _arg(node, 2, "destination"))]
        perm = [-1] * nd
        for s, d in zip(src, dst):
            perm[d] = s
        rest = iter([j for j in range(nd) if j not in src])
        perm = [p if p >= 0 else next(rest) for p in perm]
    return Step(i.moved(perm.index(i.dim)), True)


def _rule_expand(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    if not isinstance(i, BatchDim):
        raise an._fail(node, "batch enters through the shape argument")
    out_shape = an.shape(node)
    out = i.moved(i.dim + len(out_shape) - len(an.shape(x)))
    return Step(out, True, lambda h: Call("call_method", "expand", (x, an.half_shape(out_shape, out, h)), {}))


def _rule_repeat(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    reps = node.args[1:] if not isinstance(node.args[1], (list, tuple)) else node.args[1]
    if not isinstance(i, BatchDim):
        raise an._fail(node, "batch enters through a non-data argument")
    out = i.moved(i.dim + len(reps) - len(an.shape(x)))
    if reps[out.dim] != 1:
        raise an._fail(node, "repeats along the batch dim")
    return Step(out, True)


def _rule_narrow_select(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    if not isinstance(i, BatchDim) or any(isinstance(a, fx.Node) for a in node.args[1:]):
        raise an._fail(node, "batch enters through an index argument")
    d = _norm_dim(_int_arg(an, node, 1, "dim"), len(an.shape(x)))
    if d == i.dim:
        raise an._fail(node, f"{name} along the batch dim")
    if name == "select" and d < i.dim:
        return Step(i.moved(i.dim - 1), True)
    return Step(i, True)


def _rule_index_select(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x, d, idx = _node_arg(an, node, 0), _int_arg(an, node, 1, "dim"), _arg(node, 2, "index")
    i = an.info(x)
    if not isinstance(i, BatchDim) or an.info(idx) is not None:
        raise an._fail(node, "batch-carrying index")
    if _norm_dim(d, len(an.shape(x))) == i.dim:
        raise an._fail(node, "index_select along the batch dim")
    return Step(i, True)


def _rule_gather(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x, d, idx = node.args[0], _int_arg(an, node, 1, "dim"), _arg(node, 2, "index")
    step = an._pointwise(node, [x, idx])
    if _norm_dim(d, len(an.shape(node))) == step.info.dim:
        raise an._fail(node, "gather along the batch dim")
    return step


def _rule_split_like(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    if not isinstance(i, BatchDim):
        raise an._fail(node, "batch enters through a non-data argument")
    nd = len(an.shape(x))
    if name == "unbind":
        d = _norm_dim(_int_arg(an, node, 1, "dim", 0), nd)
    else:
        d = _norm_dim(_int_arg(an, node, 2, "dim", 0), nd)
    n_out = len(an.vals[node])
    if d != i.dim:
        out = i if name != "unbind" or d > i.dim else i.moved(i.dim - 1)
        return Step(tuple(out for _ in range(n_out)), True)
    # chunk(p) of an all-gathered tensor: each rank's piece holds the whole batch once.
    if name == "chunk" and i.p > 1 and _arg(node, 1, "chunks") == i.p:
        return Step(tuple(BatchDim(d, i.k, 1) for _ in range(n_out)), True)
    raise an._fail(node, f"{name} along the batch dim")


def _rule_getitem(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    src, idx = node.args
    info = an.info(src)
    if isinstance(info, tuple):  # element of a multi-output value
        if not isinstance(idx, int):
            raise an._fail(node, "non-constant index into a tuple")
        return Step(info[idx], _is_split(info[idx]))
    items = idx if isinstance(idx, tuple) else (idx,)
    tensors = [a for a in items if isinstance(a, fx.Node)]
    if tensors or any(isinstance(a, (list, torch.Tensor)) for a in items):
        # shared_table[batch_index]: an embedding lookup (RoPE cos/sin by position ids).
        if info is None and len(items) == 1 and isinstance(items[0], fx.Node):
            j = an.info(items[0])
            v = an.vals.get(items[0])
            if (
                isinstance(j, BatchDim)
                and isinstance(v, torch.Tensor)
                and not v.dtype.is_floating_point
                and v.dtype != torch.bool
            ):
                return Step(j, True)
        if isinstance(info, BatchDim):
            return _advanced_getitem(an, node, _node_arg(an, node, 0), info, items)
        raise an._fail(node, "advanced (tensor) indexing involving the batch")
    if not isinstance(info, BatchDim):
        raise an._fail(node, "unexpected input kind")
    shape = an.shape(_node_arg(an, node, 0))
    nd = len(shape)
    consuming = sum(1 for a in items if a is not None and a is not Ellipsis)
    i_dim = o_dim = 0
    out_dim = None
    new_items: list[object] = []
    for a in items:
        if a is None:
            o_dim += 1
        elif a is Ellipsis:
            for _ in range(nd - consuming):
                if i_dim == info.dim:
                    out_dim = o_dim
                i_dim += 1
                o_dim += 1
        elif isinstance(a, int):
            if i_dim == info.dim:
                raise an._fail(node, "integer index into the batch dim")
            i_dim += 1
        elif isinstance(a, slice):
            if i_dim == info.dim:
                full = (
                    a.start in (None, 0)
                    and a.step in (None, 1)
                    and (a.stop is None or (isinstance(a.stop, int) and a.stop >= shape[i_dim]))
                )
                if not full:
                    raise an._fail(node, "slices the batch dim")
                out_dim = o_dim
                new_items.append(slice(None))
            else:
                new_items.append(a)
            i_dim += 1
            o_dim += 1
            continue
        else:
            raise an._fail(node, f"unsupported index {a!r}")
        new_items.append(a)
    if out_dim is None:
        out_dim = o_dim + (info.dim - i_dim)
    new_idx = tuple(new_items) if isinstance(idx, tuple) else new_items[0]
    return Step(info.moved(out_dim), True, lambda h: Call(node.op, node.target, (src, new_idx), {}))


_INDEX_PASSTHROUGH = {"to", "long", "int", "contiguous", "clone", "unsqueeze"}


def _batch_arange_dim(an: BatchAnalysis, node: Any) -> int | None:
    """The dim along which the shared integer tensor ``node`` is ``arange(B)`` (every other dim
    of size 1), or ``None`` when that is not provable from how the graph builds it.

    Follows ``torch.arange(B)`` (start 0, step 1, integer dtype) through ``+ 0`` / ``- 0``,
    integer conversions and indexing or ``unsqueeze``/``view``/``reshape`` that only add or drop
    size-1 dims: HF's mask builder's ``batch_arange[:, None, None, None]``.
    """
    if not isinstance(node, fx.Node) or an.info(node) is not None:
        return None
    v = an.vals.get(node)
    if not isinstance(v, torch.Tensor) or v.dtype.is_floating_point or v.dtype == torch.bool:
        return None
    shape = _shape(v)
    big = [d for d, s in enumerate(shape) if s != 1]
    if len(big) != 1 or shape[big[0]] != an.batch:
        return None
    name = op_name(node)
    if node.op == "call_function" and node.target is torch.arange:
        args = list(node.args)
        ok = (
            args in ([an.batch], [0, an.batch], [0, an.batch, 1])
            and node.kwargs.get("start", 0) == 0
            and node.kwargs.get("step", 1) == 1
            and "end" not in node.kwargs
            and "out" not in node.kwargs
        )
        return big[0] if ok else None
    if name in ("add", "sub") and len(node.args) == 2 and node.args[1] == 0 and not node.kwargs:
        src = node.args[0]
    elif name in _INDEX_PASSTHROUGH or name in ("view", "reshape", "getitem"):
        src = node.args[0]
        if name == "getitem":
            items = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
            if not all(a is None or a is Ellipsis or a == slice(None) for a in items):
                return None
        if name in ("to", "long", "int") and any(
            isinstance(a, fx.Node) for a in list(node.args[1:]) + list(node.kwargs.values())
        ):
            return None
    else:
        return None
    return big[0] if _batch_arange_dim(an, src) is not None else None


def getitem_with_batch_arange(src: torch.Tensor, items: tuple, slot: int, index_shape: tuple[int, ...]) -> torch.Tensor:
    """``src[items]`` with ``items[slot]`` replaced by ``arange(n)`` laid out as ``index_shape``
    (``n`` = its one non-1 size): one nanobatch's copy of an index by a batch ``arange``."""
    index = torch.arange(math.prod(index_shape), device=src.device).view(index_shape)
    return src[items[:slot] + (index,) + items[slot + 1 :]]


def _advanced_getitem(an: BatchAnalysis, node: fx.Node, src: fx.Node, info: BatchDim, items: tuple) -> Step:
    """``src[i0, i1, ...]`` with integer index tensors and full slices, ``src`` batch-carrying.

    Exact per nanobatch in two cases: the batch dim is a full slice and every index tensor is
    shared (each batch element is indexed the same way); or the batch dim is indexed by a batch
    ``arange`` (:func:`_batch_arange_dim`) and every other index tensor is shared with size 1
    along the broadcast dim that ``arange`` occupies (element ``b`` of the result reads only
    ``src[b]``). In the second case each nanobatch gets its own ``arange``.
    """
    src_shape = an.shape(src)
    if len(items) > len(src_shape):
        raise an._fail(node, "advanced indexing with more indices than dims")
    adv = [pos for pos, a in enumerate(items) if isinstance(a, fx.Node)]
    for pos, a in enumerate(items):
        if pos in adv:
            v = an.vals.get(a)
            if not isinstance(v, torch.Tensor) or v.dtype.is_floating_point or v.dtype == torch.bool:
                raise an._fail(node, "advanced indexing by a non-integer index tensor")
            if an.info(a) is not None:
                raise an._fail(node, "advanced indexing by a batch-carrying index into batch data")
        elif a != slice(None):
            raise an._fail(node, f"advanced indexing mixed with index {a!r}")
    index_shapes = [an.shape(items[pos]) for pos in adv]
    bcast = tuple(torch.broadcast_shapes(*index_shapes))
    contiguous = adv == list(range(adv[0], adv[-1] + 1))
    block_start = adv[0] if contiguous else 0
    if info.dim not in adv:
        if info.dim < len(items):
            before = sum(1 for d in range(info.dim) if d not in adv)
            out_dim = before + (len(bcast) if not contiguous or info.dim > adv[-1] else 0)
        else:  # an unindexed trailing dim
            out_dim = info.dim - len(adv) + len(bcast)
        return Step(info.moved(out_dim), True)
    index = items[info.dim]
    d = _batch_arange_dim(an, index)
    if d is None or info.p != 1 or info.k != 1:
        raise an._fail(node, "advanced (tensor) indexing of the batch dim by an index that is not a batch arange")
    own_shape = an.shape(index)
    d_b = d + len(bcast) - len(own_shape)
    slot = info.dim
    for pos, shape in zip(adv, index_shapes):
        j = d_b - (len(bcast) - len(shape))
        if pos != slot and j >= 0 and shape[j] != 1:
            raise an._fail(node, "another index tensor varies along the batch arange's dim")
    out = BatchDim(block_start + d_b)
    others = tuple(items[:slot]) + (None,) + tuple(items[slot + 1 :])  # the slot is filled per nanobatch

    def call(h: int) -> Call:
        shape_h = list(own_shape)
        shape_h[d] = an.halves[h]
        return Call("call_function", getitem_with_batch_arange, (src, others, slot, tuple(shape_h)), {})

    return Step(out, True, call)


def _rule_cat(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    inputs = _seq_arg(an, node, 0, "tensors")
    tensors = [t for t in inputs if isinstance(t, fx.Node)]
    if len(tensors) != len(inputs):
        raise an._fail(node, "an input is not a tensor")
    out_shape = an.shape(node)
    nd = len(out_shape)
    stack = name == "stack"
    d = _norm_dim(_int_arg(an, node, 1, "dim", 0), nd)
    out = None
    for t in tensors:
        i = an.info(t)
        if isinstance(i, BatchDim):
            cand = i.moved(i.dim + 1 if stack and i.dim >= d else i.dim)
            if out is not None and cand != out:
                raise an._fail(node, "inputs carry the batch on different dims")
            out = cand
        elif i is not None:
            raise an._fail(node, f"unexpected input kind {i!r}")
    if out is None:
        raise an._fail(node, "no batch-carrying input")
    if out.dim == d:
        raise an._fail(node, f"{name} along the batch dim")
    slices = {}
    for t in tensors:
        if an.info(t) is None:
            s = an.shape(t)
            if s == (0,):  # cat skips a 1-D empty tensor (an empty cache): nothing to slice
                continue
            j = out.dim if not stack or out.dim < d else out.dim - 1
            if out.p != 1 or s[j] != out_shape[out.dim]:
                raise an._fail(node, f"shared input {t.name} cannot be sliced")
            slices[id(t)] = SliceOf(t, out.moved(j))
    return Step(out, True, an._with_slices(node, slices))


def _rule_linear(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x, w, b = _node_arg(an, node, 0), _arg(node, 1, "weight"), _arg(node, 2, "bias")
    if an.info(w) is not None or an.info(b) is not None:
        raise an._fail(node, "batch-carrying weight or bias")
    i = an.info(x)
    nd = len(an.shape(x))
    if i.dim == nd - 1:
        raise an._fail(node, "contracts over the batch dim")
    return Step(i, True)


def _rule_matmul(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    bias: fx.Node | None = None
    if name in ("addmm", "baddbmm"):
        bias, a, b = _node_arg(an, node, 0), _node_arg(an, node, 1), _node_arg(an, node, 2)
    else:
        a, b = _node_arg(an, node, 0), _node_arg(an, node, 1)
    sa, sb = an.shape(a), an.shape(b)
    out_shape = an.shape(node)
    no = len(out_shape)
    if len(sa) < 2 or len(sb) < 2:
        # vectors: out = a @ b with the 1-D side contracted away.
        if len(sa) == 1 and len(sb) == 1:
            raise an._fail(node, "dot product over the batch")
        vec, mat = (a, b) if len(sa) == 1 else (b, a)
        if an.info(vec) is not None:
            raise an._fail(node, "batch-carrying vector operand")
        i = an.info(mat)
        nm = len(an.shape(mat))
        contracted = nm - 2 if vec is a else nm - 1
        if i.dim == contracted:
            return _contraction(an, node)
        out = i.moved(i.dim if i.dim < contracted else i.dim - 1)
        return Step(out, True)
    outs = []
    slices = {}
    for operand, s, row_dim, contracted in ((a, sa, len(sa) - 2, len(sa) - 1), (b, sb, len(sb) - 1, len(sb) - 2)):
        i = an.info(operand)
        if isinstance(i, BatchDim):
            if i.dim == contracted:
                return _contraction(an, node)
            if i.dim == row_dim:
                outs.append(i.moved(no - 2 if operand is a else no - 1))
            else:
                outs.append(i.moved(i.dim + no - len(s)))
    if len(outs) == 2 and outs[0] != outs[1]:
        raise an._fail(node, "batch on different dims of the two operands")
    out = outs[0]
    if out.dim < no - 2:  # a leading (broadcast) dim: shared operands may need slicing
        slices = an._shared_slices(node, [a, b], out, out_shape)
    if bias is not None:
        an._pointwise(node, [bias] + ([a] if isinstance(an.info(a), BatchDim) else [b]), out_shape)
        slices.update(an._shared_slices(node, [bias], out, out_shape))
    return Step(out, True, an._with_slices(node, slices))


def _contraction(an: BatchAnalysis, node: fx.Node) -> Step:
    """A matmul summing over the batch: a weight gradient inside an autograd.Function backward."""
    if an.mode != "body":
        raise an._fail(node, "contracts over the batch dim")
    infos = [an.info(a) for a in node.args if isinstance(a, fx.Node)]
    if sum(isinstance(i, BatchDim) for i in infos) != 2:
        raise an._fail(node, "contracts a batch-carrying operand with a shared one")
    return Step(PARTIAL, True)


def _rule_embedding(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    ids, w = node.args[0], _arg(node, 1, "weight")
    if an.info(w) is not None:
        raise an._fail(node, "batch-carrying embedding table")
    if _arg(node, 3, "max_norm") is not None:
        raise an._fail(node, "max_norm renormalises the table in place")
    if _arg(node, 5, "scale_grad_by_freq", False):
        raise an._fail(node, "scale_grad_by_freq counts tokens over the whole batch")
    return Step(an.info(ids), True)


def _rule_sdpa(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    if _arg(node, 4, "dropout_p", 0.0) and not an.allow_rng:
        raise an._fail(node, "attention dropout draws random numbers; pass allow_rng=True")
    return _attention(an, node, node.args[0], _arg(node, 1, "key"), _arg(node, 2, "value"), _arg(node, 3, "attn_mask"))


def _rule_kareus_attention(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """``kareus::attention(q, k, v, scale)``: causal attention per (batch, head), no mask."""
    return _attention(an, node, node.args[0], node.args[1], node.args[2], None)


def _attention(an: BatchAnalysis, node: fx.Node, q, k, v, mask) -> Step:
    """Attention over ``[..., seq, dim]``: every leading (batch, head) index is independent."""
    out_shape = an.shape(node)
    nd = len(out_shape)
    out = None
    for t in (q, k, v):
        i = an.info(t)
        if isinstance(i, BatchDim):
            if len(an.shape(t)) != nd or i.dim >= nd - 2:
                raise an._fail(node, "batch in the sequence or feature dims of q/k/v")
            if out is not None and out != i:
                raise an._fail(node, "q/k/v carry the batch on different dims")
            out = i
    if out is None:
        raise an._fail(node, "batch enters only through the mask")
    if an.info(q) is None:
        raise an._fail(node, "shared queries attend over batch-carrying keys")
    slices = an._shared_slices(node, [k, v], out, out_shape)
    if mask is not None:
        scores = out_shape[:-1] + (an.shape(k)[-2],)
        mi = an.info(mask)
        if isinstance(mi, BatchDim) and mi.moved(mi.dim + nd - len(an.shape(mask))) != out:
            raise an._fail(node, "mask carries the batch on another dim")
        slices.update(an._shared_slices(node, [mask], out, scores))
    return Step(out, True, an._with_slices(node, slices))


def _rule_norm(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    extra = [a for a in node.all_input_nodes if a is not x]
    if not isinstance(i, BatchDim) or any(an.info(a) is not None for a in extra):
        raise an._fail(node, "batch-carrying weight or bias")
    n = len(_seq_arg(an, node, 1, "normalized_shape"))
    if i.dim >= len(an.shape(x)) - n:
        raise an._fail(node, "normalises over the batch dim")
    return Step(i, True)


def _rule_batch_norm(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    if _arg(node, 5, "training", False):
        raise an._fail(node, "batch_norm in training mode averages over the batch")
    if (
        not isinstance(i, BatchDim)
        or i.dim == 1
        or any(an.info(a) is not None for a in node.all_input_nodes if a is not x)
    ):
        raise an._fail(node, "batch on the channel dim")
    return Step(i, True)


def _rule_conv(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    n = int(name[-2])
    if not isinstance(i, BatchDim) or len(an.shape(x)) != n + 2 or i.dim != 0 or i.p != 1 or i.k != 1:
        raise an._fail(node, "batch not on dim 0 of a batched convolution input")
    if any(an.info(a) is not None for a in node.all_input_nodes if a is not x):
        raise an._fail(node, "batch-carrying weight")
    return Step(i, True)


def _rule_pad(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x, pad = _node_arg(an, node, 0), _seq_arg(an, node, 1, "pad")
    i = an.info(x)
    if not isinstance(i, BatchDim) or i.dim >= len(an.shape(x)) - len(pad) // 2:
        raise an._fail(node, "pads the batch dim")
    return Step(i, True)


def _rule_new_factory(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """``x.new_ones(size)`` only borrows dtype and device from ``x``: emit a shared factory call."""
    if any(isinstance(a, fx.Node) for a in list(node.args[1:]) + list(node.kwargs.values())):
        raise an._fail(node, "size or value from a tensor")
    fn = {"new_ones": torch.ones, "new_zeros": torch.zeros, "new_empty": torch.empty, "new_full": torch.full}[name]
    args: tuple[object, ...]
    if name == "new_full":
        args = (_arg(node, 1, "size"), _arg(node, 2, "fill_value"))
    else:  # x.new_zeros(2, 3) or x.new_zeros((2, 3))
        size = node.args[1:] if len(node.args) > 1 else node.kwargs["size"]
        if not isinstance(size, (tuple, list)):
            raise an._fail(node, f"size {size!r} is not a sequence")
        nested = size[0] if len(size) == 1 else None
        args = (tuple(nested) if isinstance(nested, (tuple, list)) else tuple(size),)
    v = an.vals[node]
    kwargs = {"dtype": v.dtype, "device": v.device}
    return Step(None, False, lambda h: Call("call_function", fn, args, kwargs))


def _cross_entropy_like(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    inp, tgt = _node_arg(an, node, 0), _node_arg(an, node, 1, "target")
    weight = _arg(node, 2, "weight")
    if _arg(node, 3, "size_average") is not None or _arg(node, 5, "reduce") is not None:
        raise an._fail(node, "legacy size_average/reduce arguments")
    reduction = _arg(node, 6, "reduction", "mean")
    ignore_index = _arg(node, 4, "ignore_index", -100)
    if an.info(weight) is not None:
        raise an._fail(node, "batch-carrying class weights")
    s_in = an.shape(inp)
    if len(s_in) < 2:
        raise an._fail(node, "unbatched input")
    prob_target = an.vals[tgt].dtype.is_floating_point
    # elementwise over the input with the class dim (1) taken out, as the target is laid out
    i_in, i_t = an.info(inp), an.info(tgt)
    if isinstance(i_in, BatchDim) and i_in.dim == 1:
        raise an._fail(node, "batch on the class dim")
    t_shape = an.shape(tgt)
    want = None
    if isinstance(i_in, BatchDim):
        want = i_in if prob_target else i_in.moved(i_in.dim - (i_in.dim > 1))
    if isinstance(i_t, BatchDim):
        if want is not None and want != i_t:
            raise an._fail(node, "input and target carry the batch on different dims")
        want = i_t
    if i_in is None:
        raise an._fail(node, "shared logits with batch-carrying targets")
    if want is None:
        raise an._fail(node, "neither input nor target carries the batch")
    slices = {}
    if i_t is None:
        slices.update(an._shared_slices(node, [tgt], want, t_shape))
    if reduction == "none":
        return Step(want, True, an._with_slices(node, slices))
    if reduction == "sum":
        step = an._reduction_over_batch(node, "sum")
    elif prob_target:
        step = an._reduction_over_batch(node, "mean")
    else:
        # Per-token losses per nanobatch, summed in fp32 by the recombination: exact for an
        # all-ignored nanobatch (no 0/0) and as precise as the fused mean in bf16/fp16.
        step = an._reduction_over_batch(
            node, "ce_mean", target=tgt, ignore_index=ignore_index, weight=weight, half_info=want, half_like=tgt
        )

        def per_token(h: int) -> Call:
            c = _same_call(node)
            _set_arg(c, 6, "reduction", "none")
            return c

        step.call = an._with_slices(node, slices, per_token)
        return step
    step.call = an._with_slices(node, slices)
    return step


_LOSS_REDUCTION_POS = {
    "mse_loss": 4,
    "l1_loss": 4,
    "smooth_l1_loss": 4,
    "huber_loss": 2,
    "soft_margin_loss": 4,
    "binary_cross_entropy": 5,
    "binary_cross_entropy_with_logits": 5,
}


def _rule_pointwise_loss(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    operands = list(node.all_input_nodes)
    inp = _node_arg(an, node, 0)
    full = an._pointwise(node, operands, out_shape=an.shape(inp))
    pos = _LOSS_REDUCTION_POS[name]
    if name != "huber_loss" and (
        _arg(node, 2 + (name.startswith("binary")), "size_average") is not None
        or _arg(node, 3 + (name.startswith("binary")), "reduce") is not None
    ):
        raise an._fail(node, "legacy size_average/reduce arguments")
    reduction = _arg(node, pos, "reduction", "mean")
    if reduction == "none":
        return full
    step = an._reduction_over_batch(node, "sum" if reduction == "sum" else "mean")
    step.call = full.call
    return step


def _rule_all_gather(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x, group_size = node.args[0], _int_arg(an, node, 1)
    i = an.info(x)
    if i.dim != 0:
        return Step(i, True)
    return Step(BatchDim(0, i.k, i.p * group_size), True)


def _rule_reduce_scatter(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x, group_size = node.args[0], _int_arg(an, node, 2)
    i = an.info(x)
    if i.dim != 0:
        return Step(i, True)
    if i.p % group_size == 0:
        return Step(BatchDim(0, i.k, i.p // group_size), True)
    raise an._fail(node, "scatters the batch dim across ranks")


def _rule_all_to_all(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    i = an.info(node.args[0])
    if i.dim == 0:
        raise an._fail(node, "exchanges slices of the batch dim between ranks")
    return Step(i, True)


def _rule_collective_pointwise(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    return Step(an.info(node.args[0]), True)


def _rule_autograd_function(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """``autograd_function_apply(fwd_body, bwd_body, *args)``: split both bodies per nanobatch.

    The forward body must be batch-separable. The backward body gets the forward outputs'
    gradients and the saved values; the gradient of a batch-carrying input must carry the batch
    the same way, and the gradient of a shared input must be a nanobatch's part of a batch sum
    (autograd adds the two nanobatches' parts).
    """
    fwd_attr, bwd_attr, *args = node.args
    fwd_target, bwd_target = _body_target(an, node, fwd_attr), _body_target(an, node, bwd_attr)
    fwd = getattr(an.gm, fwd_target)
    bwd = getattr(an.gm, bwd_target)
    arg_infos = [an.info(a) for a in args]
    fwd_an = _body_analysis(an, node, fwd, arg_infos)
    outs, saved = fwd_an.output_infos
    if not all(isinstance(o, BatchDim) for o in outs):
        raise an._fail(node, "an output of the autograd.Function does not carry the batch")
    bwd_an = _body_analysis(an, node, bwd, list(outs) + list(saved))
    grads = bwd_an.output_infos
    grads = grads if isinstance(grads, (tuple, list)) else (grads,)
    bwd_out = list(bwd.graph.nodes)[-1].args[0]
    bwd_out = bwd_out if isinstance(bwd_out, (tuple, list)) else (bwd_out,)
    for a, ai, g, gn in zip(args, arg_infos, grads, bwd_out):
        if gn is None:
            continue
        if isinstance(ai, BatchDim) and g != ai:
            raise an._fail(node, f"the gradient of {a} does not carry the batch like {a}")
        if ai is None and g is not PARTIAL:
            raise an._fail(
                node,
                f"the gradient of shared input {a} does not depend on the batch "
                "(it would be counted once per nanobatch)",
            )

    def call(h: int) -> Call:
        return Call(
            node.op,
            node.target,
            (Body(fwd_target, fwd_an), Body(bwd_target, bwd_an), *args),
            dict(node.kwargs),
        )

    return Step(tuple(outs), True, call)


def _body_target(an: BatchAnalysis, node: fx.Node, body: object) -> str:
    """The attribute a higher-order op's body argument reads (it must be a ``get_attr`` node)."""
    if not isinstance(body, fx.Node) or body.op != "get_attr" or not isinstance(body.target, str):
        raise an._fail(node, f"body {body!r} is not a graph attribute")
    return body.target


def _rule_checkpoint(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """``tag_activation_checkpoint(body, *args)``: a pure body, split per nanobatch; autograd
    recomputes each nanobatch's body in its own backward."""
    body_attr, *args = node.args
    body_target = _body_target(an, node, body_attr)
    body_an = _body_analysis(an, node, getattr(an.gm, body_target), [an.info(a) for a in args])
    outs = body_an.output_infos
    outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    if not all(isinstance(o, BatchDim) for o in outs):
        raise an._fail(node, "an output of the checkpointed region does not carry the batch")
    return Step(
        outs, True, lambda h: Call(node.op, node.target, (Body(body_target, body_an), *args), dict(node.kwargs))
    )


def _rule_dtensor(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """DTensor entry/exit and redistribution (``parallelize_module`` models at the Dynamo level).

    A DTensor's logical and local tensors hold the batch on the same dim as long as no placement
    shards that dim, and a redistribution that keeps it unsharded is elementwise over the batch
    (``Partial -> Replicate`` is an all-reduce, ``Replicate -> Shard(d)`` a local chunk).
    """
    x = _node_arg(an, node, 0)
    i = an.info(x)
    if not isinstance(i, BatchDim):
        raise an._fail(node, "batch enters through a non-data argument")
    if name == "dtensor.from_local":
        if _arg(node, 4, "shape") is not None or _arg(node, 5, "stride") is not None:
            raise an._fail(node, "explicit global shape")
        placements = _arg(node, 2, "placements")
    elif name == "redistribute":
        placements = _arg(node, 2, "placements")
    else:  # to_local, full_tensor
        placements = None
    if placements is not None and not isinstance(placements, (list, tuple)):
        raise an._fail(node, f"placements {placements!r} are not a list")
    nd = len(an.shape(node))
    sharded: list[object] = list(placements or ())
    for v in (an.vals.get(x), an.vals.get(node)):
        sharded += list(getattr(v, "placements", ()) or ())
    for p in sharded:
        d = getattr(p, "dim", None)
        if isinstance(d, int) and _norm_dim(d, nd) == i.dim:
            raise an._fail(node, f"shards the batch dim over the mesh ({p})")
    return Step(i, True)


def _body_analysis(an: BatchAnalysis, node: fx.Node, body: fx.GraphModule, infos: list) -> BatchAnalysis:
    phs = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(phs) != len(infos):
        raise an._fail(node, f"body {len(phs)} inputs for {len(infos)} values")
    vals = {n: n.meta.get("example_value") for n in body.graph.nodes}
    sub = BatchAnalysis(body, dict(zip(phs, infos)), vals, an.halves, mode="body", allow_rng=an.allow_rng)
    try:
        return sub.run()
    except Unsupported as e:
        raise an._fail(node, f"inside the autograd.Function: {e}") from None


_RULES: dict[str, Callable[[BatchAnalysis, fx.Node, str], Step]] = {
    "linear": _rule_linear,
    "matmul": _rule_matmul,
    "mm": _rule_matmul,
    "bmm": _rule_matmul,
    "addmm": _rule_matmul,
    "baddbmm": _rule_matmul,
    "embedding": _rule_embedding,
    "scaled_dot_product_attention": _rule_sdpa,
    "kareus.attention": _rule_kareus_attention,
    "rms_norm": _rule_norm,
    "layer_norm": _rule_norm,
    "batch_norm": _rule_batch_norm,
    "conv1d": _rule_conv,
    "conv2d": _rule_conv,
    "conv3d": _rule_conv,
    "cross_entropy": _cross_entropy_like,
    "nll_loss": _cross_entropy_like,
    "cat": _rule_cat,
    "concat": _rule_cat,
    "concatenate": _rule_cat,
    "stack": _rule_cat,
    "chunk": _rule_split_like,
    "split": _rule_split_like,
    "tensor_split": _rule_split_like,
    "unbind": _rule_split_like,
    "getitem": _rule_getitem,
    "expand": _rule_expand,
    "expand_as": _rule_expand,
    "repeat": _rule_repeat,
    "narrow": _rule_narrow_select,
    "select": _rule_narrow_select,
    "index_select": _rule_index_select,
    "gather": _rule_gather,
    "pad": _rule_pad,
    "new_ones": _rule_new_factory,
    "new_zeros": _rule_new_factory,
    "new_full": _rule_new_factory,
    "new_empty": _rule_new_factory,
    "c10d.all_gather_into_tensor": _rule_all_gather,
    "c10d.reduce_scatter_tensor": _rule_reduce_scatter,
    "c10d.all_to_all_single": _rule_all_to_all,
    "hop.autograd_function_apply": _rule_autograd_function,
    "hop.tag_activation_checkpoint": _rule_checkpoint,
    "dtensor.from_local": _rule_dtensor,
    "redistribute": _rule_dtensor,
    "to_local": _rule_dtensor,
    "full_tensor": _rule_dtensor,
}
for _n in _COLLECTIVES_POINTWISE:
    _RULES[_n] = _rule_collective_pointwise
for _n in ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"):
    _RULES[_n] = _rule_convert  # inactive (p=0 or not training): identity on its input
_TABLE_RULES = (
    (_POINTWISE, _rule_pointwise),
    (_CONVERT, _rule_convert),
    (set(_ALONG_DIM), _rule_along_dim),
    (_LAST_TWO, _rule_last_two),
    (_REDUCTIONS, _rule_reduction),
    (_RESHAPES, _rule_reshape),
    (_PERMUTES, _rule_permute),
    (_POINTWISE_LOSSES, _rule_pointwise_loss),
)
