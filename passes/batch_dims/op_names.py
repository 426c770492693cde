"""Canonical op names, and the nodes nothing may move across (global-state switches, in-place and
random ops).

Dynamo calls the same op through many objects (``torch.add``, ``operator.add``, ``Tensor.add``,
``torch._C._nn.linear`` = ``F.linear``); batch rules are keyed by one canonical name. A target is
given a name only if it *is* the torch / ``F`` / ``Tensor`` object of that name, never because its
name merely matches: registering a rule for a name (:mod:`~kareus_fx.passes.batch_dims.propagation`)
names those objects through :func:`name_torch_objects`. Operator overloads, functional
collectives and higher-order ops are named from their schema (``c10d.all_reduce``,
``hop.flex_attention``); anything else gets a descriptive name that no rule matches.

Random ops are named here even though most have no rule: each nanobatch would draw different
numbers, so the driver refuses them on batch data unless the caller allows it; a dropout with
``p=0`` or outside training draws nothing and is not refused.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from kareus_fx.passes.batch_dims.node_args import _arg
from kareus_fx.passes.batch_dims.values import BatchDim

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


def name_torch_objects(*names: str) -> None:
    """Call the ``torch``, ``torch.nn.functional`` and ``Tensor`` objects of ``names`` by those
    names (the first name given to an object keeps it)."""
    for ns in _NAMESPACES:
        for name in names:
            obj = getattr(ns, name, None)
            if obj is not None and id(obj) not in _target_names:
                _target_names[id(obj)] = name


def name_target(target: Any, name: str) -> None:
    """Call ``target`` (an object outside the scanned namespaces, e.g. ``DTensor.from_local``) ``name``."""
    _target_names[id(target)] = name


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


DROPOUTS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")
"""Random ops that draw nothing with ``p=0`` or outside training (:func:`dropout_inactive`)."""


_GLOBAL_STATE = {"_set_grad_enabled", "_enter_autocast", "_exit_autocast", "set_grad_enabled"}
name_torch_objects(*_RNG, *_GLOBAL_STATE)
for _obj, _name in (
    (torch.amp.autocast_mode._enter_autocast, "_enter_autocast"),
    (torch.amp.autocast_mode._exit_autocast, "_exit_autocast"),
    (torch._C._set_grad_enabled, "_set_grad_enabled"),
):
    name_target(_obj, _name)


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


def dropout_inactive(node: fx.Node, name: str) -> bool:
    """Whether ``node`` is a dropout that draws nothing: ``p=0`` or ``training=False``."""
    if name in DROPOUTS:
        p = _arg(node, 1, "p", 0.5)
        training = _arg(node, 2, "training" if node.op == "call_function" else "train", True)
        if node.op == "call_function" and node.target is torch.dropout:
            training = _arg(node, 2, "train", True)
        return bool(p == 0) or training is False
    return False


def is_barrier(node: fx.Node) -> bool:
    """Nothing may move across a global-state switch, an in-place op or a random op."""
    return is_global_state_op(node) or is_inplace(node) or (node.op != "placeholder" and is_rng(node))


def is_exchanged(info: Any) -> bool:
    """Whether ``info`` is a dim of rows received by a by-count exchange (its ``order`` is the
    all-to-all of the token counts), whose size per nanobatch is data-dependent."""
    return isinstance(info, BatchDim) and info.order is not None and op_name(info.order) == "c10d.all_to_all_single"
