"""Deploying a plan: codegen of the partitioned-overlap schedule, parity with eager, refusals.

The plan is made once per module by the real planner (``make_plan``: trace, tune, compose) for
tiny-llama, TP=2, 2 microbatches of [2, 1536] tokens, one layer: its forward and backward hold
ten partition types, one with 3 launch slots; a second layer adds no kind of partition and cost
each rank of the mixed-slots test 21 CPU seconds instead of 13 (no partition's slots reach into
a next layer's ops here; each partition's slots, hooks and waits are checked as with two). At that sequence length the
attention op is compute-bound, so the attention partitions have 3 launch slots. The parity
test runs fp32, so the module plans the fp32 graph (a different dtype is a different graph, which
the deployment refuses). The planner's chosen options at this size are all sequential (too
little to overlap), so the test gives microbatch 0 and 1 new options whose partition types use
different launch slots (0, 1, 2, sequential) and SM counts, and points the frontier at them.

The mixed-slots test deploys through Inductor (the default) and reads the code it generated:
the hooks, collectives and waits come in the scheduled aten graph's order. Parity tolerance:
rtol=1e-5, atol=1e-6 (fp32), as tests/test_parity.py: moving a collective within the slots it
does not feed changes no arithmetic; the nanobatch split sums each weight gradient from two
halves and Inductor's fused kernels round differently (a few ulps).
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from conftest import train_microbatches
from dist_harness import run_distributed

from kareus_fx.deploy.plan_checks import PlanMismatchError
from kareus_fx.deploy.variants import copy_graph
from kareus_fx.plan.plan_format import PlanFormatError, instruction_key, write_plan

TOL = {"rtol": 1e-5, "atol": 1e-6}
WORKLOAD = {"model": "tiny-llama", "tp": 2, "cp": 1, "pp": 1, "microbatches": 2, "mbs": 2, "seq": 1536, "layers": 1}


@pytest.fixture(scope="module")
def base_plan(tmp_path_factory):
    """A real plan of WORKLOAD, traced in fp32 (see the module docstring)."""
    from kareus_fx.plan.planner import make_plan
    from kareus_fx.plan.request import PlanRequest

    outcome = make_plan(
        PlanRequest(**WORKLOAD, clock_stride_mhz=120, dtype="float32"),
        tmp_path_factory.mktemp("plan-work"),
        progress=False,
    )
    return outcome.data


def _types_of(data, graph):
    return sorted(
        (tid for tid, t in data["partition_types"].items() if t["graph"] == graph), key=lambda tid: int(tid[1:])
    )


def _configs(data, graph, variant):
    """Per type of ``graph``: launch slots cycling over 0..n-1 and sequential (down by one a
    variant: the one-layer plan's 3-slot type runs slot 2 and slot 1), SM counts 4..16."""
    configs = {}
    for i, tid in enumerate(_types_of(data, graph)):
        choices = [*range(len(data["partition_types"][tid]["slots"])), None]
        configs[tid] = {"comm_sms": 4 * (1 + (i + variant) % 4), "launch_slot": choices[(i - variant) % len(choices)]}
    return configs


def _scheduled_plan(data, path):
    """``data`` with microbatch 0 and 1 of both instructions on new options (variants 0 and 1)."""
    data = copy.deepcopy(data)
    clocks = {}
    for graph in ("forward", "backward"):
        key = instruction_key(0, graph)
        options = data["microbatch_options"][key]
        chosen = []
        for variant, clock_mhz in enumerate((1200, 990)):
            option = {
                **options[0],
                "clock_mhz": clock_mhz,
                "sequential": False,
                "configs": _configs(data, graph, variant),
            }
            chosen.append(len(options))
            options.append(option)
            clocks[(graph, variant)] = clock_mhz
        for point in data["iteration_frontier"]:
            point["choices"][key] = chosen
    write_plan(path, data)
    return data, clocks


def _tiny_model(seq):
    from kareus_fx.models import ParallelLayout, build_model

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = build_model(
        WORKLOAD["model"],
        ParallelLayout.from_default_group(tp=2, cp=1),
        num_layers=WORKLOAD["layers"],
        dtype=torch.float32,
    )
    model.init_weights(seed=0)
    return model


def _graph_nodes(gm):
    from kareus_fx.passes.analysis import META_KEY

    nodes = []
    for node in gm.graph.nodes:
        cost = node.meta.get(META_KEY)
        args = [a if isinstance(a, (int, str)) or a is None else "-" for a in node.args]
        nodes.append(
            {
                "name": node.name,
                "op": node.op,
                "target": str(node.target),
                "kind": cost.kind if cost else "other",
                "nanobatch": node.meta.get("kareus_nanobatch"),
                "args": args,
                "comm_sms": node.meta.get("kareus_comm_sms"),
            }
        )
    return nodes


def _deploy_worker(rank, world_size, plan_path):
    from kareus_fx.deploy.hook_ops import recording_hooks
    from kareus_fx.deploy.variants import deployed_graphs
    from kareus_fx.runtime.clock_controller import ClockController

    model = _tiny_model(WORKLOAD["seq"])
    batches = [model.example_batch(mbs=WORKLOAD["mbs"], seq=WORKLOAD["seq"], seed=mb) for mb in range(2)]

    eager_losses, eager_grads = train_microbatches(model, model, batches)
    controller = ClockController.open("dry-run", handle_sigterm=False)
    compiled = torch.compile(
        model, backend="kareus", fullgraph=True, options={"plan": plan_path, "clock_controller": controller}
    )
    with recording_hooks() as log:
        losses, grads = train_microbatches(model, compiled, batches)
    controller.close()
    for loss, eager in zip(losses, eager_losses):
        torch.testing.assert_close(loss, eager, **TOL)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")
    return {
        "dce_keeps_hooks": [_hooks_survive_dce(g.gm) for g in deployed_graphs()],
        "requests": [(r.clock_mhz, r.instruction) for r in controller.requests],
        "log": [list(entry) for entry in log],
        "graphs": [
            {
                "name": g.name,
                "microbatches": list(g.microbatches),
                "code": g.gm.code,
                "output_code": g.output_code,
                "partitions": [dataclasses.asdict(p) for p in g.partitions],
                "nodes": _graph_nodes(g.gm),
            }
            for g in deployed_graphs()
        ],
    }


def _hook_count(gm):
    from kareus_fx.deploy.hook_ops import HOOK_OPS

    return sum(1 for n in gm.graph.nodes if n.target in HOOK_OPS)


def _hooks_survive_dce(gm):
    copy = torch.fx.GraphModule(gm, copy_graph(gm.graph))
    before = _hook_count(copy)
    copy.graph.eliminate_dead_code()
    return before > 0 and _hook_count(copy) == before


def _check_partition_position(nodes, partition):
    """The collective comes right after its predecessor; the hooks around it carry the plan's values."""
    index = {n["name"]: i for i, n in enumerate(nodes)}
    first = min(index[c] for c in partition["collectives"])
    last = max(index[c] for c in partition["collectives"])
    launch = nodes[first - 1]
    assert launch["target"] == "kareus.comm_launch.default"
    slot = partition["launch_slot"]
    assert launch["args"][:3] == [partition["partition_id"], partition["comm_sms"], -1 if slot is None else slot]
    assert nodes[last + 1]["target"] == "kareus.comm_issued.default"
    # Nanobatch computation only: shared work (nanobatch None, e.g. RoPE tables) sits before its
    # first user wherever that is.
    compute_before = [n["name"] for n in nodes[:first] if n["kind"] == "compute" and n["nanobatch"] is not None]
    compute_after = [n["name"] for n in nodes[last:] if n["kind"] == "compute" and n["nanobatch"] is not None]
    slots = partition["slots"]
    if slot is None:
        assert compute_before[-1] == slots[-1][-1] == partition["predecessor"]
    else:
        # Issued right before slot `slot`: after slot - 1's last op, before slot's first op.
        assert compute_after[0] == slots[slot][0]
        if slot > 0:
            assert compute_before[-1] == slots[slot - 1][-1] == partition["predecessor"]
        else:
            assert not set(compute_before) & {n for s in slots for n in s}
    for c in partition["collectives"]:
        assert nodes[index[c]]["comm_sms"] == partition["comm_sms"]
        waits = [
            i
            for i, n in enumerate(nodes)
            if n["target"] == "_c10d_functional.wait_tensor.default" and n["args"] == ["-"] and i > index[c]
        ]
        assert waits
    wait_hook = next(
        i
        for i, n in enumerate(nodes)
        if n["target"] == "kareus.comm_wait.default" and n["args"][0] == partition["partition_id"]
    )
    assert wait_hook > last
    if slot is None:  # sequential: waited at once, nothing runs under it
        assert all(n["kind"] != "compute" for n in nodes[last:wait_hook])


def test_plan_with_mixed_launch_slots_and_sms_matches_eager(base_plan, tmp_path):
    plan_path = tmp_path / "plan.json"
    data, clocks = _scheduled_plan(base_plan, plan_path)
    _check_deployment(data, clocks, run_distributed(_deploy_worker, 2, str(plan_path), timeout_s=600))


_HOOKS = ("clock_hook", "comm_launch", "comm_issued", "comm_wait")


def _aten_schedule(nodes):
    """The scheduled aten graph's hooks (with their tags), collectives and waits (by op), in order."""
    events = []
    for n in nodes:
        op = n["target"].split(".")
        if n["target"].startswith("kareus.") and op[1] in _HOOKS:
            events.append(op[1] if op[1] == "clock_hook" else f"{op[1]}:{n['args'][0]}")
        elif n["target"].startswith("_c10d_functional."):
            events.append(op[1].removesuffix("_"))
    return events


def _inductor_schedule(output_code):
    """The same events read from the code Inductor generated (its ``call`` function). Inductor
    issues a functional collective as itself, or as its in-place or ``_out`` variant on a
    buffer it allocates (``bufN = torch.ops...`` or a bare call)."""
    events = []
    for line in output_code[output_code.index("def call(") :].splitlines():
        call = line.strip().split(" = ", 1)[-1]
        if call.startswith("torch.ops.kareus.") and call.split(".")[3] in _HOOKS:
            hook = call.split(".")[3]
            events.append(hook if hook == "clock_hook" else f"{hook}:{call.split(chr(39))[1]}")
        elif call.startswith("torch.ops._c10d_functional."):
            events.append(call.split(".")[3].removesuffix("_out").removesuffix("_"))
    return events


def _check_deployment(data, clocks, results):
    for result in results:
        assert all(result["dce_keeps_hooks"])
        graphs = result["graphs"]
        # One variant per distinct per-microbatch schedule: forward and backward, mb 0 and mb 1.
        assert sorted((g["name"], g["microbatches"]) for g in graphs) == [
            ("backward", [0]),
            ("backward", [1]),
            ("forward", [0]),
            ("forward", [1]),
        ]
        used_slots = set()
        for graph in graphs:
            variant = graph["microbatches"][0]
            configs = _configs(data, graph["name"], variant)
            plan_types = data["stages"][0]["graphs"][graph["name"]]["partition_types"]
            first_op = next(n for n in graph["nodes"] if n["op"] != "placeholder")  # microbatch boundary
            assert first_op["target"] == "kareus.clock_hook.default" and first_op["args"] == [0, graph["name"]]
            assert f"torch.ops.kareus.clock_hook.default(0, '{graph['name']}')" in graph["code"]
            assert graph["partitions"], graph["name"]
            # Inductor kept the plan's order of hooks, collectives and waits in the code it generated.
            assert graph["output_code"] is not None
            # (Inductor drops a repeated wait on a buffer already waited on: waits are compared
            # by the hook in front of them, which must still be followed by one.)
            inductor = _inductor_schedule(graph["output_code"])
            assert [e for e in inductor if e != "wait_tensor"] == [
                e for e in _aten_schedule(graph["nodes"]) if e != "wait_tensor"
            ], graph["output_code"]
            assert all(inductor[i + 1] == "wait_tensor" for i, e in enumerate(inductor) if e.startswith("comm_wait"))
            for partition in graph["partitions"]:
                config = configs[plan_types[partition["type_id"]]]
                assert (partition["comm_sms"], partition["launch_slot"]) == (config["comm_sms"], config["launch_slot"])
                _check_partition_position(graph["nodes"], partition)
                used_slots.add(partition["launch_slot"])
        assert {0, 1, 2, None} <= used_slots
        # The dry-run controller got the plan's clock of every instruction, in execution order.
        expected = [(clocks[(g, mb)], f"{g[0].upper()}{mb}@S0") for mb in (0, 1) for g in ("forward", "backward")]
        assert result["requests"] == expected
        # At run time every partition's hooks ran in order: launch, issued, wait.
        by_tag = {}
        for entry in result["log"]:
            if entry[0] != "clock_hook":
                by_tag.setdefault(entry[1], []).append(entry[0])
        assert by_tag and all(ops == ["comm_launch", "comm_issued", "comm_wait"] * 2 for ops in by_tag.values())


def _refused_worker(rank, world_size, plan_path, seq, options):
    model = _tiny_model(seq)
    # Refused before any code is generated: op by op keeps the test short.
    compiled = torch.compile(
        model, backend="kareus", fullgraph=True, options={"plan": plan_path, "inductor": False, **options}
    )
    try:
        compiled(**model.example_batch(mbs=WORKLOAD["mbs"], seq=seq)).backward()
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return None


def test_plan_for_another_model_shape_is_refused(base_plan, tmp_path):
    plan_path = tmp_path / "plan.json"
    write_plan(plan_path, base_plan)
    messages = run_distributed(_refused_worker, 2, str(plan_path), 64, {})
    for message in messages:
        assert message is not None
        assert "forward graph of stage 0 is not the graph the plan" in message
        assert "seq=1536" in message and "re-plan with `kareus plan`" in message


def test_plan_for_another_world_size_or_gpu_is_refused(base_plan, tmp_path):
    plan_path = tmp_path / "plan.json"
    write_plan(plan_path, base_plan)
    torch._dynamo.reset()
    compiled = torch.compile(torch.nn.Linear(4, 2), backend="kareus", options={"plan": str(plan_path)})
    with pytest.raises(
        Exception, match=r"world size differs: .* made for 2 processes \(tp=2 x cp=1 x pp=1\) but this job runs 1"
    ) as info:
        compiled(torch.randn(3, 4))
    assert isinstance(info.value.inner_exception, PlanMismatchError)
    torch._dynamo.reset()
    compiled = torch.compile(torch.nn.Linear(4, 2), backend="kareus", options={"plan": str(plan_path), "gpu": "H100"})
    with pytest.raises(Exception, match=r"GPU differs: .* made for A100-SXM4-40GB, but options gpu is H100"):
        compiled(torch.randn(3, 4))


def test_corrupt_plan_file_gives_a_plan_format_error(tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text('{"format": "kareus-plan", "schema_version": 1')
    torch._dynamo.reset()
    compiled = torch.compile(torch.nn.Linear(4, 2), backend="kareus", options={"plan": str(bad)})
    with pytest.raises(Exception, match=r"is not a kareus plan: invalid JSON at line 1") as info:
        compiled(torch.randn(3, 4))
    # Dynamo reports a backend's exception as BackendCompilerFailed("backend='kareus' raised:
    # PlanFormatError: ...") with the traceback cut to the user's frame; the error itself rides along.
    assert isinstance(getattr(info.value, "inner_exception", info.value), PlanFormatError)
    missing_field = tmp_path / "partial.json"
    missing_field.write_text(json.dumps({"format": "kareus-plan", "schema_version": 1}))
    torch._dynamo.reset()
    compiled = torch.compile(torch.nn.Linear(4, 2), backend="kareus", options={"plan": str(missing_field)})
    with pytest.raises(Exception, match=r"partial.json: missing workload, gpu, profiler, energy_scope, stages"):
        compiled(torch.randn(3, 4))


def test_hook_ops_survive_dead_code_elimination_and_retracing():
    from torch.fx.experimental.proxy_tensor import make_fx

    from kareus_fx.deploy.hook_ops import CLOCK_HOOK, COMM_ISSUED, COMM_LAUNCH, COMM_WAIT, recording_hooks

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(CLOCK_HOOK, (0, "forward"))
    graph.call_function(COMM_LAUNCH, ("forward:p0", 8, 1, [x]))
    y = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    graph.call_function(COMM_ISSUED, ("forward:p0", [y]))
    graph.call_function(COMM_WAIT, ("forward:p0", [y]))
    graph.output(x)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    gm.graph.eliminate_dead_code()  # y is unused: only the hooks that read it keep it
    gm.recompile()
    retraced = make_fx(gm)(torch.ones(2))
    for module in (gm, retraced):
        assert [str(n.target) for n in module.graph.nodes if n.op == "call_function"] == [
            "kareus.clock_hook.default",
            "kareus.comm_launch.default",
            "aten.mul.Tensor",
            "kareus.comm_issued.default",
            "kareus.comm_wait.default",
        ]
    with recording_hooks() as log:
        retraced(torch.ones(2))
    assert log == [
        ("clock_hook", 0, "forward"),
        ("comm_launch", "forward:p0", 8, 1),
        ("comm_issued", "forward:p0"),
        ("comm_wait", "forward:p0"),
    ]


def test_tune_with_a_request_needs_an_output_path_and_a_gpu_for_cuda():
    torch._dynamo.reset()
    compiled = torch.compile(
        torch.nn.Linear(4, 2), backend="kareus", options={"tune": "simulated", "tune_request": dict(WORKLOAD)}
    )
    with pytest.raises(Exception, match=r"option 'tune' needs 'plan_out'"):
        compiled(torch.randn(3, 4))
    torch._dynamo.reset()
    compiled = torch.compile(
        torch.nn.Linear(4, 2),
        backend="kareus",
        options={"tune": "cuda", "plan_out": "p.json", "tune_request": dict(WORKLOAD.items())},
    )
    if not torch.cuda.is_available():
        with pytest.raises(Exception, match=r"--profiler cuda measures on-device and needs a CUDA GPU"):
            compiled(torch.randn(3, 4))


def test_compile_time_tuning_writes_and_deploys_a_plan(tmp_path):
    """tp=1 (one process): the planner runs in a spawned process, the plan is written and deployed.

    The planner traces in bf16, so the model is bf16 too; with tp=1 nothing communicates, so the
    plan is sequential and the deployed graphs carry the clock hook only.
    """
    from kareus_fx.deploy.variants import deployed_graphs
    from kareus_fx.models import ParallelLayout, build_model
    from kareus_fx.plan.plan_format import load_plan

    torch._dynamo.reset()
    model = build_model("tiny-llama", ParallelLayout(), num_layers=2, dtype=torch.bfloat16)
    model.init_weights(seed=0)
    plan_out = tmp_path / "tuned" / "plan.json"
    request = {
        "model": "tiny-llama",
        "tp": 1,
        "cp": 1,
        "pp": 1,
        "microbatches": 1,
        "mbs": 2,
        "seq": 16,
        "layers": 2,
        "clock_stride_mhz": 240,
    }
    compiled = torch.compile(
        model,
        backend="kareus",
        fullgraph=True,
        options={"tune": "simulated", "plan_out": str(plan_out), "tune_request": request, "inductor": False},
    )  # Inductor with a plan: the mixed-slots test
    before = len(deployed_graphs())
    compiled(**model.example_batch(mbs=2, seq=16)).backward()
    assert load_plan(plan_out).workload["mbs"] == 2
    graphs = deployed_graphs()[before:]
    assert [g.name for g in graphs] == ["forward", "backward"] and all(g.partitions == () for g in graphs)
    for graph in graphs:
        assert f"torch.ops.kareus.clock_hook.default(0, '{graph.name}')" in graph.gm.code
