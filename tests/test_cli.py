"""The kareus command line: dump at full size on the meta device, inspect, and bad input."""

from __future__ import annotations

import json

import pytest

from kareus_fx.cli import main
from kareus_fx.report.dump_summary import summarise_graph


def _dump(tmp_path, *extra: str, layers: int, model: str = "llama3.2-3b") -> dict:
    args = [
        "dump",
        "--model",
        model,
        "--tp",
        "8",
        "--mbs",
        "8",
        "--seq",
        "4096",
        "--layers",
        str(layers),
        "--out",
        str(tmp_path),
        *extra,
    ]
    assert main(args) == 0
    (path,) = tmp_path.glob("kareus_graph_*.json")
    return json.loads(path.read_text())


def _check_two_all_reduces_per_layer(dump: dict, layers: int, nanobatches: int) -> None:
    forward = summarise_graph(dump["graphs"][0])
    per_layer = {layer: count for (layer, kind), count in forward.collectives_per_layer.items() if kind == "all_reduce"}
    assert per_layer == dict.fromkeys(range(layers), 2 * nanobatches)
    assert sum(per_layer.values()) == 2 * layers * nanobatches
    # Outside the decoder layers: the vocab-parallel embedding's all-reduce and the loss's all-gather.
    assert dict(forward.collectives_outside_layers) == {"all_reduce": nanobatches, "all_gather": nanobatches}


def test_dump_two_layers_without_and_with_nanobatches(tmp_path, capsys):
    _check_two_all_reduces_per_layer(_dump(tmp_path / "seq", "--no-nanobatch", layers=2), layers=2, nanobatches=1)
    assert "forward collectives: 2 decoder layers x (all_reduce 2)" in capsys.readouterr().out
    _check_two_all_reduces_per_layer(_dump(tmp_path / "nb", layers=2), layers=2, nanobatches=2)


def test_dump_llama_70b_layers_at_full_width(tmp_path):
    _check_two_all_reduces_per_layer(
        _dump(tmp_path, "--no-nanobatch", layers=2, model="llama3.3-70b"), layers=2, nanobatches=1
    )


@pytest.mark.slow
def test_dump_llama_3b_tp8_28_layers_has_56_layer_all_reduces(tmp_path):
    _check_two_all_reduces_per_layer(_dump(tmp_path, "--no-nanobatch", layers=28), layers=28, nanobatches=1)


def test_inspect_prints_partition_types(tmp_path, capsys):
    _dump(tmp_path, layers=4)
    (path,) = tmp_path.glob("kareus_graph_*.json")
    capsys.readouterr()
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "all_reduce over layers.*.mlp" in out and "all_reduce over layers.*.self_attn" in out
    assert "launch slots" in out and "leftover" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "llama3.2-3b", "--tp", "5"], "tp=5 does not divide 24 attention heads of llama3.2-3b"),
        (["--model", "llama3.2-3b", "--tp", "16"], "tp=16 does not divide 24 attention heads"),
        (["--model", "gpt5"], "unknown model 'gpt5'; choose one of llama3.2-3b"),
        (["--model", "qwen3-1.7b", "--tp", "4", "--cp", "3"], "not divisible by cp=3"),
        (["--model", "qwen3-1.7b", "--gpu", "V100"], "unknown GPU 'V100'"),
    ],
)
def test_bad_input_fails_before_tracing_with_a_clear_message(args, message, tmp_path, capsys):
    full = ["dump", *args, "--mbs", "8", "--seq", "4096", "--out", str(tmp_path)]
    assert main(full) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.glob("*.json"))


def test_inspect_rejects_a_file_that_is_not_a_dump(tmp_path, capsys):
    bad = tmp_path / "plan.json"
    bad.write_text("[1, 2]")
    assert main(["inspect", str(bad)]) == 2
    assert "is not a kareus graph dump" in capsys.readouterr().err
