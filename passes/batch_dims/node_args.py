"""Reading and rewriting a node's arguments the way its op takes them: by position or keyword.

Dynamo records a call as the user wrote it, so an argument may sit at its position or under its
keyword; the readers here look in both and fall back to the op's default. Negative dims are
normalised against the tensor's rank.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from kareus_fx.passes.batch_dims.values import Call


def _arg(node: fx.Node, pos: int, name: str, default: fx.node.Argument = None) -> fx.node.Argument:
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


def _set_arg(call: Call, pos: int, name: str, value: Any) -> None:
    if len(call.args) > pos:
        args = list(call.args)
        args[pos] = value
        call.args = tuple(args)
    else:
        call.kwargs = {**call.kwargs, name: value}


def _same_call(node: fx.Node) -> Call:
    return Call(node.op, node.target, tuple(node.args), dict(node.kwargs))


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
