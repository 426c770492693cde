"""bench/perseus_slack_sources.py's arithmetic: equalised stages, the heavier last stage, and
Perseus's saving growing with the slack it slows into."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import perseus_slack_sources as pss

from kareus_fx.compose.iteration import InstructionOption
from kareus_fx.compose.pipeline_schedule import Instruction

# A frequency curve shaped like the Perseus A100 profile's, in the A100's 30 MHz clock steps: a
# slower clock costs time and saves energy, the saving flattening towards 990 MHz.
_CURVE = tuple((f, (1410 / f) ** 0.6, 0.75 + 0.25 * ((f - 990) / 420) ** 2) for f in range(1410, 989, -30))


def _options(stage_scale: tuple[float, float]) -> dict[tuple[int, Instruction], list[InstructionOption]]:
    base: dict[Instruction, tuple[float, float]] = {"forward": (0.10, 30.0), "backward": (0.20, 70.0)}
    return {
        (stage, name): [InstructionOption(t * rt * scale, e * re * scale, clock) for clock, rt, re in _CURVE]
        for stage, scale in enumerate(stage_scale)
        for name, (t, e) in base.items()
    }


def test_equalised_gives_every_stage_the_mean_option_at_each_clock():
    out = pss.equalised(_options((1.0, 1.2)))
    for name in ("forward", "backward"):
        assert out[(0, name)] == out[(1, name)]
    fwd = {o.knob: o for o in out[(0, "forward")]}
    assert fwd[1410].time_s == pytest.approx(0.10 * 1.1)
    assert fwd[990].energy_j == pytest.approx(30.0 * 0.75 * 1.1)


def test_heavier_last_stage_scales_its_time_and_energy_only():
    base = _options((1.0, 1.0))
    out = pss.with_heavier_last_stage(base, 0.05)
    assert out[(0, "backward")] == base[(0, "backward")]
    for before, after in zip(base[(1, "backward")], out[(1, "backward")]):
        assert after.time_s == pytest.approx(1.05 * before.time_s)
        assert after.energy_j / after.time_s == pytest.approx(before.energy_j / before.time_s)


def test_without_a_slower_clock_perseus_saves_nothing():
    only_max = {key: [items[0]] for key, items in _options((1.0, 1.1)).items()}
    saving = pss.perseus_saving(only_max, 4, blocking_power_w=85.0)
    assert saving["mp_energy_red_pct"] == pytest.approx(0.0, abs=1e-9)
    assert saving["least_energy_red_pct"] == pytest.approx(0.0, abs=1e-9)


def test_perseus_saving_grows_with_the_stage_imbalance():
    sources = pss.slack_sources(_options((1.0, 1.0)), 4, blocking_power_w=85.0)
    sweep = sources["heavier_last_stage"]
    savings = [p["ours_mp_energy_red_pct"] for p in sweep]
    assert all(b >= a - 1e-9 for a, b in itertools.pairwise(savings))
    assert savings[-1] > savings[0] + 1.0
    assert [p["idle_share_pct"] for p in sweep] == pytest.approx(
        [100.0 * (1 - 1 / (1 + x / 100.0)) for x in pss.EXTRA_LOAD_PCT]
    )
    # Equal stages: only the 1F1B warm-up and cool-down are off the critical path.
    assert sources["stages_equalised"]["mp_energy_red_pct"] == pytest.approx(savings[0])
    assert sources["stages_equalised"]["mp_time_red_pct"] >= -1e-6


def test_kareus_options_read_a_plans_microbatch_options_in_order():
    plan = {
        "microbatch_options": {
            "0/forward": [{"time_s": 0.1, "energy_j": 30.0}, {"time_s": 0.12, "energy_j": 27.0}],
            "1/backward": [{"time_s": 0.2, "energy_j": 70.0}],
        }
    }
    out = pss.kareus_options(plan)
    assert out[(0, "forward")] == [InstructionOption(0.1, 30.0, 0), InstructionOption(0.12, 27.0, 1)]
    assert out[(1, "backward")] == [InstructionOption(0.2, 70.0, 0)]


def test_kareus_sweep_gains_energy_from_the_slack_and_keeps_its_time():
    megatron = _options((1.0, 1.0))
    # A Kareus-like method: every option 10 % faster than Megatron-LM's at the same power.
    kareus = {
        key: [InstructionOption(o.time_s * 0.9, o.energy_j * 0.9, o.knob) for o in items]
        for key, items in megatron.items()
    }
    sweep = pss.kareus_sweep(megatron, kareus, 4, blocking_power_w=85.0)

    def value(point: dict[str, float | None], name: str) -> float:
        number = point[name]
        assert number is not None
        return number

    first, last = sweep[0], sweep[-1]
    assert value(first, "kareus_max_throughput_time_reduction_pct") == pytest.approx(10.0, abs=0.5)
    assert value(last, "kareus_max_throughput_time_reduction_pct") == pytest.approx(10.0, abs=0.5)
    energy = "kareus_max_throughput_energy_reduction_pct"
    assert value(last, energy) > value(first, energy) + 1.0
    assert value(last, "mp_energy_red_pct") > value(first, "mp_energy_red_pct") + 1.0
