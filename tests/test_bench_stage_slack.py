"""bench/stage_slack.py's arithmetic: the splits it plans, the idle share and the interpolation."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import stage_slack


def test_splits_run_from_even_to_balanced_one_layer_at_a_time():
    assert stage_slack.splits_between([14, 14], [16, 12]) == [(14, 14), (15, 13), (16, 12)]
    assert stage_slack.splits_between([14, 14], [13, 15]) == [(14, 14), (13, 15)]
    assert stage_slack.splits_between([14, 14], [14, 14]) == [(14, 14)]
    with pytest.raises(ValueError, match="two pipeline stages"):
        stage_slack.splits_between([10, 9, 9], [10, 10, 8])


def test_idle_share_is_the_faster_stages_idle_time_at_the_fastest_option():
    def option(time_s: float) -> SimpleNamespace:
        return SimpleNamespace(time_s=time_s)

    options = {
        (0, "forward"): (option(0.10), option(0.12)),
        (0, "backward"): (option(0.20),),
        (1, "forward"): (option(0.08),),
        (1, "backward"): (option(0.16), option(0.30)),
    }
    # Stage 0: 0.30 s, stage 1: 0.24 s -> the faster stage idles 20 % of the slower one's step.
    assert stage_slack.idle_share(options) == pytest.approx(0.2)


def test_matching_idle_share_interpolates_between_the_bracketing_splits():
    points = [
        {"idle_share_pct": 18.0, "ours_mp_energy_red_pct": 12.0},
        {"idle_share_pct": 5.0, "ours_mp_energy_red_pct": 7.0},
        {"idle_share_pct": 7.0, "ours_mp_energy_red_pct": 9.0},
    ]
    assert stage_slack.matching_idle_share(points, 8.0) == pytest.approx(6.0)
    assert stage_slack.matching_idle_share(points, 10.5) == pytest.approx(7.0 + 11.0 * 1.5 / 3.0)
    assert stage_slack.matching_idle_share(points, 13.0) is None
    assert stage_slack.matching_idle_share(points, 6.0) is None
