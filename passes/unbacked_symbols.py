"""Data-dependent sizes in a Dynamo-level graph: the nodes that bind unbacked symbols.

With ``torch._dynamo.config.capture_scalar_outputs`` (torchtitan sets it) a ``.tolist()`` or
``.item()`` stays in the graph and binds an unbacked symbol (``u0``): a size known only when the
graph runs, such as the split sizes of an expert-parallel ``all_to_all_single``. Dynamo records
the binding in ``node.meta["unbacked_bindings"]``. The nanobatch split cannot give each nanobatch
its own value of such a symbol (the symbol is bound once, by the full batch's data), and a fake run
of the graph would allocate fresh symbols that no later trace binds, so the split refuses these
graphs before running anything on them.
"""

from __future__ import annotations

import torch.fx as fx

from kareus_fx.passes.batch_dims import op_name

__all__ = ["unbacked_symbol_binding"]


def unbacked_symbol_binding(gm: fx.GraphModule) -> str | None:
    """``"op (node): binds u0, u1"`` for the first node of ``gm`` or of a graph it holds (the
    bodies of higher-order ops) that binds unbacked symbols; None when there is none."""
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            bindings = node.meta.get("unbacked_bindings")
            if bindings:
                symbols = ", ".join(sorted(str(s) for s in bindings))
                return f"{op_name(node)} ({node.name}): binds unbacked symbols {symbols}"
    return None
