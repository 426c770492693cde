"""GPU specifications: the numbers every cost estimate and search space starts from.

The values come from ``data/gpu_specs.json`` (a copy of the hand-compiled, per-field-sourced table
in the project's shared data; each field keeps its ``source``). ``A100-SXM4-80GB`` inherits the
40 GB board's fields where its own entry is silent (same GA100 die and clocks).

Assumptions, stated once:
- Dense BF16 peak scales linearly with the SM clock; the spec's peak is quoted at
  ``peak_clock_mhz`` (1410 MHz on A100, 1830 MHz tensor clock on H100/H200).
- HBM bandwidth does not depend on the SM clock (memory clock is separate).
- Static power is the ready-state (P0) power with no significant work running (docs/design.md).
On a real GPU the supported clocks come from NVML (``runtime``); these specs are the default
when no GPU is present.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache, lru_cache
from importlib import resources
from typing import Any

from kareus_fx.errors import UnknownGPUError

DEFAULT_GPU = "A100-SXM4-40GB"

# User-facing aliases -> canonical spec-table keys.
_ALIASES: dict[str, str] = {
    "a100": "A100-SXM4-40GB",
    "a100-40gb": "A100-SXM4-40GB",
    "a100-sxm4-40gb": "A100-SXM4-40GB",
    "a100-80gb": "A100-SXM4-80GB",
    "a100-sxm4-80gb": "A100-SXM4-80GB",
    "h100": "H100-SXM5-80GB",
    "h100-sxm": "H100-SXM5-80GB",
    "h100-sxm5-80gb": "H100-SXM5-80GB",
    "h200": "H200-SXM-141GB",
    "h200-sxm": "H200-SXM-141GB",
    "h200-sxm-141gb": "H200-SXM-141GB",
}

# Fields missing from a board's entry are taken from this one (same die).
_INHERITS: dict[str, str] = {
    "A100-SXM4-80GB": "A100-SXM4-40GB",
    "H200-SXM-141GB": "H100-SXM5-80GB",
}

# Useful clock floor for tuning: below it, training throughput collapses and no energy is saved
# (Perseus profiles start at 855 MHz on A100; the Kareus search space is 900-1410 MHz, appendix B).
_TUNING_MIN_CLOCK_MHZ: dict[str, int] = {
    "A100-SXM4-40GB": 900,
    "A100-SXM4-80GB": 900,
    "H100-SXM5-80GB": 1200,
    "H200-SXM-141GB": 1200,
}

# Values the spec table does not give, with their sources.
_SUPPLEMENTS: dict[str, dict[str, dict[str, Any]]] = {
    "A100-SXM4-40GB": {
        "static_power_w": {
            "value": 60.0,
            "source": "Kareus paper Table 1 (ready-state P0 power, about 60 W per A100); "
            "A100-80GB nvidia-smi idle P0 59-62 W (gpu_specs.json)",
        },
        "peak_clock_mhz": {"value": 1410, "source": "A100 datasheet boost clock"},
        "node_network": {
            "gpus_per_node": 8,
            "Gbps": 400,
            "source": "AWS p4d.24xlarge: 8 A100-SXM4-40GB, 400 Gbps EFA (4 x 100 Gbps) shared by the node's GPUs "
            "(aws.amazon.com/ec2/instance-types/p4); the Kareus paper's testbed: two p4d.24xlarge, 400 Gbps "
            "between nodes (../shared/data/README.md)",
        },
    },
    "A100-SXM4-80GB": {
        "static_power_w": {"value": 61.0, "source": "gpu_specs.json idle_power_p0_w (59, 61, 62)"},
        "node_network": {
            "gpus_per_node": 8,
            "Gbps": 400,
            "source": "AWS p4de.24xlarge: 8 A100-SXM4-80GB, 400 Gbps EFA (aws.amazon.com/ec2/instance-types/p4)",
        },
    },
    "H100-SXM5-80GB": {
        "static_power_w": {"value": 78.8, "source": "gpu_specs.json idle_power_w"},
        "node_network": {
            "gpus_per_node": 8,
            "Gbps": 3200,
            "source": "AWS p5.48xlarge: 8 H100-SXM, 3200 Gbps EFA (aws.amazon.com/ec2/instance-types/p5)",
        },
        "peak_clock_mhz": {"value": 1830, "source": "gpu_specs.json tensor_clock_used_for_peak_mhz"},
        "p2p_blocking_power_w": {
            "value": 110.0,
            "source": "unverified: A100 blocking/idle ratio (85/60) applied to H100 idle 78.8 W",
        },
    },
    "H200-SXM-141GB": {
        "static_power_w": {
            "value": 78.8,
            "source": "unverified: H100 SXM idle power (same GH100 die)",
        },
        "sm_clock_step_mhz": {"value": 15, "source": "assumed same grid as H100 (verify with NVML)"},
        "node_network": {
            "gpus_per_node": 8,
            "Gbps": 3200,
            "source": "AWS p5e.48xlarge: 8 H200, 3200 Gbps EFA (aws.amazon.com/ec2/instance-types/p5)",
        },
    },
}


@dataclass(frozen=True)
class GPUSpec:
    """One GPU model's specification. Units are in the field names."""

    name: str
    sm_count: int
    clock_min_mhz: int
    clock_max_mhz: int
    clock_step_mhz: int
    tuning_clock_min_mhz: int
    peak_clock_mhz: int
    hbm_bandwidth_bytes_per_s: float
    bf16_peak_flops_per_s: float
    tdp_w: float
    static_power_w: float
    blocking_power_w: float
    nvlink_bandwidth_bytes_per_s: float
    gpus_per_node: int | None = None
    node_network_bytes_per_s: float | None = None
    """The network between nodes, per node (line rate, shared by the node's GPUs): what a pipeline
    stage's send/recv to another node runs over. None: no sourced node for this GPU."""
    sources: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def peak_flops_per_s(self, clock_mhz: float | None = None) -> float:
        """Dense BF16 peak at ``clock_mhz`` (default: max clock), linear in the clock."""
        clock = self.clock_max_mhz if clock_mhz is None else clock_mhz
        return self.bf16_peak_flops_per_s * min(clock, self.peak_clock_mhz) / self.peak_clock_mhz

    def ridge_point_flops_per_byte(self, clock_mhz: float | None = None) -> float:
        """Arithmetic intensity above which an op is compute-bound (roofline ridge point)."""
        return self.peak_flops_per_s(clock_mhz) / self.hbm_bandwidth_bytes_per_s

    @property
    def node_network_share_bytes_per_s(self) -> float | None:
        """One GPU's share of its node's network line rate (every GPU of the node sends at once);
        None when the spec has no sourced node."""
        if self.node_network_bytes_per_s is None or self.gpus_per_node is None:
            return None
        return self.node_network_bytes_per_s / self.gpus_per_node

    def supported_clocks_mhz(self) -> list[int]:
        """All clocks on the spec grid from the minimum to the maximum, descending (as NVML lists them)."""
        return list(range(self.clock_max_mhz, self.clock_min_mhz - 1, -self.clock_step_mhz))


def known_gpus() -> list[str]:
    """Canonical names of every GPU with a spec."""
    return sorted(_spec_table())


def gpu_name_for_device(device_name: str) -> str | None:
    """The spec of a CUDA device called ``device_name`` (``torch.cuda.get_device_name``, e.g.
    "NVIDIA H100 80GB HBM3"), by family and, for the A100, memory size; None if none matches."""
    for family, name in (
        ("H200", "h200"),
        ("H100", "h100"),
        ("A100", "a100-80gb" if "80GB" in device_name else "a100"),
    ):
        if family in device_name:
            return canonical_gpu_name(name)
    return None


def canonical_gpu_name(name: str) -> str:
    """Resolve a user-given GPU name or alias; raise :class:`UnknownGPUError` naming the valid ones."""
    table = _spec_table()
    if name in table:
        return name
    key = _ALIASES.get(name.strip().lower())
    if key is None:
        valid = ", ".join(known_gpus() + sorted(_ALIASES))
        raise UnknownGPUError(f"unknown GPU {name!r}; known GPUs and aliases: {valid}")
    return key


@cache
def gpu_spec(name: str = DEFAULT_GPU) -> GPUSpec:
    """The :class:`GPUSpec` for ``name`` (canonical name or alias)."""
    key = canonical_gpu_name(name)
    fields = _merged_fields(key)

    def value(field_name: str) -> Any:
        return fields[field_name]["value"]

    nvlink = fields["nvlink"]
    links = nvlink["links"]
    nvlink_bytes_per_s = links * nvlink["nccl_effective_GBps_per_link"] * 1e9
    sources = {k: _source(v) for k, v in fields.items() if isinstance(v, dict)}
    return GPUSpec(
        name=key,
        sm_count=int(value("sm_count")),
        clock_min_mhz=int(value("sm_clock_min_mhz" if "sm_clock_min_mhz" in fields else "sm_clock_idle_mhz")),
        clock_max_mhz=int(value("sm_clock_max_mhz")),
        clock_step_mhz=int(value("sm_clock_step_mhz")),
        tuning_clock_min_mhz=_TUNING_MIN_CLOCK_MHZ[key],
        peak_clock_mhz=int(value("peak_clock_mhz")),
        hbm_bandwidth_bytes_per_s=float(value("hbm_bandwidth_GBps")) * 1e9,
        bf16_peak_flops_per_s=float(value("bf16_dense_tflops")) * 1e12,
        tdp_w=float(value("tdp_w")),
        static_power_w=float(value("static_power_w")),
        blocking_power_w=float(value("p2p_blocking_power_w")),
        nvlink_bandwidth_bytes_per_s=nvlink_bytes_per_s,
        gpus_per_node=int(fields["node_network"]["gpus_per_node"]),
        node_network_bytes_per_s=float(fields["node_network"]["Gbps"]) * 1e9 / 8,
        sources=sources,
    )


@lru_cache(maxsize=1)
def _spec_table() -> dict[str, dict[str, Any]]:
    text = resources.files("kareus_fx.cost_models").joinpath("data/gpu_specs.json").read_text()
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def _source(entry: Mapping[str, Any]) -> str:
    """Where a spec field's value comes from: its ``source``, else its ``status``, else ""."""
    return entry.get("source", entry.get("status", ""))


def _merged_fields(key: str) -> dict[str, Any]:
    table = _spec_table()
    parent = _INHERITS.get(key)
    merged: dict[str, Any] = dict(_merged_fields(parent)) if parent else {}
    merged.update(table[key])
    merged.update(_SUPPLEMENTS.get(key, {}))
    return merged
