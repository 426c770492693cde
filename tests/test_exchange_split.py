"""The nanobatch split of an expert-parallel exchange by token counts, torchtitan's all-to-all
token dispatcher's op chain written out (a one-hot routing map of the top-k ids summed into
tokens per expert, a statistics buffer updated in place, the counts' all-to-all, ``.tolist()``
of the per-rank sums, the uneven dispatch, the expert-major permutation by ``repeat_interleave``
of the received counts, the experts row by row, the ``new_empty``/``setitem`` unpermute, the
combine, a scatter-add back to token order) on 2 gloo ranks through ``backend="kareus"``.

Each nanobatch must route its own tokens: two copies of every ``.item()``, and every all-to-all
reads only its own nanobatch's sizes. Loss, gradients and the statistics buffer equal eager's
(fp32, loss rtol 1e-5, gradients rtol 1e-4 atol 1e-6). A variant whose token weights read their
expert's load (a token's result then depends on the other tokens) falls back, naming the op.

The default tests run the split graph through ``aot_autograd`` with eager kernels (its re-trace
rebinds the split graph's unbacked symbols); the slow one compiles it with ``backend="kareus"``.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from dist_harness import run_distributed
from eager_parity import assert_matches_eager, eager_reference

DIM, EXPERTS, TOP_K, HIDDEN, CAPACITY, RECEIVE_CAPACITY = 8, 4, 2, 6, 5, 20


class CountExchangeMoE(nn.Module):
    """A residual MoE layer with expert parallelism over the world (each rank holds
    ``EXPERTS / world`` experts). Two variants make a token's result depend on the other tokens
    of the batch, which the split must refuse: ``"load_weighted"`` scales each token's weights by
    its experts' token counts; ``"capacity"`` drops (weights 0) the routed rows past ``CAPACITY``
    in their expert's group; ``"receive_capacity"`` drops the received rows past
    ``RECEIVE_CAPACITY``."""

    tokens_per_expert: torch.Tensor

    def __init__(self, world_size: int, variant: str = "dropless"):
        super().__init__()
        local = EXPERTS // world_size
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.w1 = nn.Parameter(torch.randn(local, HIDDEN, DIM) / DIM**0.5)
        self.w2 = nn.Parameter(torch.randn(local, DIM, HIDDEN) / HIDDEN**0.5)
        self.register_buffer("tokens_per_expert", torch.zeros(EXPERTS))
        self.variant = variant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ep = dist.get_world_size()
        group: Any = dist.group.WORLD
        scores = self.router(x).softmax(dim=-1)
        ids = torch.topk(scores, TOP_K, dim=-1, sorted=False).indices
        top = scores.gather(-1, ids)
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ids, True)
        counts = routing_map.sum(dim=(0, 1))
        if self.variant == "load_weighted":
            top = top * counts[ids]
        with torch.no_grad():
            self.tokens_per_expert.add_(counts)
        x_td = x.view(-1, DIM)
        order = torch.argsort(ids.view(-1, TOP_K).view(-1), stable=True)
        sorted_scores = top.view(-1, TOP_K).view(-1)[order]
        if self.variant == "capacity":
            slot = torch.arange(order.shape[0]) - (counts.cumsum(0) - counts)[ids.view(-1)[order]]
            sorted_scores = sorted_scores * (slot < CAPACITY)
        token_of_row = order // TOP_K
        rows = x_td[token_of_row]
        with torch.no_grad():
            received = funcol.all_to_all_single(counts.view(ep, -1), None, None, group)
            received = torch.ops._c10d_functional.wait_tensor(received).reshape(-1)
            in_sizes = counts.view(ep, -1).sum(dim=1).to(torch.device("cpu"), non_blocking=True).tolist()
            out_sizes = received.view(ep, -1).sum(dim=1).to(torch.device("cpu")).tolist()
        got = funcol.all_to_all_single(rows, out_sizes, in_sizes, group)
        shape = got.shape
        if self.variant == "receive_capacity":
            got = got * (torch.arange(got.shape[0]) < RECEIVE_CAPACITY)[:, None]
        got, perm, local_counts = _permute(got, received, ep)
        y = self._experts(got, local_counts)
        back = y.new_empty(shape)
        back[perm, :] = y
        done = funcol.all_to_all_single(back, in_sizes, out_sizes, group)
        done = done * sorted_scores.reshape(-1, 1)
        out = torch.zeros_like(x_td).scatter_add(0, token_of_row.reshape(-1, 1).expand(-1, DIM), done)
        return (x + out.view(x.shape[0], -1, DIM)).square().sum()

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Every local expert on every row, a 0/1 mask keeping the row's own expert."""
        local = counts.shape[0]
        expert_of_row = torch.repeat_interleave(torch.arange(local), counts, output_size=rows.shape[0])
        mask = (expert_of_row[:, None] == torch.arange(local)).to(rows.dtype)
        out = torch.zeros_like(rows)
        for e in range(local):
            out = out + (torch.nn.functional.silu(rows @ self.w1[e].t()) @ self.w2[e].t()) * mask[:, e, None]
        return out


def _permute(got: torch.Tensor, received: torch.Tensor, ep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchtitan's rank-major to expert-major permutation of the received rows."""
    local = received.shape[0] // ep
    total = got.shape[0]
    t_mat = received.view(ep, local)
    input_starts = (received.cumsum(0) - received).view(ep, local).t().reshape(-1)
    segment_lens = t_mat.t().reshape(-1)
    seg_ids = torch.arange(segment_lens.shape[0]).repeat_interleave(segment_lens, output_size=total)
    output_starts = segment_lens.cumsum(0) - segment_lens
    perm = input_starts[seg_ids] + torch.arange(seg_ids.shape[0]) - output_starts[seg_ids]
    return got[perm, :], perm, t_mat.sum(0)


def _routing(gm: torch.fx.GraphModule) -> dict[str, Any]:
    """Each nanobatch's ``.item()`` count, and the nanobatches of every all-to-all and of the
    size nodes it reads."""
    from kareus_fx.passes.nanobatch import NANOBATCH_META

    items = [n.meta.get(NANOBATCH_META) for n in gm.graph.nodes if n.op == "call_method" and n.target == "item"]
    exchanges = []
    for n in gm.graph.nodes:
        if "all_to_all_single" in str(n.target):
            split_sizes = [*(n.args[1] or ()), *(n.args[2] or ())]
            sizes = {s.meta.get(NANOBATCH_META) for s in split_sizes if isinstance(s, torch.fx.Node)}
            exchanges.append((n.meta.get(NANOBATCH_META), sorted(sizes, key=str)))
    return {"items": sorted(items, key=str), "exchanges": exchanges}


def _split_then_aot_eager(results: list[Any]) -> Any:
    """A backend that splits the graph (keeping the result) and runs it through ``aot_autograd``
    with eager kernels: the split graph's unbacked bindings go through the re-trace, no Inductor."""
    from torch._dynamo.backends.registry import lookup_backend

    from kareus_fx.passes.nanobatch import split_nanobatches

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        result = split_nanobatches(gm, example_inputs)
        results.append(result)
        return lookup_backend("aot_eager")(result.gm, example_inputs)

    return backend


def _run(rank: int, world_size: int, variant: str, backend: str) -> dict[str, Any]:
    from kareus_fx.passes.nanobatch import NanobatchFallbackWarning

    torch._dynamo.config.capture_scalar_outputs = True
    torch.manual_seed(0)
    model = CountExchangeMoE(world_size, variant)
    x = torch.randn(4, 3, DIM) + rank
    eager_loss, eager_grads = eager_reference(model, {"x": x})
    eager_counts = model.tokens_per_expert.clone()
    results: list[Any] = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        compile_with = _split_then_aot_eager(results) if backend == "aot_eager" else backend
        if backend == "kareus":
            _record_splits(results)
        loss = torch.compile(model, backend=compile_with)(x)
        loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    assert_matches_eager(model, loss, eager_loss, eager_grads, {"rtol": 1e-4, "atol": 1e-6}, f"rank {rank}")
    torch.testing.assert_close(model.tokens_per_expert, 2 * eager_counts, rtol=0, atol=0)
    return {
        "fallbacks": [str(w.message) for w in record if issubclass(w.category, NanobatchFallbackWarning)],
        "routing": [_routing(r.gm) for r in results if r.split],
    }


def _record_splits(results: list[Any]) -> None:
    """Make the kareus backend's compile step keep each split result in ``results``."""
    from kareus_fx.capture import compile_step
    from kareus_fx.passes.nanobatch import split_nanobatches

    def recording(gm: Any, example_inputs: list[Any], **kwargs: Any) -> Any:
        result = split_nanobatches(gm, example_inputs, **kwargs)
        results.append(result)
        return result

    compile_step.split_nanobatches = recording


def _assert_routes_per_nanobatch(result: dict[str, Any]) -> None:
    assert result["fallbacks"] == [], result
    [routing] = result["routing"]
    assert routing["items"] == [0] * 4 + [1] * 4, routing  # 2 input and 2 output sizes each
    # per nanobatch: the counts' exchange, the dispatch and the combine, each reading its own sizes
    assert sorted(routing["exchanges"]) == [(0, []), (0, [0]), (0, [0]), (1, []), (1, [1]), (1, [1])], routing


def test_each_nanobatch_exchanges_its_own_counts_and_matches_eager():
    for result in run_distributed(_run, 2, "dropless", "aot_eager", timeout_s=300):
        _assert_routes_per_nanobatch(result)


@pytest.mark.parametrize(
    ("variant", "why"),
    [
        ("load_weighted", "indexes with or into token counts"),
        ("capacity", "indexes with or into token counts"),
        ("receive_capacity", "compares received rows' indices"),
    ],
)
def test_a_token_result_that_depends_on_other_tokens_falls_back(variant, why):
    for result in run_distributed(_run, 2, variant, "aot_eager", timeout_s=300):
        assert result["routing"] == [], result
        assert result["fallbacks"] and all("binds unbacked symbols" in m and why in m for m in result["fallbacks"]), (
            result
        )


def test_verification_refuses_a_nanobatch_reading_the_other_ones_symbol():
    """A hand-built split graph whose nanobatch-1 node sizes a tensor by nanobatch 0's ``.item()``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from kareus_fx.passes.batch_dims import Unsupported
    from kareus_fx.passes.nanobatch_verify import verify_split

    graph = torch.fx.Graph()
    counts = graph.placeholder("counts")
    item_a = graph.call_method("item", (graph.call_function(operator.getitem, (counts, 0)),))
    item_b = graph.call_method("item", (graph.call_function(operator.getitem, (counts, 1)),))
    rows_b = graph.call_function(torch.ones, (item_a, DIM))  # nanobatch 1 must size by item_b
    graph.output((rows_b, item_b))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    mode = FakeTensorMode(shape_env=ShapeEnv(allow_scalar_outputs=True))
    fake_counts = mode.from_tensor(torch.tensor([3, 4]))
    expected = {item_a: (None, None, 0), item_b: (None, None, 1), rows_b: (None, None, 1)}
    with pytest.raises(Unsupported, match="reads nanobatch 0's symbol"):
        verify_split(gm, mode, [fake_counts], (1, 1), expected, {})
    rows_b.replace_input_with(item_a, item_b)
    verify_split(gm, mode, [fake_counts], (1, 1), expected, {})  # its own symbol: accepted


@pytest.mark.slow  # about 2 minutes on a loaded 2-core machine (Inductor compiles each rank's graph)
def test_split_exchange_compiles_with_the_kareus_backend_and_matches_eager():
    for result in run_distributed(_run, 2, False, "kareus", timeout_s=300):
        _assert_routes_per_nanobatch(result)
