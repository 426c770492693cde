"""Ops that read only what the batch size cannot change of a batch-carrying tensor.

``x.new_ones(size)`` and its kin borrow only ``x``'s dtype and device: they become one shared
factory call. ``getattr(x, "device_mesh")`` and other batch-free attributes (placements, dtype,
device, rank, layout) are read once, from nanobatch A's copy (torchtitan reads the mesh of a DTensor
activation). ``x.new_tensor(data)`` has no rule: its data may carry the batch; it is named so that
the refusal says which op it was.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from kareus_fx.passes.batch_dims.node_args import _arg
from kareus_fx.passes.batch_dims.op_names import name_torch_objects
from kareus_fx.passes.batch_dims.propagation import BatchAnalysis, register_batch_rule
from kareus_fx.passes.batch_dims.values import Call, FromHalf, Step

name_torch_objects("new_tensor")


@register_batch_rule("new_ones", "new_zeros", "new_full", "new_empty")
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


_BATCH_FREE_ATTRS = ("device_mesh", "placements", "dtype", "device", "ndim", "layout")


@register_batch_rule("builtins.getattr")
def _rule_getattr(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """``getattr(x, "device_mesh")`` and other attributes the batch size cannot change: read once,
    shared, from nanobatch A's copy (``x.device_mesh`` of a DTensor activation, torchtitan's QKV)."""
    x, attr = node.args[0], node.args[1]
    if not isinstance(x, fx.Node) or attr not in _BATCH_FREE_ATTRS:
        raise an._fail(node, f"attribute {attr!r} may depend on the batch size")
    return Step(None, False, lambda h: Call(node.op, node.target, (FromHalf(x, 0), attr), {}))
