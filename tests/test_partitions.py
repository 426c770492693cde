"""Partitions and partition types of reference models traced at full size (meta, fake PG)."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from kareus_fx.capture.tracing import TraceSpec, trace_full_size

_LAYER = re.compile(r"layers\.(\d+)\.")


def _trace(tmp_path, **spec):
    result = trace_full_size(TraceSpec(**spec), options={"dump_dir": str(tmp_path)})
    (path,) = result.dump_paths
    return {g["name"]: g for g in json.loads(path.read_text())["graphs"]}


def _types_by_label(graph):
    return {t["label"]: t for t in graph["partition_types"]}


def _layers_of_partitioned_collectives(graph):
    """Layer index of every collective that belongs to a partition, with the partition's type."""
    nodes = {n["name"]: n for n in graph["nodes"]}
    found = []
    for partition in graph["partitions"]:
        for name in partition["collectives"]:
            match = _LAYER.search(nodes[name]["module"] or "")
            found.append((int(match.group(1)) if match else None, partition["type"]))
    return found


def _check_issue_order(graph):
    """Each partition's collective precedes the other nanobatch's computation it overlaps, and
    every wait sits just before the first use of its result (only views in between)."""
    position = {n["name"]: i for i, n in enumerate(graph["nodes"])}
    for partition in graph["partitions"]:
        first_overlapped = min(position[name] for slot in partition["slots"] for name in slot)
        assert max(position[c] for c in partition["collectives"]) < first_overlapped, partition["id"]
    users: dict[str, list[int]] = {}
    for i, node in enumerate(graph["nodes"]):
        for inp in node["inputs"]:
            users.setdefault(inp, []).append(i)
    for i, node in enumerate(graph["nodes"]):
        if node["kind"] != "wait":
            continue
        first_use = min(users[node["name"]])
        between = graph["nodes"][i + 1 : first_use]
        assert all(n["kind"] == "other" for n in between), (node["name"], [n["name"] for n in between])


def _check_llama_tp8(graphs, layers):
    forward, backward = graphs["forward"], graphs["backward"]
    _check_issue_order(forward)
    _check_issue_order(backward)
    # Forward: the attention-side all-reduce (o_proj) of one nanobatch overlaps the other's MLP,
    # the MLP-side all-reduce (down_proj) of layer l overlaps the other's attention of layer l+1.
    fwd_types = _types_by_label(forward)
    assert set(fwd_types) == {"all_reduce over layers.*.mlp", "all_reduce over layers.*.self_attn"}
    assert fwd_types["all_reduce over layers.*.mlp"]["count"] == 2 * layers
    assert fwd_types["all_reduce over layers.*.self_attn"]["count"] == 2 * (layers - 1)
    for t in fwd_types.values():
        assert t["collective"] == {"kind": "all_reduce", "bytes": 4 * 4096 * 3072 * 2, "group_size": 8, "fused": 1}
        assert t["launch_slots"] and t["launch_slots"][0] == 0
        assert {"compute", "memory"} == {s["bound"] for s in t["slots"]}
    attention = fwd_types["all_reduce over layers.*.self_attn"]
    assert [op for s in attention["slots"] for op in s["ops"]].count("kareus.attention.default") == 1
    # Every layer's partitioned forward collectives map onto those two types.
    per_layer = Counter(layer for layer, _ in _layers_of_partitioned_collectives(forward))
    assert {layer for layer in per_layer if layer is not None} == set(range(layers))
    assert {t for _, t in _layers_of_partitioned_collectives(forward)} == {t["type"] for t in fwd_types.values()}
    # Backward: the same two-type structure (input-gradient all-reduces of qkv_proj and gate_up_proj).
    bwd_types = _types_by_label(backward)
    assert len(bwd_types) == 2
    assert sorted(t["count"] for t in bwd_types.values()) == [2 * (layers - 1), 2 * (layers - 1)]


def test_llama_tp8_layers_map_onto_two_partition_types(tmp_path):
    _check_llama_tp8(_trace(tmp_path, model="llama3.2-3b", tp=8, mbs=8, seq=4096, layers=4), layers=4)


@pytest.mark.slow
def test_llama_tp8_28_layers_partition_counts(tmp_path):
    _check_llama_tp8(_trace(tmp_path, model="llama3.2-3b", tp=8, mbs=8, seq=4096, layers=28), layers=28)


def test_cp2tp4_fuses_k_and_v_all_gathers(tmp_path):
    graphs = _trace(tmp_path, model="qwen3-1.7b", tp=4, cp=2, mbs=8, seq=4096, layers=3)
    fused = [t for t in graphs["forward"]["partition_types"] if t["collective"]["kind"] == "all_gather"]
    assert fused, "no all-gather partition type in the CP2TP4 forward graph"
    for t in fused:
        assert t["collective"]["fused"] == 2  # K and V of one nanobatch: one logical communication
        assert t["collective"]["group_size"] == 2
    kinds = Counter(t["collective"]["kind"] for t in graphs["forward"]["partition_types"])
    assert kinds["all_reduce"] >= 1
