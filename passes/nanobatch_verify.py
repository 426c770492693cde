"""Soundness check of a nanobatch-split graph: a fake run in which every node must have the shape
the batch analysis expects (:mod:`kareus_fx.passes.nanobatch` calls :func:`verify_split`).

A rewrite bug must give a fallback, never wrong numbers or a broken compile: the split graph runs
on fake tensors, each node listed in ``expected`` must come out with the shape its full-batch
original implies for its nanobatch, every op must run, and the per-nanobatch bodies of HOPs
(autograd.Function forward and backward, activation checkpoint) run on their inputs as well. The
fake values are recorded as ``meta["example_value"]``, as Dynamo does, and the unbacked symbols a
node binds (a nanobatch's ``.item()``) as ``meta["unbacked_bindings"]``; a node may read only the
unbacked symbols its own nanobatch or shared work bound. A size that only the run knows (rows an
exchange received) is not predicted; its symbols are checked instead.

Cost. A deep model repeats one layer, and with an even batch nanobatch B repeats A, so most nodes
of a split graph are an op an earlier node already ran on inputs with the same metadata. A fake
run is metadata propagation: such a node's outputs are a function of the op (target and
non-tensor arguments), each tensor input's metadata (type, shape, stride, storage offset and
size, dtype, device, layout, requires_grad, conj and neg bits) and the dispatch state (grad mode,
inference mode, default dtype, autocast). :class:`_OutputMemo` keeps the outputs of the first such
node and gives later ones fresh fake tensors with the same metadata, so each distinct
(op, input metadata) runs once. Every node's own shape is still compared with its own
expectation. A HOP's key also holds a structural fingerprint of its bodies (their ops, argument
wiring and the shape each body node is expected to have): a HOP that matches an earlier one runs
bodies already checked, on the same inputs, against the same expectations.

The memo is used only where it cannot change what the check sees. It covers nanobatch nodes
(an ``expected`` entry with a nanobatch): the analysis refuses in-place ops on their values, so
a fresh tensor (no aliasing, no autograd history) behaves as the original would; and never a
node that mutates (in-place method, ``out=``), has a mutating user, switches global state or
draws random numbers. Outputs other than plain fake tensors with static shapes (DTensor and other
subclasses, constants, symbolic sizes) and inputs or arguments it cannot describe exactly make
the node run normally.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager
from torch.fx.experimental.symbolic_shapes import compute_unbacked_bindings, free_unbacked_symbols
from torch.fx.immutable_collections import immutable_dict, immutable_list

from kareus_fx.passes.batch_dims import BatchDim, Unsupported, is_barrier, is_inplace, op_name
from kareus_fx.passes.batch_dims.op_names import is_exchanged
from kareus_fx.passes.batch_dims.values import Positions, RowIndex, _shape

__all__ = ["FakeRun", "verify_split"]

# Non-tensor argument and output values compared by value (the type too: 1 == 1.0 == True).
_SCALAR_TYPES = frozenset(
    {
        type(None),
        bool,
        int,
        float,
        complex,
        str,
        torch.dtype,
        torch.device,
        torch.layout,
        torch.memory_format,
        type(Ellipsis),
    }
)
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "hpu", "mps")
_PLAIN = {immutable_list: list}  # fx's argument containers, described as what they hold


class _NoKey(Exception):
    """A value the memo cannot describe exactly: the node runs normally."""


@dataclass(frozen=True)
class _TensorMeta:
    """Everything a fake tensor carries that an op's fake output can depend on."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage_bytes: int
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    is_conj: bool
    is_neg: bool

    @staticmethod
    def of(t: torch.Tensor) -> _TensorMeta:
        if type(t) is not FakeTensor or t.layout is not torch.strided or t.constant is not None:
            raise _NoKey
        offset = t.storage_offset()
        if type(offset) is not int or not all(type(s) is int for s in (*t.shape, *t.stride())):
            raise _NoKey  # symbolic sizes
        nbytes = t.untyped_storage().nbytes()
        if type(nbytes) is not int:
            raise _NoKey
        return _TensorMeta(
            tuple(t.shape),
            t.stride(),
            offset,
            nbytes,
            t.dtype,
            t.device,
            t.requires_grad,
            t.is_conj(),
            t.is_neg(),
        )

    def fresh(self, mode: FakeTensorMode) -> FakeTensor:
        """A new fake tensor with this metadata (what ``FakeTensorMode``'s own cache builds)."""
        with in_kernel_invocation_manager(mode):
            if self.storage_offset == 0 and self.storage_bytes == _bytes_spanned(self):
                meta = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")
            else:
                meta = torch.empty(self.storage_bytes // self.dtype.itemsize, dtype=self.dtype, device="meta")
                meta.set_(meta.untyped_storage(), self.storage_offset, self.shape, self.stride)
            if self.is_conj:
                torch._C._set_conj(meta, True)
            if self.is_neg:
                torch._C._set_neg(meta, True)
            meta.requires_grad_(self.requires_grad)
        return FakeTensor(mode, meta, self.device)


def _bytes_spanned(m: _TensorMeta) -> int:
    if any(s == 0 for s in m.shape):
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(m.shape, m.stride))) * m.dtype.itemsize


def _freeze(value: Any, body_key) -> Any:
    """A hashable, exact description of an argument or output (raises :class:`_NoKey`)."""
    kind = type(value)
    if kind in _SCALAR_TYPES:
        return (kind, value)
    if isinstance(value, torch.Tensor):
        return _TensorMeta.of(value)
    if kind in (tuple, list, torch.Size, immutable_list):
        return (_PLAIN.get(kind, kind), tuple(_freeze(v, body_key) for v in value))
    if kind in (dict, immutable_dict):
        return (dict, tuple((k, _freeze(v, body_key)) for k, v in value.items()))
    if kind is slice:
        return (kind, _freeze(value.start, body_key), _freeze(value.stop, body_key), _freeze(value.step, body_key))
    if isinstance(value, fx.GraphModule):
        return (fx.GraphModule, body_key(value))
    raise _NoKey


def _thaw(frozen: Any, mode: FakeTensorMode) -> Any:
    """Fresh values from an output description made by :func:`_freeze`."""
    if isinstance(frozen, _TensorMeta):
        return frozen.fresh(mode)
    kind, *parts = frozen
    if kind in (tuple, list, torch.Size):
        return kind([_thaw(v, mode) for v in parts[0]])
    if kind is dict:
        return {k: _thaw(v, mode) for k, v in parts[0]}
    if kind is slice:
        return slice(*(_thaw(v, mode) for v in parts))
    return parts[0]  # an immutable scalar


def _no_modules(gm: fx.GraphModule) -> tuple:
    raise _NoKey  # an output that is a module


def _dispatch_state() -> tuple:
    """Global state that changes what an op's fake output looks like."""
    autocast: tuple[tuple[bool, torch.dtype], ...] = ()
    if torch._C._is_any_autocast_enabled():
        autocast = tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES)
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.get_default_dtype(), autocast)


def _mutates(n: fx.Node) -> bool:
    return is_inplace(n) or "out" in n.kwargs


class _OutputMemo:
    """Outputs of the nanobatch nodes run so far, by op and input metadata (module docstring)."""

    def __init__(self, run: FakeRun):
        self.run = run  # the top-level run: expectations, halves, bodies
        self.outputs: dict[tuple, tuple[Any, fx.Node]] = {}
        self.fingerprints: dict[fx.GraphModule, tuple] = {}
        self.served: list[fx.Node] = []  # nodes whose outputs came from the memo

    def covers(self, n: fx.Node) -> bool:
        expected = self.run.expected.get(n)
        return (
            expected is not None
            and expected[2] is not None
            and n.op in ("call_function", "call_method")
            and not is_barrier(n)
            and not _mutates(n)
            and not any(_mutates(u) for u in n.users)
        )

    def key(self, n: fx.Node, args: tuple, kwargs: dict) -> tuple | None:
        try:
            return (
                n.op,
                n.target,
                _freeze(args, self.fingerprint),
                _freeze(kwargs, self.fingerprint),
                _dispatch_state(),
            )
        except _NoKey:
            return None

    def fingerprint(self, gm: fx.GraphModule) -> tuple:
        """Structure of a HOP body and the shape each of its nodes is expected to have."""
        if gm not in self.fingerprints:
            index: dict[fx.Node, int] = {}
            rows = []
            for i, node in enumerate(gm.graph.nodes):
                index[node] = i
                if node.op == "get_attr":
                    target = _freeze(operator.attrgetter(node.target)(gm), self.fingerprint)
                elif node.op in ("call_function", "call_method", "placeholder", "output"):
                    target = node.target if node.op != "placeholder" else None
                else:
                    raise _NoKey
                # map_arg's stub wants the callback to return an fx Argument; it returns any value.
                wiring = fx.node.map_arg((node.args, node.kwargs), lambda a: _NodeRef(index[a]))  # type: ignore[arg-type,return-value]
                rows.append((node.op, target, _freeze_wiring(wiring, self.fingerprint), self.run.wanted(node)))
            self.fingerprints[gm] = tuple(rows)
        return self.fingerprints[gm]

    def lookup(self, n: fx.Node, key: tuple) -> tuple[Any, fx.Node] | None:
        hit = self.outputs.get(key)
        if hit is None:
            return None
        self.served.append(n)
        return _thaw(hit[0], self.run.mode), hit[1]

    def store(self, key: tuple, n: fx.Node, out: Any) -> None:
        try:
            self.outputs[key] = (_freeze(out, _no_modules), n)
        except _NoKey:
            pass


@dataclass(frozen=True)
class _NodeRef:
    """A graph input of a body node, by position in the body."""

    index: int


def _freeze_wiring(value: Any, body_key) -> Any:
    if isinstance(value, _NodeRef):
        return value
    if type(value) in (tuple, list, immutable_list):
        return (_PLAIN.get(type(value), type(value)), tuple(_freeze_wiring(v, body_key) for v in value))
    if type(value) in (dict, immutable_dict):
        return (dict, tuple((k, _freeze_wiring(v, body_key)) for k, v in value.items()))
    return _freeze(value, body_key)


class FakeRun(fx.Interpreter):
    """Runs a graph on fake tensors; with ``expected``, checks every listed node's shape, records
    the fake values as ``meta["example_value"]`` and runs HOP bodies (``bodies``) too.

    ``expected`` maps a node to (full-batch fake value of the node it copies, its batch info,
    its nanobatch or None); ``bodies`` maps a HOP node to its per-nanobatch body modules.
    """

    def __init__(
        self, gm, mode, halves=None, expected=None, bodies=None, *, reuse_outputs=False, memo=None, owners=None
    ):
        super().__init__(gm)
        self.mode = mode
        self.halves = halves
        self.vals: dict[fx.Node, Any] = {}
        self.expected = expected
        self.bodies = bodies or {}
        # unbacked symbol -> the nanobatch (None: shared) of the node that bound it in this run
        self.owners: dict[Any, int | None] = {} if owners is None else owners
        if memo is None and reuse_outputs and expected is not None:
            memo = _OutputMemo(self)
        self.memo: _OutputMemo | None = memo

    def run(self, *args: Any, initial_env: dict[fx.Node, Any] | None = None, enable_io_processing: bool = True) -> Any:
        with self.mode, _restoring_global_state():
            return super().run(*args, initial_env=initial_env, enable_io_processing=enable_io_processing)

    def run_node(self, n):
        try:
            out, exemplar = self._evaluate(n)
        except Unsupported:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised as Unsupported: a rewrite produced an op that does not run
            raise Unsupported(f"internal check failed at {n.name} ({op_name(n)}): {type(e).__name__}: {e}") from None
        self.vals[n] = out
        bindings = compute_unbacked_bindings(self.mode.shape_env, out)
        if self.expected is not None:
            if n.op == "placeholder" and isinstance(out, (torch.Tensor, torch.SymInt)):
                self.owners.update(dict.fromkeys(free_unbacked_symbols(out), None))  # the graph's inputs
            if bindings:
                n.meta["unbacked_bindings"] = bindings
                h = self.expected[n][2] if n in self.expected else None
                self.owners.update(dict.fromkeys(bindings, h))
            if n in self.expected:
                self._check_shape(n, out, *self.expected[n])
                self._check_symbols(n, out, self.expected[n][2])
            if n.op not in ("output", "get_attr"):
                n.meta["example_value"] = out
        if n in self.bodies:
            if exemplar is None:
                self._check_bodies(n)
            else:
                _copy_body_values(self.bodies[exemplar], self.bodies[n])
        return out

    def _evaluate(self, n) -> tuple[Any, fx.Node | None]:
        """The node's value, and the earlier node it was taken from (None: it ran)."""
        if self.memo is None or not self.memo.covers(n):
            return super().run_node(n), None
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            key = self.memo.key(n, args, kwargs)
            hit = self.memo.lookup(n, key) if key is not None else None
            if hit is not None:
                return hit
            out = getattr(self, n.op)(n.target, args, kwargs)
        if key is not None:
            self.memo.store(key, n, out)
        return out, None

    def _run_sub(self, gm, *args):
        run = FakeRun(gm, self.mode, self.halves, self.expected, self.bodies, memo=self.memo, owners=self.owners)
        return run.run(*args)

    def _check_bodies(self, n):
        """Run a HOP's per-nanobatch bodies on its fake inputs (and an autograd.Function's
        backward body on fake gradients), so shapes inside the bodies are checked too."""
        bodies = self.bodies[n]
        args = [self.vals[a] if isinstance(a, fx.Node) else a for a in n.args[len(bodies) :]]
        if len(bodies) == 1:  # tag_activation_checkpoint
            self._run_sub(bodies[0], *args)
            return
        fwd, bwd = bodies
        fwd_outs, saved = self._run_sub(fwd, *args)
        self._run_sub(bwd, *[torch.zeros_like(o) for o in fwd_outs], *saved)

    def wanted(self, n: fx.Node) -> Any:
        """The shape(s) ``n`` must have (None: not checked)."""
        return self._want(*self.expected[n]) if n in self.expected else None

    def _check_shape(self, n, out, v, info, h) -> None:
        want = self._want(v, info, h)
        got = _shapes(out)
        if want is not None and not _matches(got, want):
            raise Unsupported(f"internal check failed at {n.name} ({op_name(n)}): shape {got}, expected {want}")

    def _check_symbols(self, n, out, h) -> None:
        """A nanobatch's node reads only the unbacked symbols its own nanobatch (or shared work)
        bound in this run; a shared node only shared ones: never the other nanobatch's, nor the
        unsplit graph's."""
        if not isinstance(out, (torch.Tensor, torch.SymInt, torch.SymBool, tuple, list)):
            return
        for symbol in free_unbacked_symbols(out):
            if symbol not in self.owners or self.owners[symbol] not in (None, h):
                whose = f"nanobatch {self.owners[symbol]}'s" if symbol in self.owners else "an unbound"
                raise Unsupported(f"internal check failed at {n.name} ({op_name(n)}): reads {whose} symbol {symbol}")

    def _want(self, v, info, h):
        if isinstance(v, (tuple, list)):
            infos = info if isinstance(info, tuple) else (info,) * len(v)
            return tuple(self._want(x, i, h) for x, i in zip(v, infos))
        if not isinstance(v, torch.Tensor):
            return None
        s = list(_shape(v))
        if isinstance(info, (Positions, RowIndex)):
            info = info.layout
        if isinstance(info, BatchDim) and (is_exchanged(info) or free_unbacked_symbols(s[info.dim])):
            s[info.dim] = _ANY  # a count known only at run time (rows received or returned by an
            # exchange): the nanobatch's own, which _check_symbols checks
        elif isinstance(info, BatchDim):
            s[info.dim] = info.size(self.halves[h])
        return tuple(s)


_ANY = object()
"""A size :meth:`FakeRun._want` does not predict (any size matches)."""


def _matches(got: Any, want: Any) -> bool:
    if want is _ANY:
        return True
    if isinstance(want, tuple) and isinstance(got, tuple):
        return len(got) == len(want) and all(_matches(g, w) for g, w in zip(got, want))
    return got == want


@contextlib.contextmanager
def _restoring_global_state() -> Iterator[None]:
    """Grad mode and autocast as they were: a check that fails between a graph's switch and its
    undo must not leave the rest of the compile (``aot_autograd`` of the fallback) in it."""
    grad_enabled = torch.is_grad_enabled()
    autocast_dtypes = {d: torch.get_autocast_dtype(d) for d in _AUTOCAST_DEVICES}
    with torch._C._PreserveDispatchKeyGuard():  # autocast on/off is dispatch-key state
        try:
            yield
        finally:
            torch.set_grad_enabled(grad_enabled)
            for device, dtype in autocast_dtypes.items():
                torch.set_autocast_dtype(device, dtype)


def _copy_body_values(checked: tuple[fx.GraphModule, ...], same: tuple[fx.GraphModule, ...]) -> None:
    """``meta["example_value"]`` of bodies identical to already checked ones, node by node."""
    for checked_gm, same_gm in zip(checked, same):
        for a, b in zip(checked_gm.graph.nodes, same_gm.graph.nodes):
            if "example_value" in a.meta:
                b.meta["example_value"] = a.meta["example_value"]


def _shapes(out):
    if isinstance(out, (tuple, list)):
        return tuple(_shapes(o) for o in out)
    if not isinstance(out, torch.Tensor):
        return None
    return _shape(out)  # symbolic sizes as expressions: comparing them installs no guard


def verify_split(
    gm: fx.GraphModule,
    mode: FakeTensorMode,
    fake_inputs: list,
    halves: tuple[int, int],
    expected: dict,
    bodies: dict,
    *,
    reuse_outputs: bool = True,
) -> FakeRun:
    """Fake-run the split graph ``gm`` and check it (module docstring); raises
    :class:`~kareus_fx.passes.batch_dims.Unsupported` naming the first node that fails.

    ``reuse_outputs=False`` runs every node (the reference the memo is tested against). Returns
    the run: ``vals`` holds the top-level values, ``memo.served`` the nodes the memo answered.
    """
    run = FakeRun(gm, mode, halves, expected, bodies, reuse_outputs=reuse_outputs)
    run.run(*fake_inputs)
    return run
