"""Train a small model with TP2 x PP2 through ``torch.distributed.pipelining``, following a kareus plan.

1. Make the plan (tiny-llama, 2 layers, 3 microbatches of [2, 256] tokens, fp32; about a minute on a CPU)::

       kareus plan --model tiny-llama --tp 2 --pp 2 --microbatches 3 --mbs 2 --seq 256 --layers 2 \\
           --dtype float32 --clock-stride 120 --out plans/tiny-pp

2. Train (4 processes; on CPU: gloo, dry-run clocks)::

       torchrun --nproc-per-node 4 examples/train_pipelined.py --plan plans/tiny-pp/plan.json

Each rank builds its stage of the model the plan was made for, compiles it with the kareus backend
and the plan (``kareus_stage``), and PyTorch's ``Schedule1F1B`` runs the microbatches; the stages tell
the plan which (stage, instruction, microbatch) runs, so every instruction gets its planned clock and
kernel schedule with no ``next_instruction`` call here. Rank 0 prints per iteration the wall time
(slowest rank), the loss, the clocks each stage requested and the plan's predicted iteration time and
energy beside what the energy monitor measured. On a GPU (``--clock-mode real``, NCCL) the monitor is
Zeus. On CPU no counter measures GPU energy: the energy column is the simulated GPU's estimate of
what ran, labelled "simulated" (``kareus_fx.deploy.simulated_energy``: every instruction each stage
ran, at the clock its controller received, priced as the plan's option and composed over the
order the schedule ran), so it equals the plan's prediction exactly when the run followed the plan
and differs when it did not (another schedule, clock or instruction count). CPU wall times are not
GPU times: the time comparison is meaningful on the plan's GPU only.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B

from kareus_fx.deploy.deployment import prepare_collectives
from kareus_fx.deploy.pipelining import follow_plan, kareus_stage, pipeline_group, stage_loss
from kareus_fx.deploy.simulated_energy import simulated_iteration
from kareus_fx.models import ParallelLayout, PipelineStage, build_model
from kareus_fx.models.stage_module import StageModule
from kareus_fx.plan.plan_format import Plan, load_plan
from kareus_fx.runtime.clock_backends import open_clock_backend
from kareus_fx.runtime.clock_controller import ClockController
from kareus_fx.runtime.energy import IterationEnergyMonitor, compare_with_plan


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", required=True, help="plan.json from the `kareus plan` command above")
    parser.add_argument("--iterations", type=int, default=4, help="training iterations (the first compiles)")
    parser.add_argument("--deadline-s", type=float, help="plan point: least energy within this iteration time")
    parser.add_argument("--clock-mode", default="dry-run", choices=["dry-run", "simulated", "real"])
    parser.add_argument("--lr", type=float, default=1e-3, help="SGD learning rate")
    parser.add_argument(
        "--inductor",
        action=argparse.BooleanOptionalAction,
        help="Inductor generates the scheduled graphs' code (default: on a GPU; off on CPU, where its "
        "compile takes minutes and the graphs run op by op in the plan's order)",
    )
    args = parser.parse_args()
    if args.iterations < 2:
        parser.error("--iterations must be at least 2 (the first one compiles)")
    return args


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo on loopback: no hostname lookup
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    plan = load_plan(args.plan)
    work = plan.workload
    target = {"deadline_s": args.deadline_s} if args.deadline_s else "max-throughput"
    point_index = plan.point_index(target)
    point = plan.frontier[point_index]
    layout = ParallelLayout.from_default_group(tp=work["tp"], cp=work["cp"], pp=work["pp"])
    group = pipeline_group(layout)
    stage_index = layout.pp_rank
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(
            work["model"],
            layout,
            num_layers=work["layers"],
            dtype=getattr(torch, work.get("dtype") or "bfloat16"),
            stage=PipelineStage(stage_index, work["pp"], tuple(work["stage_layers"])),
        )
        model.init_weights(seed=0)
    module = StageModule(model)

    prepare_collectives(plan, target, [layout.tp_group, layout.cp_group])
    # Every mode records its requests here, so the example can print them (open() records in dry-run only).
    controller = ClockController(open_clock_backend(args.clock_mode, gpu_index=device.index or 0), record_requests=True)
    stage = kareus_stage(
        module,
        stage_index,
        work["pp"],
        device,
        plan=args.plan,
        target=target,
        options={"gpu": plan.gpu, "inductor": cuda if args.inductor is None else args.inductor},
        group=group,
    )
    schedule = Schedule1F1B(stage, work["microbatches"], loss_fn=stage_loss)
    optimizer = torch.optim.SGD(module.parameters(), lr=args.lr)
    monitor = IterationEnergyMonitor()
    simulated_j: list[float | None] = []  # rank 0: the simulated GPU's estimate per iteration (CPU)
    if rank == 0:
        print(
            f"plan {args.plan}: {work['model']} tp={work['tp']} pp={work['pp']} {work['microbatches']} microbatches "
            f"of [{work['mbs']}, {work['seq']}] on {plan.gpu}; point {target!r}: predicted "
            f"{point['time_s'] * 1e3:.2f} ms and {point['energy_j']:.2f} J per iteration ({plan.data['energy_scope']}); "
            f"clocks: {args.clock_mode}",
            flush=True,
        )
    try:
        with follow_plan(schedule, plan, target, controller):
            for iteration in range(args.iterations):
                seen = len(controller.requests)
                batch = model.example_batch(
                    mbs=work["mbs"] * work["microbatches"], seq=work["seq"], device=device, seed=iteration
                )
                losses: list[torch.Tensor] = []
                with monitor.iteration():
                    if stage.is_first and stage.is_last:  # --pp 1: one stage takes the inputs and the labels
                        schedule.step(
                            batch["input_ids"],
                            labels=batch["labels"],
                            target=batch["labels"],
                            losses=losses,
                            return_outputs=False,
                        )
                    elif stage.is_first:
                        schedule.step(batch["input_ids"])
                    else:
                        schedule.step(
                            labels=batch["labels"], target=batch["labels"], losses=losses, return_outputs=False
                        )
                    model.finalize_grads()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                report = {
                    "stage": stage_index,
                    "priced": layout.tp_rank == 0 and layout.cp_rank == 0,  # one rank per stage
                    "time_s": monitor.measurements[-1].time_s,
                    "energy_j": monitor.measurements[-1].energy_j,
                    "requests": controller.requests[seen:],
                    "loss": float(torch.stack(losses).detach().mean()) if losses else None,
                }
                simulated_j.append(_print_iteration(iteration, report, plan, point_index))
        _print_summary(monitor, point, args.iterations, simulated_j[1:])
    finally:
        controller.close()
        dist.destroy_process_group()


def _gather(report: dict) -> list[dict] | None:
    reports: list[dict] | None = [{} for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    dist.gather_object(report, reports, dst=0)
    return reports


def _print_iteration(iteration: int, report: dict, plan: Plan, point_index: int) -> float | None:
    """Rank 0 prints the iteration; returns the simulated energy it printed (None: measured or n/a)."""
    reports = _gather(report)
    if reports is None:
        return None
    point = plan.frontier[point_index]
    time_s = max(r["time_s"] for r in reports)
    (loss,) = {r["loss"] for r in reports if r["loss"] is not None}
    clocks = {r["stage"]: [q.clock_mhz for q in r["requests"]] for r in reports}
    energies = [r["energy_j"] for r in reports]
    simulated = None
    if None not in energies:
        measured = f"{sum(energies):.2f} J"
    else:
        simulated = _simulated_energy_j(reports, plan, point_index)
        measured = "n/a (no GPU, no clock requests)" if simulated is None else f"{simulated:.2f} J (simulated)"
    print(
        f"iter {iteration}: {time_s * 1e3:8.1f} ms  loss {loss:.4f}  "
        + "  ".join(f"stage {s} clocks {c} MHz" for s, c in sorted(clocks.items()))
        + f"  | plan {point['time_s'] * 1e3:.2f} ms {point['energy_j']:.2f} J, measured energy {measured}",
        flush=True,
    )
    return simulated


def _simulated_energy_j(reports: list[dict], plan: Plan, point_index: int) -> float | None:
    """The simulated GPU's estimate of what the stages ran (module docstring); None when no
    clock was requested (a --max-clock-only plan requests none)."""
    by_stage = {r["stage"]: r["requests"] for r in reports if r["priced"]}
    if not any(by_stage.values()):
        return None
    return simulated_iteration(plan, point_index, [by_stage[s] for s in sorted(by_stage)]).energy_j


def _print_summary(
    monitor: IterationEnergyMonitor, point: Mapping[str, Any], iterations: int, simulated_j: list[float | None]
) -> None:
    steady = monitor.measurements[1:]  # the first iteration compiles
    comparison = compare_with_plan(steady, point["time_s"], point["energy_j"])
    reports = _gather({"time_s": comparison.measured_time_s, "energy_j": comparison.measured_energy_j})
    if reports is None:
        return
    time_s = max(r["time_s"] for r in reports)
    energies = [r["energy_j"] for r in reports]
    if None not in energies:
        energy = f"{sum(energies):.2f} J"
    elif simulated_j and None not in simulated_j:
        mean_j = sum(e for e in simulated_j if e is not None) / len(simulated_j)
        energy = f"{mean_j:.2f} J simulated (no GPU: the simulated GPU's price of what ran)"
    else:
        energy = "n/a (no GPU and no clock requests to price)"
    print(
        f"summary over iterations 1-{iterations - 1} (iteration 0 compiles): mean {time_s * 1e3:.1f} ms per "
        f"iteration (plan {point['time_s'] * 1e3:.2f} ms, x{time_s / point['time_s']:.3g}), energy {energy} "
        f"(plan {point['energy_j']:.2f} J)",
        flush=True,
    )


if __name__ == "__main__":
    main()
