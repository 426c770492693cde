"""Data-dependent sizes in a Dynamo-level graph: the nodes that bind unbacked symbols.

With ``torch._dynamo.config.capture_scalar_outputs`` (torchtitan sets it) a ``.tolist()`` or
``.item()`` stays in the graph and binds an unbacked symbol (``u0``): a size known only when the
graph runs, such as the split sizes of an expert-parallel ``all_to_all_single`` (torchtitan's
all-to-all dispatcher exchanges per-expert token counts, sums them per rank and reads the sums
with ``.tolist()``). The split gives each nanobatch its own copy of such a chain only where the
batch rules prove it (:mod:`kareus_fx.passes.batch_dims.exchange`); when a graph that binds
unbacked symbols is refused, the fallback reason names the first binding node and the first tensor
op that reads it, followed by the op the rules refused.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from kareus_fx.passes.batch_dims import op_name

__all__ = ["unbacked_symbol_binding"]


def _first_tensor_reader(node: fx.Node) -> fx.Node | None:
    """The first user of ``node`` (in graph order) that is an ATen or collective op, skipping the
    size checks and symbolic arithmetic Dynamo writes around a bound symbol."""
    for user in node.users:
        if isinstance(user.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return user
    return None


def unbacked_symbol_binding(gm: fx.GraphModule) -> str | None:
    """``"op (node): binds unbacked symbols u0, read by op (node)"`` for the first node of ``gm``
    or of a graph it holds (the bodies of higher-order ops) that binds unbacked symbols; None when
    there is none."""
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            bindings = node.meta.get("unbacked_bindings")
            if bindings:
                symbols = ", ".join(sorted(str(s) for s in bindings))
                reader = _first_tensor_reader(node)
                read = f", read by {op_name(reader)} ({reader.name})" if reader is not None else ""
                return f"{op_name(node)} ({node.name}): binds unbacked symbols {symbols}{read}"
    return None
