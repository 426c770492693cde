"""How much a collective slows with the SM clock on the simulated A100, at the SM counts Kareus picks.

    python bench/collective_clock.py [--json]

The kernel model prices a collective's bus bandwidth as a smooth minimum of a per-SM rate x SMs
and a cap (the links'); the per-SM rate scales with ``(clock / max clock) ** comm_clock_exponent``
(``KernelModel.collective_bandwidth``), a prior of 0 (the paper: communication bandwidth largely
unchanged with the clock); the calibration data hold collectives at one clock only (Kareus's
attention partition at the unlocked clock, NanoFlow's NCCL curves at the default clock), so nothing
in them measures a collective against the clock.

For the testbed's TP all-reduces (Qwen3-1.7B, hidden 2,048, bf16, one per nanobatch: half a
microbatch) this prints, per SM count and clock, the collective's time relative to 1,410 MHz with
the prior exponent and with 1 (every cycle of a request in the SM clock domain: the upper
bound), and how far the collective sits below its cap (per-SM rate x SMs over the cap: above
about 1.5 it is link bound, and no exponent slows it). Reported, not fitted.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.cost_models.kernel_model import KernelModel
from kareus_fx.cost_models.sim_params import gpu_params
from kareus_fx.workload import CollectiveSpec, CommLibrary

GPU = "A100-SXM4-40GB"
HIDDEN = 2048
BF16_BYTES = 2
CLOCKS_MHZ = (1410, 1230, 1080, 900)
CASES: tuple[tuple[str, int, int, int], ...] = (
    # (label, group size, tokens per nanobatch on one GPU, ...)
    ("TP8 mbs12 4K nanobatch", 8, 6 * 4096, 0),
    ("TP8 mbs8 8K nanobatch", 8, 4 * 8192, 0),
    ("CP2 x TP4 mbs16 4K nanobatch", 4, 8 * 2048, 0),
)
SM_COUNTS: tuple[tuple[int, CommLibrary], ...] = ((3, "mscclpp"), (6, "mscclpp"), (12, "mscclpp"), (24, "nccl"))


def linear_over_cap(km: KernelModel, coll: CollectiveSpec, sms: int, library: CommLibrary) -> float:
    """The per-SM rate x SMs over the cap at the maximum clock (how far from link bound)."""
    p = km.params
    peers = coll.group_size - 1
    per = km.comm_per_sm_rate(coll.kind, peers, library)
    if library == "nccl":
        cap = min(p.nccl_bus_bw_cap_bytes_per_s, km.spec.nvlink_bandwidth_bytes_per_s)
    else:
        cap = min(
            p.comm_bus_bw_cap_bytes_per_s * max(1, peers) ** p.comm_peer_exponent, km.spec.nvlink_bandwidth_bytes_per_s
        )
    return per * sms / cap


def rows() -> list[dict]:
    spec, params = gpu_spec(GPU), gpu_params(GPU).params
    models = {
        "prior": KernelModel(spec, params),
        "exponent_1": KernelModel(spec, replace(params, comm_clock_exponent=1.0)),
    }
    out = []
    for label, group, tokens, _ in CASES:
        coll = CollectiveSpec("all_reduce", tokens * HIDDEN * BF16_BYTES, group_size=group)
        for sms, library in SM_COUNTS:
            row: dict = {
                "case": label,
                "bytes": coll.bytes,
                "sms": sms,
                "library": library,
                "linear_over_cap": round(linear_over_cap(models["prior"], coll, sms, library), 2),
                "time_ms_1410": round(1e3 * models["prior"].collective_time(coll, sms, 1410, library), 3),
            }
            for name, km in models.items():
                base = km.collective_time(coll, sms, 1410, library)
                row[name] = {f"{f}": round(km.collective_time(coll, sms, f, library) / base, 3) for f in CLOCKS_MHZ}
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    data = {
        "gpu": GPU,
        "comm_clock_exponent": gpu_params(GPU).params.comm_clock_exponent,
        "rows": rows(),
    }
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    print(f"{GPU}, collective clock exponent {data['comm_clock_exponent']}")
    print("case | SMs (library) | linear/cap | ms at 1,410 | time ratio prior | time ratio exponent 1")
    for r in data["rows"]:
        cal = " ".join(f"{v:.3f}" for v in r["prior"].values())
        one = " ".join(f"{v:.3f}" for v in r["exponent_1"].values())
        print(
            f"{r['case']} | {r['sms']} ({r['library']}) | {r['linear_over_cap']} | {r['time_ms_1410']} | {cal} | {one}"
        )
    print("clocks:", ", ".join(f"{f} MHz" for f in CLOCKS_MHZ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
