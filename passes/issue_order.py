"""Reorder an aten graph to a given issue order of its computation and collectives.

The anchors (computation and collective nodes, in the order the partition pass chose) keep that
order wherever dependencies allow; every other node (waits, views, getitems, shared work) is
sunk to just before its first user, so each ``wait_tensor`` sits right before the first use of
the collective's result. Nodes no anchor needs keep their relative order at the end.

The reorder sorts by those positions and checks the result is topological; where the positions
alone break a dependency it is a topological sort (networkx) keyed by them instead. Either way
it only moves nodes within what the data dependencies allow, so it never changes what the graph
computes.
"""

from __future__ import annotations

import networkx as nx
import torch.fx

# Offset that places a node just before its first user (smaller than any gap between anchors,
# also after a chain of a few thousand sunk nodes).
_JUST_BEFORE = 1e-4


def apply_issue_order(gm: torch.fx.GraphModule, anchors: list[torch.fx.Node]) -> None:
    """Reorder ``gm``'s nodes in place to follow ``anchors``; recompiles ``gm``."""
    nodes = list(gm.graph.nodes)
    key = _sort_keys(nodes, anchors)
    order = sorted(nodes, key=key.__getitem__)
    if not _is_topological(order):
        graph = nx.DiGraph()
        graph.add_nodes_from(nodes)
        graph.add_edges_from((inp, node) for node in nodes for inp in node.all_input_nodes)
        order = list(nx.lexicographical_topological_sort(graph, key=lambda n: key[n]))
    previous = order[0]
    for node in order[1:]:
        if previous.next is not node:
            previous.append(node)
        previous = node
    gm.graph.lint()
    gm.recompile()


def _is_topological(order: list[torch.fx.Node]) -> bool:
    """Whether every node comes after all its inputs (the keys alone usually give such an order)."""
    seen: set[torch.fx.Node] = set()
    for node in order:
        if any(inp not in seen for inp in node.all_input_nodes):
            return False
        seen.add(node)
    return True


def _sort_keys(nodes: list[torch.fx.Node], anchors: list[torch.fx.Node]) -> dict[torch.fx.Node, tuple[float, int]]:
    """(position, original index): anchors at their rank, others just before their first user."""
    original = {node: i for i, node in enumerate(nodes)}
    rank = {node: float(i) for i, node in enumerate(anchors)}
    end = float(len(anchors))
    position: dict[torch.fx.Node, float] = {}
    for node in reversed(nodes):
        if node.op == "placeholder":
            position[node] = -1.0
        elif node in rank:
            position[node] = rank[node]
        elif node.op == "output":
            position[node] = end + 1.0
        else:
            users = [position[u] for u in node.users]
            first_use = min(users, default=end)
            position[node] = first_use - _JUST_BEFORE if first_use <= end else end
    return {node: (position[node], original[node]) for node in nodes}
