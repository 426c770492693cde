"""The kareus backend: registration, options, capture of forward/backward graphs, dumps."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kareus_fx.capture.dump import SCHEMA_VERSION, load_dump

# Inductor's fp32 tolerance: its tests (check_model) compare with torch.testing's float32
# defaults, rtol=1.3e-6, atol=1e-5.
INDUCTOR_FP32_TOL = {"rtol": 1.3e-6, "atol": 1e-5}
NODE_FIELDS = {"name", "op", "kind", "shape", "dtype", "flops", "bytes", "nanobatch", "partition"}


class _NoCollectives(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(32, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.down = torch.nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.norm(self.up(x)))).square().mean()


def _loss_and_grads(model, x):
    model.zero_grad()
    loss = model(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_backend_resolves_in_a_fresh_interpreter_without_importing_kareus_fx():
    code = (
        "import sys, torch\n"
        "m = torch.nn.Linear(4, 2)\n"
        "assert 'kareus_fx' not in sys.modules\n"
        "c = torch.compile(m, backend='kareus')\n"
        "y = c(torch.randn(3, 4))\n"
        "assert 'kareus_fx.capture.backend' in sys.modules\n"
        "print(tuple(y.shape))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(3, 2)"


@pytest.mark.parametrize("inductor", [False, True])
def test_model_without_collectives_compiles_and_runs_unchanged(tmp_path, inductor):
    torch.manual_seed(0)
    model = _NoCollectives()
    x = torch.randn(8, 32)
    eager_loss, eager_grads = _loss_and_grads(model, x)
    options = {"dump_dir": str(tmp_path), "inductor": inductor}
    compiled = torch.compile(model, backend="kareus", options=options, fullgraph=True)
    loss, grads = _loss_and_grads(compiled, x)
    # Inductor's decompositions (both paths) and its fused kernels round differently from eager.
    torch.testing.assert_close(loss, eager_loss, **INDUCTOR_FP32_TOL)
    for grad, eager_grad in zip(grads, eager_grads):
        torch.testing.assert_close(grad, eager_grad, **INDUCTOR_FP32_TOL)
    (path,) = tmp_path.glob("kareus_graph_*.json")
    dump = load_dump(path)
    assert dump["schema_version"] == SCHEMA_VERSION
    assert [g["name"] for g in dump["graphs"]] == ["forward", "backward"]
    for graph in dump["graphs"]:
        assert not [n for n in graph["nodes"] if n["kind"] in ("collective", "wait")]
        assert all(NODE_FIELDS <= set(n) for n in graph["nodes"])
    forward_compute = [n for n in dump["graphs"][0]["nodes"] if n["kind"] == "compute"]
    addmm = [n for n in forward_compute if n["op"] == "aten.addmm.default"]
    assert [n["flops"] for n in addmm] == [2 * 8 * 32 * 64, 2 * 8 * 64 * 4]
    assert {n["module"] for n in addmm} == {"up", "down"}


def test_inference_graph_is_dumped_as_forward(tmp_path):
    model = _NoCollectives()
    compiled = torch.compile(model, backend="kareus", options={"dump_dir": str(tmp_path)})
    with torch.no_grad():
        compiled(torch.randn(2, 32))
    (path,) = tmp_path.glob("kareus_graph_*.json")
    assert [g["name"] for g in json.loads(path.read_text())["graphs"]] == ["forward"]


@pytest.mark.parametrize(
    "options, message",
    [
        ("fast", r"options must be a dict, got str"),
        (["dump_dir"], r"options must be a dict, got list"),
        ({"dumpdir": "x"}, r"unknown backend='kareus' option\(s\) 'dumpdir'; valid options: dump_dir"),
        ({"gpu": "V100"}, r"option 'gpu': unknown GPU 'V100'; known GPUs and aliases: A100-SXM4-40GB"),
        ({"nanobatch": "yes"}, r"option 'nanobatch' must be True or False"),
        ({"inductor": 1}, r"option 'inductor' must be True or False"),
    ],
)
def test_bad_options_name_the_problem(options, message):
    torch._dynamo.reset()
    compiled = torch.compile(torch.nn.Linear(4, 2), backend="kareus", options=options)
    with pytest.raises(Exception, match=message):
        compiled(torch.randn(3, 4))


def test_corrupt_or_foreign_dump_is_rejected(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a kareus graph dump: invalid JSON"):
        load_dump(bad)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"schema_version": 0, "graphs": []}))
    with pytest.raises(ValueError, match="regenerate the dump"):
        load_dump(old)
