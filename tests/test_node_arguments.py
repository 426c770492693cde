"""Node arguments as JSON (``kareus_fx/capture/node_arguments.py``): every op of a traced aten
graph, called again from its encoded arguments through a JSON round trip, gives the value the graph
computed (torch.testing's float32 tolerances, rtol 1.3e-6 and atol 1e-5: a CPU reduction's
vectorised order may depend on the buffer's alignment)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from kareus_fx.capture.node_arguments import decode_arguments, encode_arguments


def _step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=1e-6)
    h = (h @ w).to(torch.bfloat16).float()
    h = h.clamp(min=-math.inf, max=3.0).reshape(2, -1).sum(dim=1, keepdim=True)
    return h + torch.full((2, 1), 0.5, device=x.device) + torch.nn.functional.gelu(h, approximate="tanh")


class _Recorder(torch.fx.Interpreter):
    """Runs the graph and keeps every node's value."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, object] = {}

    def run_node(self, n: torch.fx.Node) -> object:
        self.values[n.name] = result = super().run_node(n)
        return result


def test_every_op_reruns_from_its_json_arguments_to_the_same_value():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    gm = make_fx(_step, pre_dispatch=False)(x, w)
    recorder = _Recorder(gm)
    recorder.run(x, w)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert {str(n.target) for n in calls} >= {"aten.sum.dim_IntList", "aten.full.default", "aten.gelu.default"}
    for node in calls:
        encoded = json.loads(json.dumps(encode_arguments(node), allow_nan=False))
        args, kwargs = decode_arguments(encoded, recorder.values.__getitem__, torch.device("cpu"))
        again = node.target(*args, **kwargs)
        torch.testing.assert_close(again, recorder.values[node.name], msg=str(node))


def test_an_argument_without_a_json_form_gives_no_encoding():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.ops.aten.slice.Tensor, (x, 0, slice(0, 2)))
    assert encode_arguments(node) is None
    assert encode_arguments(x) is None


@pytest.mark.parametrize(
    "bad",
    [
        {"args": "x", "kwargs": {}},
        {"args": [{"what": 1}], "kwargs": {}},
        {"args": [{"dtype": "not_a_dtype"}], "kwargs": {}},
    ],
)
def test_a_malformed_encoding_is_a_value_error(bad):
    with pytest.raises(ValueError):
        decode_arguments(bad, lambda name: None, torch.device("cpu"))
