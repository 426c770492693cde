"""Planning from a slice of layers (``kareus_fx/plan/layer_slice.py``) gives the full trace's graphs.

The fast tests trace a 6-layer model both ways at a small shape; the slow test plans two paper
presets both ways and compares the plans (every time and energy there is a simulated-A100
cost-model prediction).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter

import pytest

from kareus_fx.capture.dump import load_dump
from kareus_fx.plan.graph_workload import graph_fingerprint, partitioned_graphs
from kareus_fx.plan.layer_slice import (
    SLICE_LAYERS,
    SliceNotRepresentativeError,
    added_layer,
    extend_dump,
    inserted_block,
)
from kareus_fx.plan.planner import make_plan
from kareus_fx.plan.request import PlanRequest, plan_request_from_preset
from kareus_fx.plan.stage_tracing import trace_stages
from kareus_fx.workload import OpCost, fused_kernels

FRONTIER_RTOL = 1e-3
"""The bound: every method's frontier within 0.1 % of the full trace's."""


def test_added_layer_is_the_nodes_one_more_layer_adds():
    # embedding E, layers (a b), head H; one more layer adds one a and one b, wherever they sit
    assert added_layer(list("EababH"), list("EabababH"), "toy") == [5, 6]
    assert added_layer(list("EababxH"), list("EabxabxabH"), "toy") == [6, 7, 8]
    with pytest.raises(SliceNotRepresentativeError, match="fewer nodes"):
        added_layer(list("EabcH"), list("EababH"), "toy")
    with pytest.raises(SliceNotRepresentativeError, match="adds no nodes"):
        added_layer(list("EabH"), list("EbaH"), "toy")


def test_inserted_block_is_the_first_difference_of_a_clean_insertion():
    # head h, last layer L, middle layer (a b c), first layer (a b d), embedding e: the block is
    # the middle layer rotated to where the first and middle layers first differ
    assert inserted_block(list("hLabde"), list("hLabcabde")) == (4, 3)
    assert inserted_block(list("hLabde"), list("hLacbdbe")) is None  # interleaved, not one block


def _kernel_node(name: str, kernel: str | None) -> dict:
    return {
        "name": name,
        "op": f"aten.{name}",
        "kind": "compute",
        "shape": [8],
        "dtype": "torch.bfloat16",
        "flops": 1.0,
        "bytes": 2.0,
        "bound": "memory",
        "kernel": kernel,
    }


def test_copies_chain_a_kernel_that_spans_the_layer_boundary():
    """A layer (norm mm add) whose residual add fuses into the next layer's norm: a 3-layer
    slice extended to 5 layers runs the kernels of a 5-layer trace, one add+norm per boundary."""

    def layers(n: int) -> list[dict]:
        nodes = [_kernel_node("embed", "k0")]
        for i in range(n):
            nodes += [
                _kernel_node("norm", f"k{2 * i}"),
                _kernel_node("mm", f"m{i}"),
                _kernel_node("add", f"k{2 * i + 2}"),
            ]
        return [*nodes, _kernel_node("head", f"k{2 * n}")]

    def kernels(nodes):
        return [
            k.target
            for k in fused_kernels(
                OpCost(n["name"], n["op"], n["flops"], n["bytes"], n["bound"], n["kernel"]) for n in nodes
            )
        ]

    two, three = ({"graphs": [{"name": "forward", "nodes": layers(n)}]} for n in (2, 3))
    five = extend_dump(two, three, 3, 5, "toy")["graphs"][0]["nodes"]
    assert kernels(five) == kernels(layers(5)) == ["aten.embed", *["aten.mm", "aten.add"] * 5]


def _node(name: str, op: str, shape: list[int]) -> dict:
    return {"name": name, "op": op, "kind": "compute", "shape": shape, "flops": 1.0, "bytes": 2.0, "bound": "memory"}


def test_fingerprint_counts_ops_not_their_order():
    a, b = _node("a", "aten.mm.default", [4, 4]), _node("b", "aten.add.Tensor", [4, 4])
    assert graph_fingerprint({"nodes": [a, b]}) == graph_fingerprint({"nodes": [b, a]})
    assert graph_fingerprint({"nodes": [a, b]}) != graph_fingerprint({"nodes": [a, b, a]})
    assert graph_fingerprint({"nodes": [a]}) != graph_fingerprint({"nodes": [{**a, "shape": [4, 8]}]})


def _op_multiset(graph) -> Counter:
    return Counter((op.target, op.flops, op.bytes, op.bound) for op in graph.ops) + Counter(graph.collectives)


def _kernels(ops) -> list[tuple]:
    """The kernels ``ops`` run as, in order, by what prices them (ids and names number layers)."""
    return [(k.target, k.flops, k.bytes, k.bound) for k in fused_kernels(ops)]


def test_six_layer_slice_gives_the_full_traces_graphs(tmp_path):
    """Fingerprints, partition types and counts, and the work outside partitions of a 6-layer TP2
    model traced as slices equal a full trace's; extended to 7 layers the fingerprints differ, so
    deployment refuses a plan for another layer count."""
    req = PlanRequest(model="llama3.2-3b", tp=2, cp=1, pp=1, microbatches=1, mbs=2, seq=256, layers=6)
    sliced = _sliced_equals_full(req, tmp_path)
    short, long = (
        load_dump(next((tmp_path / "slice").glob(f"stage0-nanobatched-slice{k}/*.json"))) for k in SLICE_LAYERS
    )
    seven = partitioned_graphs(extend_dump(short, long, SLICE_LAYERS[1], 7, "stage 0"))
    assert seven["forward"].fingerprint != sliced[0].partitioned["forward"].fingerprint


@pytest.mark.slow  # about 4 minutes: a full 8-layer trace beside the slices; the MoE plan test is the fast sibling
def test_mixture_of_experts_slices_give_the_full_traces_graphs(tmp_path):
    """An 8-layer expert-parallel MoE (every layer sparse) traced as 3- and 4-layer slices equals its
    full trace, backward all-to-all types and counts included (a 2-layer slice would dissolve one)."""
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(
        hidden_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ).save_pretrained(tmp_path / "config")
    req = PlanRequest(model=f"hf:{tmp_path / 'config'}", tp=1, cp=1, pp=1, microbatches=1, mbs=2, seq=64, ep=2, dp=2)
    sliced = _sliced_equals_full(req, tmp_path)
    kinds = {t.collective.kind for graph in sliced[0].partitioned.values() for t in graph.ptypes}
    assert kinds == {"all_to_all"}


def _sliced_equals_full(req: PlanRequest, tmp_path):
    """``req``'s stages traced as slices, after checking them against a full trace."""
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        sliced = trace_stages(req, tmp_path / "slice")
    assert not [w for w in warned if "tracing all" in str(w.message)], "the slice fell back to a full trace"
    full = trace_stages(dataclasses.replace(req, full_trace=True), tmp_path / "full")
    for s, f in zip(sliced, full, strict=True):
        for name in ("forward", "backward"):
            assert s.sequential[name].fingerprint == f.sequential[name].fingerprint
            assert _op_multiset(s.sequential[name]) == _op_multiset(f.sequential[name])
            # in graph order, with the kernels that span a layer boundary (a residual add fused
            # into the next layer's norm) chained across the inserted layers
            assert _kernels(s.sequential[name].ops) == _kernels(f.sequential[name].ops)
            sp, fp = s.partitioned[name], f.partitioned[name]
            assert sp.fingerprint == fp.fingerprint
            assert sorted((t.type_id, t.count) for t in sp.ptypes) == sorted((t.type_id, t.count) for t in fp.ptypes)
            assert _op_multiset(sp.outside) == _op_multiset(fp.outside)
            assert Counter(_kernels(sp.outside.ops)) == Counter(_kernels(fp.outside.ops))
    return sliced


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["qwen3-1.7b-tp8-mbs8-seq4k", "llama3.2-3b-cp2tp4-mbs8-seq4k"])
def test_sliced_plan_equals_full_trace_plan(tmp_path, preset):
    """What must hold: same partition types and counts, same graph fingerprints, and every
    method's frontier within 0.1 % of the full trace's (as many points, each point's time and
    energy within 0.1 %)."""
    req = plan_request_from_preset(preset)
    sliced = make_plan(req, tmp_path / "slice", progress=False).data
    full = make_plan(dataclasses.replace(req, full_trace=True), tmp_path / "full", progress=False).data
    assert sliced["stages"] == full["stages"]  # fingerprints, partition types and counts per stage
    for tid, ptype in full["partition_types"].items():
        assert sliced["partition_types"][tid]["fingerprint"] == ptype["fingerprint"]
        assert sliced["partition_types"][tid]["count"] == ptype["count"]
    assert sliced["partition_types"].keys() == full["partition_types"].keys()
    for method, result in full["methods"].items():
        a, b = sliced["methods"][method]["frontier"], result["frontier"]
        assert len(a) == len(b), method
        for point, expected in zip(a, b):
            assert point == pytest.approx(expected, rel=FRONTIER_RTOL), method
    assert sliced["wall_s"]["trace_s"] < full["wall_s"]["trace_s"]
