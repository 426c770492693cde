"""What batch propagation decides for a value and a node: the result types every rule returns.

What a value can be (:data:`Info`):

* ``None``: shared. It does not depend on the batch (parameters, buffers, constants, masks made
  from ``torch.ones(t, t)``): computed once and used by both nanobatches. A shared tensor that has
  a batch-sized dim aligned with a batch dim of the op it feeds is sliced per nanobatch there.
* :class:`BatchDim`: dim ``dim`` holds the batch, laid out ``(p, B, k)``: ``p`` outer copies
  (an all-gather along the batch dim makes ``p`` = group size), the ``B`` batch elements, then
  ``k`` consecutive entries per element (``flatten(0, 1)`` of ``(B, T, V)`` gives ``k = T``).
  A nanobatch of ``b`` elements has size ``p * b * k`` there. Every entry depends only on its own
  batch element, so slicing commutes with the op: that is what the rules check.
* :class:`Positions`, :class:`ExpertCounts`: routing values (a sort's indices and their inverse,
  tokens per expert), one copy per nanobatch (:mod:`~kareus_fx.passes.batch_dims.routing`).
* :class:`ExchangeCounts`, :class:`SplitSizes`, :class:`RowIndex`: an expert-parallel exchange's
  token counts, the split sizes read from them and the indices of its received rows, one copy per
  nanobatch
  (:mod:`~kareus_fx.passes.batch_dims.exchange`).
* :data:`PARTIAL`: only inside the backward of an ``autograd.Function``: a shared-shaped value that
  is a nanobatch's *part* of a sum over the batch (the weight gradient ``x^T g``). Autograd adds the
  two parts because the shared input is used by both nanobatch calls; so a part may only flow
  through linear ops to the gradient of a shared input.
* a tuple of the above, for ops that return several values (``chunk``, ``max(dim)``, the HOP).

A rule's decision for a node is a :class:`Step`; how a nanobatch's copy is emitted is a
:class:`Call` whose arguments may hold markers (:class:`SliceOf`, :class:`Whole`,
:class:`FromHalf`, :class:`IndexOffsetBody`, and the body marker of
:mod:`~kareus_fx.passes.batch_dims.propagation`) that the rewriter resolves per nanobatch.

Sizes are ints or, under dynamic shapes, sympy expressions over Dynamo's shape symbols: reading
them installs no guard, so an equality a rule cannot prove is refused, never assumed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx as fx

from kareus_fx.errors import UnsupportedGraphError


class Unsupported(UnsupportedGraphError):
    """The graph cannot be proved safe to split; the message names the op and the reason."""


@dataclass(frozen=True)
class BatchDim:
    """Dim ``dim`` carries the batch, laid out ``(p, B, k)`` (see the module docstring).

    ``order`` is None when a nanobatch's copy is its slice of the full value. A node (a ``sort``
    of routing keys) means the dim is in *routed* order: a nanobatch's copy holds the entries of
    its slice, permuted by that nanobatch's own sort, so it equals no slice of the full value.
    Routed values meet only values routed by the same sort; they are never sliced from shared
    values, reshaped across the routed dim, nor returned, until a gather by the sort's inverse
    (:mod:`~kareus_fx.passes.batch_dims.routing`) puts them back in batch order.

    ``order`` may also be the all-to-all that exchanged a sort's token counts: the dim then holds
    the rows that the nanobatch's by-count exchange received (:func:`~.op_names.is_exchanged`), a number
    known only when the graph runs; :meth:`size` does not apply to it."""

    dim: int
    k: int = 1
    p: int = 1
    order: fx.Node | None = None

    def size(self, b: int) -> int:
        """Size of the dim for a (nano)batch of ``b`` elements."""
        return self.p * b * self.k

    def moved(self, dim: int) -> BatchDim:
        return BatchDim(dim, self.k, self.p, self.order)


@dataclass(frozen=True)
class Positions:
    """A 1-D integer tensor laid out as ``layout`` whose values are positions, local to the
    nanobatch, along a dim laid out as ``space``: a sort's indices (routed layout, batch-order
    space) or their inverse (batch-order layout, routed space)."""

    layout: BatchDim
    space: BatchDim


@dataclass(frozen=True)
class ExpertCounts:
    """Per-nanobatch counts (``cumulative``: their running sum) of the expert ids that the sort
    ``order`` sorts ascending, one entry per expert: each nanobatch counts its own tokens, so its
    copy differs from the full batch's and is only ever read as group offsets of rows routed by
    ``order``."""

    order: fx.Node
    cumulative: bool


@dataclass(frozen=True)
class ExchangeCounts:
    """Per-nanobatch token counts of an expert-parallel exchange: derived from the counts per
    expert of the ids that the sort ``order`` sorts (``exchange`` None), or from those counts as
    the all-to-all ``exchange`` received them from every rank. Each nanobatch counts its own
    tokens; the shape is the full batch's."""

    order: fx.Node
    exchange: fx.Node | None


@dataclass(frozen=True)
class SplitSizes:
    """Per-nanobatch Python sizes read from :class:`ExchangeCounts` (``.item()`` binds an unbacked
    symbol in each nanobatch's copy), comparisons and sums of them, and the sizes of received
    rows: ``exchange`` as in :class:`ExchangeCounts`."""

    order: fx.Node
    exchange: fx.Node | None


@dataclass(frozen=True)
class RowIndex:
    """An integer tensor with one entry per row an exchange received (``layout``, its rows' dim
    first, then size-1 dims), in the nanobatch's own numbering: ``"position"``, where a row sits
    in the received rows (only ever a gather or scatter index of those rows), or ``"segment"``,
    which count the row falls in (its expert; compared with the experts' ids it selects the
    row's expert for its data)."""

    layout: BatchDim
    kind: Literal["position", "segment"]


class _Partial:
    def __repr__(self) -> str:
        return "PARTIAL"


PARTIAL = _Partial()
Info = Any  # None | BatchDim | Positions | ExpertCounts | ExchangeCounts | SplitSizes | RowIndex | PARTIAL | tuple


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
class IndexOffsetBody:
    """Marker in a rewritten argument: a copy of a ``flex_attention`` score or mask function
    (``get_attr`` target) whose batch-index argument (placeholder ``pos``) is shifted by the
    nanobatch's first batch element, so it reads captured full-batch buffers at global indices."""

    target: str
    pos: int


@dataclass(frozen=True)
class Whole:
    """Marker in a rewritten argument: the full-batch value of a batch-carrying graph input."""

    node: fx.Node


@dataclass(frozen=True)
class FromHalf:
    """Marker in a rewritten argument: nanobatch ``h``'s copy of a batch-carrying node."""

    node: fx.Node
    h: int


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
