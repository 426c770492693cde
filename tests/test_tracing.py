"""One Dynamo trace, two dumps: ``trace_both_splits`` writes what two ``trace_full_size`` runs write."""

from __future__ import annotations

import json

import pytest

from kareus_fx.capture.tracing import TraceSpec, trace_both_splits, trace_full_size


def _without_graph_id(path) -> dict:
    dump = json.loads(path.read_text())
    dump.pop("graph_id")  # a process-wide counter of Dynamo graphs in trace_full_size
    return dump


@pytest.mark.parametrize("stage", [0, 1], ids=["first-stage", "last-stage-with-loss"])
def test_both_splits_match_two_traces(tmp_path, stage):
    spec = TraceSpec(model="tiny-llama", tp=2, pp=2, stage=stage, layers=2, mbs=2, seq=512)
    stale = tmp_path / "nb" / "kareus_graph_999_rank0.json"  # an earlier run's dump, another graph number
    stale.parent.mkdir()
    stale.write_text("{}")
    nanobatched, sequential = trace_both_splits(spec, "h100", tmp_path / "nb", tmp_path / "seq")
    assert not stale.exists()
    for split, path in ((True, nanobatched), (False, sequential)):
        options = {"dump_dir": str(tmp_path / f"alone-{split}"), "gpu": "h100", "nanobatch": split}
        (alone,) = trace_full_size(spec, options=options).dump_paths
        assert _without_graph_id(path) == _without_graph_id(alone)
    partitions = [g["partitions"] for g in json.loads(nanobatched.read_text())["graphs"]]
    assert all(partitions), "the nanobatched dump has no partitions: the comparison would not cover the split"
