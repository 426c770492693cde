"""Nanobatch labels of the aten graphs ``aot_autograd`` derives from a nanobatch-split graph.

:func:`label_nanobatches` labels every node 0 (nanobatch A), 1 (nanobatch B) or None (shared:
parameter-only work, masks used by both, the loss recombination, weight-gradient sums) by
dataflow: a node belongs to the nanobatches whose entry points it depends on; depending on both
or neither gives None.

Entry points. :func:`~kareus_fx.passes.nanobatch.split_nanobatches` tags its nanobatch nodes with
``meta["custom"]["kareus_nanobatch"]``, which ``aot_autograd`` copies onto the aten nodes each one
produces (forward nodes directly; backward nodes from the forward node with the same ``seq_nr``;
backward placeholders of saved activations carry their forward node's metadata). The tag is trusted
only where a nanobatch *starts*, so later passes that add untagged nodes or ``seq_nr`` quirks do not
matter:

* forward: the slices that cut a batch input (or a shared batch-sized tensor such as a mask made in
  the graph) into the two halves: ``aten.slice`` / ``aten.narrow`` nodes whose tensor inputs carry
  no label yet;
* backward: the saved activations (placeholders). Pass the forward graph's labels as
  ``forward_labels`` (backward placeholders are named after the forward nodes they save) to label
  them exactly; without it their tags are used, which also tags parameter-derived saved values
  (such as a transposed weight) with the nanobatch whose op produced them.

Nodes that depend on no labelled node and on no input other than tangents (the slices of a
concatenated output's gradient, constants made inside an op's decomposition) take the label of
their consumers when all consumers agree. Parameter-only nodes keep None.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.fx as fx

from kareus_fx.passes.nanobatch import NANOBATCH_META

__all__ = ["label_nanobatches"]

_aten = torch.ops.aten
_ENTRY_TARGETS = {_aten.slice.Tensor, _aten.narrow.default}


def _tag(node: fx.Node) -> int | None:
    custom = node.meta.get("custom")
    if isinstance(custom, dict) and custom.get(NANOBATCH_META) in (0, 1):
        return custom[NANOBATCH_META]
    return None


def label_nanobatches(
    aten_gm: fx.GraphModule, *, forward_labels: Mapping[str, int | None] | None = None
) -> dict[str, int | None]:
    """Label each node of an aten forward or backward graph 0, 1 or None (module docstring)."""
    sets: dict[fx.Node, frozenset] = {}
    anchored: dict[fx.Node, bool] = {}  # depends on an input other than tangents
    for n in aten_gm.graph.nodes:
        if n.op == "placeholder":
            if forward_labels is not None and n.name in forward_labels:
                lab = forward_labels[n.name]
            else:
                lab = _tag(n)
            sets[n] = frozenset() if lab is None else frozenset((lab,))
            anchored[n] = not n.name.startswith("tangents")
            continue
        ins = n.all_input_nodes
        s = frozenset().union(*(sets[a] for a in ins)) if ins else frozenset()
        if not s and n.target in _ENTRY_TARGETS and _tag(n) is not None:
            s = frozenset((_tag(n),))
        sets[n] = s
        anchored[n] = any(anchored[a] for a in ins)
    # Consumer rule for free nodes, users before producers.
    for n in reversed(list(aten_gm.graph.nodes)):
        if sets[n] or anchored[n] or n.op in ("placeholder", "output"):
            continue
        users = [u for u in n.users if u.op != "output"]
        labels = {_final(sets[u]) for u in users}
        if len(labels) == 1 and None not in labels:
            sets[n] = frozenset(labels)
    return {n.name: _final(s) for n, s in sets.items()}


def _final(s: frozenset) -> int | None:
    return next(iter(s)) if len(s) == 1 else None
