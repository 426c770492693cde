"""A mixture-of-experts pipeline stage traced at full size with expert parallelism: the expert
all-to-alls (dispatch and combine, forward and backward) split per nanobatch without a fallback and
become communication partitions overlapping the other nanobatch's computation, their buffers sized
by counts: ``expert_imbalance * tokens * top_k / ep`` rows to each peer."""

from __future__ import annotations

import json
import math
import warnings

import pytest

from kareus_fx.capture.tracing import TraceSpec, trace_both_splits
from kareus_fx.models import get_config

MBS, SEQ = 2, 64


def _traced(tmp_path, tp: int, ep: int, imbalance: float) -> dict:
    from kareus_fx.passes.nanobatch import NanobatchFallbackWarning

    # stage 1 of 2 holds tiny-moe's second layer, its sparse one
    spec = TraceSpec(
        model="tiny-moe", tp=tp, ep=ep, mbs=MBS, seq=SEQ, layers=2, pp=2, stage=1, expert_imbalance=imbalance
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        nanobatched, _ = trace_both_splits(spec, "h100", tmp_path / "nb", tmp_path / "seq")
    fallbacks = [str(w.message) for w in record if issubclass(w.category, NanobatchFallbackWarning)]
    assert not fallbacks, fallbacks
    return json.loads(nanobatched.read_text())


def _a2a_bytes(tp: int, ep: int, imbalance: float) -> int:
    """One nanobatch's (one sequence's) send buffer: ep peers x local experts x rows per expert."""
    moe, hidden = get_config("tiny-moe").moe, get_config("tiny-moe").hidden_size
    rows_per_expert = math.ceil(imbalance * (SEQ // tp) * moe.top_k / moe.experts)
    return ep * (moe.experts // ep) * rows_per_expert * hidden * 2  # bf16


@pytest.mark.parametrize(("tp", "ep", "imbalance"), [(1, 4, 1.0), (2, 2, 1.0), (2, 4, 1.5)])
def test_expert_all_to_alls_are_partitions_beside_the_other_nanobatch(tmp_path, tp, ep, imbalance):
    dump = _traced(tmp_path, tp, ep, imbalance)
    for graph in dump["graphs"]:
        nodes = {node["name"]: node for node in graph["nodes"]}
        a2a = [n for n in graph["nodes"] if (n["collective"] or {}).get("kind") == "all_to_all"]
        assert len(a2a) == 4, graph["name"]  # dispatch and combine of each nanobatch
        assert sorted(n["nanobatch"] for n in a2a) == [0, 0, 1, 1]
        assert {n["collective"]["group_size"] for n in a2a} == {ep}
        assert {n["collective"]["bytes"] for n in a2a} == {_a2a_bytes(tp, ep, imbalance)}
        types = {t["type"]: t for t in graph["partition_types"] if t["collective"]["kind"] == "all_to_all"}
        partitions = [p for p in graph["partitions"] if p["type"] in types]
        assert partitions, f"{graph['name']}: no all-to-all partition"
        for partition in partitions:
            (collective,) = partition["collectives"]
            own = nodes[collective]["nanobatch"]
            beside = {nodes[name]["nanobatch"] for slot in partition["slots"] for name in slot}
            assert beside == {1 - own}, partition["id"]
            assert any(nodes[name]["kind"] == "compute" for slot in partition["slots"] for name in slot)
