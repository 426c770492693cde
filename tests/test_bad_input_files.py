"""Bad plan and dump files, one by one: the crashes reported and the fuzzer found, files
larger than any real one, and valid plans at the schema's bounds rendered for real (the fuzzer
stands in for the PNG images; see tests/test_fuzz_readers.py)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from kareus_fx.capture import dump as dump_module
from kareus_fx.capture.dump import DumpFormatError, load_dump
from kareus_fx.cli import main
from kareus_fx.plan import plan_format
from kareus_fx.plan.plan_format import PlanFormatError, load_plan
from kareus_fx.report.inspector import inspected_html, load_inspectable


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["inspect", *args])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def plan_data(small_real_plan):
    return json.loads(small_real_plan[0].read_text())


def _first_type(data):
    return next(iter(data["partition_types"]))


# Four reported crashes (each a raw exception in a reader before the schema), then what the
# fuzzer found: (edit of a real plan, the field the refusal names).
REGRESSIONS = [
    # AttributeError: 'NoneType' object has no attribute 'startswith' (slot-op shortener)
    (
        lambda d: d["partition_types"][_first_type(d)]["slots"][0]["ops"].__setitem__(0, None),
        r"partition_types\.T0\.slots\[0\]\.ops\[0\]: Input should be a valid string",
    ),
    # AttributeError: 'bool' object has no attribute 'get' (metrics table)
    (
        lambda d: d["methods"]["kareus"].__setitem__("metrics", True),
        r"methods\.kareus\.metrics: Input should be a valid dictionary",
    ),
    # AttributeError: 'float' object has no attribute 'get' (slot records)
    (
        lambda d: d["partition_types"][_first_type(d)]["slots"].__setitem__(0, 1.5),
        r"partition_types\.T0\.slots\[0\]: Input should be a valid dictionary",
    ),
    # TypeError: unhashable type: 'dict' (partition-type lookup)
    (
        lambda d: d["stages"][0]["graphs"]["forward"]["partition_types"].update(x={"T0": 1}),
        r"stages\[0\]\.graphs\.forward\.partition_types\.x: Input should be a valid string",
    ),
    # found by the real-image test below: a clock the GPU does not have crashed the HTML timelines
    (
        lambda d: d["microbatch_options"]["0/forward"][0].__setitem__("clock_mhz", 100_000),
        r"microbatch_options\.0/forward\[0\]\.clock_mhz: 100000 MHz outside the A100-SXM4-40GB's clock range",
    ),
    (
        lambda d: d["microbatch_options"]["0/forward"][-1]["configs"][
            next(iter(d["microbatch_options"]["0/forward"][-1]["configs"]))
        ].__setitem__("comm_sms", 108),
        r"comm_sms: 108 outside 1-107 \(the A100-SXM4-40GB has 108 SMs\)",
    ),
    # found fuzzing: math.isfinite(10**400) raised OverflowError in the number check
    (
        lambda d: d["iteration_frontier"][0].__setitem__("energy_j", 10**400),
        r"iteration_frontier\[0\]\.energy_j: expected a number >= 0 and <= 1e\+30",
    ),
]


@pytest.mark.parametrize(("edit", "message"), REGRESSIONS)
def test_reported_crashes_are_refusals_naming_the_field(plan_data, tmp_path, edit, message):
    data = json.loads(json.dumps(plan_data))
    edit(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFormatError, match=message):
        load_plan(path)
    rc, out, err = _cli(str(path))
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"kareus inspect: error: {path}: ") and "regenerate the plan with `kareus plan`" in err


def _sparse(path, size):
    with path.open("wb") as f:
        f.truncate(size)  # nothing written: reading it would take a while, refusing it must not
    return path


def test_files_larger_than_any_real_plan_or_dump_are_refused_unread(tmp_path, monkeypatch):
    plan = _sparse(tmp_path / "plan.json", plan_format.MAX_PLAN_BYTES + 1)
    with pytest.raises(PlanFormatError, match=r"plan.json: \d+ bytes, more than any real kareus plan"):
        load_plan(plan)
    dump = _sparse(tmp_path / "dump.json", dump_module.MAX_DUMP_BYTES + 1)
    with pytest.raises(DumpFormatError, match=r"dump.json: \d+ bytes, more than any real kareus graph dump"):
        load_dump(dump)
    rc, _, err = _cli(str(dump))
    assert rc == 2 and "more than any real kareus plan or graph dump" in err

    def no_read(*args, **kwargs):
        raise AssertionError("read a file larger than the bound")

    monkeypatch.setattr("pathlib.Path.read_bytes", no_read)
    with pytest.raises(PlanFormatError):
        load_plan(plan)


def test_not_json_not_utf8_and_not_a_plan(tmp_path, plan_data):
    path = tmp_path / "plan.json"
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(PlanFormatError, match=r"plan.json is not a kareus plan: not UTF-8 text"):
        load_plan(path)
    path.write_text(json.dumps(plan_data).replace('"time_s": 0.', '"time_s": NaN, "x": 0.', 1))
    with pytest.raises(PlanFormatError, match="NaN is not a number JSON allows"):
        load_plan(path)
    path.write_text(json.dumps(plan_data)[:-100])  # cut short: still read as a plan
    rc, _, err = _cli(str(path))
    assert rc == 2 and "plan.json is not a kareus plan: invalid JSON" in err
    path.write_text(json.dumps({**plan_data, "format": "something-else"}))
    rc, _, err = _cli(str(path))
    assert rc == 2 and "format: expected 'kareus-plan', got 'something-else' (not a kareus plan)" in err


def test_dump_refusals_name_the_field(small_real_plan, tmp_path):
    (seed,) = (small_real_plan[1] / "dumps" / "stage0-nanobatched").glob("*.json")
    data = json.loads(seed.read_text())
    path = tmp_path / "dump.json"
    for edit, message in [
        # 1e999 is valid JSON that Python reads as infinity
        (
            lambda d: d["graphs"][0]["nodes"][3].update(flops=12345.678),
            r"graphs\[0\]\.nodes\[3\]\.flops: expected a finite number",
        ),
        (
            lambda d: d["graphs"][0]["partitions"][0]["slots"][0].append("nowhere"),
            r"graphs\[0\]\.partitions\[0\]: node 'nowhere' is not in the graph's nodes",
        ),
        (
            lambda d: d["graphs"][0].pop("leftover"),
            r"graphs\[0\]: a partitioned graph has partitions, partition_types and leftover",
        ),
        (lambda d: d.update(schema_version=2), "has dump schema_version 2; this kareus-fx reads version 1"),
    ]:
        broken = json.loads(json.dumps(data))
        edit(broken)
        path.write_text(json.dumps(broken).replace("12345.678", "1e999"))
        with pytest.raises(DumpFormatError, match=message):
            load_dump(path)
        rc, _out, err = _cli(str(path))
        assert rc == 2 and err.count("\n") == 1 and "regenerate the dump" in err


def test_a_dump_with_one_graph_unpartitioned_is_planned_sequentially_not_a_crash(small_real_plan, tmp_path):
    """Regression (found by the full suite, compile-time tuning at TP1): the validated dump fills an
    absent ``partitions`` with null and ``partition_types_from_dump`` iterated it (TypeError)."""
    from kareus_fx.errors import UnsupportedGraphError
    from kareus_fx.plan.graph_workload import partitioned_graphs

    (seed,) = (small_real_plan[1] / "dumps" / "stage0-nanobatched").glob("*.json")
    data = json.loads(seed.read_text())
    for key in ("partitions", "partition_types", "leftover"):
        del data["graphs"][1][key]
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UnsupportedGraphError, match="nanobatched backward graph has no partitions"):
        partitioned_graphs(load_dump(path))


def _at_the_bounds(data: dict) -> dict:
    """A valid plan whose numbers sit at the schema's limits: huge work and times, zero energies,
    the GPU's highest clock, all its SMs but one, and every microbatch on its nanobatched option."""
    data = json.loads(json.dumps(data))
    for record in data["partition_types"].values():
        for slot in record["slots"]:
            slot["flops"], slot["bytes"] = 1e30, 0
        record["collective"]["bytes"] = 1e30
    for options in data["microbatch_options"].values():
        for option in options:
            option.update(clock_mhz=1410, time_s=1e30, energy_j=0)
            for config in (option["configs"] or {}).values():
                config["comm_sms"] = 107  # an A100 has 108 SMs
    point = data["iteration_frontier"][0]
    for key, indices in point["choices"].items():
        split = next(i for i, o in enumerate(data["microbatch_options"][key]) if not o["sequential"])
        point["choices"][key] = [split] * len(indices)
    point.update(time_s=1e30, energy_j=0.0)
    for method in data["methods"].values():
        method["frontier"] = [[1e30, 0.0], [0.0, 1e30]]
    return data


@pytest.mark.slow
def test_extreme_valid_plan_renders_real_html(plan_data, tmp_path):
    """Real matplotlib images (not the fuzzer's stand-ins) for a plan at the schema's bounds."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_at_the_bounds(plan_data)))
    page = inspected_html(load_inspectable(path))
    assert page.count('src="data:image/png;base64,') == 1 + len(plan_data["partition_types"])
    rc, _out, err = _cli(str(path))
    assert rc == 0 and err == ""
