"""Paper section 3 on a traced partition: energy per (clock, comm SMs, launch slot) on the simulated GPU.

Traces Llama-3.2-3B at TP=4 (the paper's Figure 3), microbatch 8, sequence 4096, 4 layers, on
the meta device under the fake process group, takes the forward partition type that holds the
attention kernel, and prints the simulated energy (J) of every launch slot at a few SM counts,
per clock, and the joint optimum over the tuner's SM grid (3..30 step 3). Every number is a
prediction of the simulated GPU (a calibrated cost model), not a measurement.
``tests/test_simulator_traced.py`` asserts the effects on the same partition.

    python bench/section3_traced.py [--tp 4] [--clocks 1410 1100] [--sms 4 6 8 10 12 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile

from kareus_fx.capture.dump import load_dump
from kareus_fx.capture.tracing import TraceSpec, trace_full_size
from kareus_fx.cost_models.simulator import Simulator
from kareus_fx.plan.graph_workload import partitioned_graphs
from kareus_fx.workload import PartitionConfig, PartitionType

GPU = "A100-SXM4-40GB"
ATTENTION = "kareus.attention.default"


def attention_partition(tp: int) -> PartitionType:
    """The traced forward partition type whose computation holds the attention kernel."""
    spec = TraceSpec(model="llama3.2-3b", tp=tp, mbs=8, seq=4096, layers=4)
    with tempfile.TemporaryDirectory() as dump_dir:
        (path,) = trace_full_size(spec, options={"dump_dir": dump_dir, "gpu": GPU}).dump_paths
        forward = partitioned_graphs(load_dump(path))["forward"]
    (ptype,) = [t for t in forward.ptypes if any(op.target == ATTENTION for s in t.slots for op in s.ops)]
    return ptype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--clocks", type=int, nargs="+", default=[1410, 1100])
    parser.add_argument("--sms", type=int, nargs="+", default=[4, 6, 8, 10, 12, 30])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    ptype = attention_partition(args.tp)
    sim = Simulator(GPU)
    slots = {s: f"{s}:{ptype.slots[s].bound}" for s in ptype.launch_slots}
    result: dict = {"tp": args.tp, "launch_slots": slots, "clocks": {}}
    for clock in args.clocks:
        energy = {
            n: {s: sim.measure(ptype, PartitionConfig(clock, n, s)).energy_j for s in ptype.launch_slots}
            for n in args.sms
        }
        best_j, best_sms, best_slot = min(
            (sim.measure(ptype, PartitionConfig(clock, n, s)).energy_j, n, s)
            for n in range(3, 31, 3)
            for s in ptype.launch_slots
        )
        result["clocks"][clock] = {
            "energy_j": energy,
            "optimum": {"energy_j": best_j, "comm_sms": best_sms, "launch_slot": best_slot},
        }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"Llama-3.2-3B TP{args.tp} forward attention partition, simulated {GPU}; launch slots {list(slots.values())}")
    for clock, entry in result["clocks"].items():
        print(f"{clock} MHz, energy (J) per launch slot:")
        for n, row in entry["energy_j"].items():
            print(f"  {n:>2} SMs: " + "  ".join(f"{row[s]:.4f}" for s in ptype.launch_slots))
        best = entry["optimum"]
        print(
            f"  optimum over 3..30 SMs: {best['comm_sms']} SMs at slot {slots[best['launch_slot']]}, "
            f"{best['energy_j']:.4f} J"
        )


if __name__ == "__main__":
    main()
