"""``kareus inspect`` on plans and dumps: text, self-contained HTML, and ``--diff``.

The session's small plan (conftest's ``small_real_plan``: tiny-llama TP2 PP2, 2 layers, 2 microbatches,
simulated GPU, shared with the other tests of plan readers); its planner work directory also holds
the graph dumps the dump tests read.

The HTML is checked by parsing it (every tag closed in order, images decode as PNGs of a sane
size). Rendering it in headless Chromium ("opens without errors" and a screenshot
check) is NOT done: no browser is installed on these machines and none can be downloaded.
"""

from __future__ import annotations

import base64
import copy
import io
import json
import re
from html.parser import HTMLParser

import pytest

from kareus_fx.cli import main
from kareus_fx.plan.plan_format import Plan, load_plan, write_plan
from kareus_fx.report.plan_diff import diff_plans
from kareus_fx.report.plan_summary import rebuild_partition_type

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
VOID_TAGS = {"img", "meta", "br", "hr", "input", "link", "col", "area", "base", "source", "wbr"}


@pytest.fixture(scope="module")
def planned(small_real_plan):
    """(plan.json path, planner work directory) of a tiny-llama plan."""
    return small_real_plan


@pytest.fixture(scope="module")
def dump_path(planned):
    (path,) = (planned[1] / "dumps" / "stage0-nanobatched").glob("kareus_graph_*.json")
    return path


class _TagChecker(HTMLParser):
    """Records the images and fails on an end tag that does not close the innermost open tag."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.images: list[dict[str, str]] = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs))
        if tag not in VOID_TAGS:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()


def _parse_html(text: str) -> _TagChecker:
    checker = _TagChecker()
    checker.feed(text)
    checker.close()
    assert checker.stack == [], f"unclosed tags: {checker.stack}"
    return checker


def _png_size(src: str) -> tuple[int, int]:
    from PIL import Image

    prefix = "data:image/png;base64,"
    assert src.startswith(prefix)
    data = base64.b64decode(src[len(prefix) :], validate=True)
    assert data.startswith(PNG_SIGNATURE)
    with Image.open(io.BytesIO(data)) as image:
        image.verify()
        return image.size


def test_inspect_plan_text_shows_provenance_types_configuration_and_frontier(planned, capsys):
    path, _ = planned
    plan = load_plan(path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "tiny-llama" in out and "TP2 CP1 PP2" in out
    assert "prediction of the simulated GPU" in out  # provenance: numbers come from the cost model
    assert f"{len(plan.data['partition_types'])} partition types" in out
    for type_id in plan.data["partition_types"]:
        assert f"│ {type_id} " in out
    fastest = plan.frontier[plan.point_index("max-throughput")]
    assert f"configuration at frontier point {plan.point_index('max-throughput')}" in out
    assert f"{fastest['time_s']:.4f} s" in out
    for label in ("Megatron-LM", "Megatron-LM + Perseus", "Kareus", "max throughput time"):
        assert label in out


def test_inspect_plan_html_is_well_formed_with_frontier_and_timelines(planned, tmp_path, capsys):
    path, _ = planned
    plan = load_plan(path)
    out = tmp_path / "report.html"
    assert main(["inspect", str(path), "--html", str(out)]) == 0
    page = _parse_html(out.read_text())
    frontier = [img for img in page.images if img.get("id") == "frontier"]
    assert len(frontier) == 1
    width, height = _png_size(frontier[0]["src"])
    assert width > 300 and height > 200
    timelines = [img for img in page.images if img.get("class") == "timeline"]
    assert len(timelines) == len(plan.data["partition_types"])  # every type runs at max throughput
    for img in timelines:
        width, height = _png_size(img["src"])
        assert width > 500 and height > 100
    text = out.read_text()
    assert 'src="http' not in text and "<script" not in text  # self-contained
    assert "Chosen configuration (max throughput)" in text and "Partition timelines" in text


def test_rebuilt_partition_type_keeps_the_recorded_work(planned):
    plan = load_plan(planned[0])
    for type_id, record in plan.data["partition_types"].items():
        ptype = rebuild_partition_type(type_id, record)
        assert len(ptype.slots) == len(record["slots"])
        for slot, rec in zip(ptype.slots, record["slots"]):
            assert [op.target for op in slot.ops] == rec["ops"]
            assert slot.flops == pytest.approx(rec["flops"]) and slot.bytes == pytest.approx(rec["bytes"])
        assert ptype.collective.bytes == record["collective"]["bytes"]


def test_inspect_dump_text_and_html(dump_path, tmp_path, capsys):
    assert main(["inspect", str(dump_path)]) == 0
    text = capsys.readouterr().out
    assert "partition types" in text and "leftover" in text
    out = tmp_path / "dump.html"
    assert main(["inspect", str(dump_path), "--html", str(out)]) == 0
    page = out.read_text()
    _parse_html(page)
    dump = json.loads(dump_path.read_text())
    for record in dump["graphs"][0]["partition_types"]:
        assert record["type"] in page


def _run_nanobatched(data: dict, key: str, comm_sms: int) -> str:
    """Edit ``data`` so that the max-throughput point runs ``key`` nanobatched on every microbatch,
    each of the graph's partition types with ``comm_sms`` SMs launching at slot 0 (the tiny
    model's own plan runs everything un-split); return one of those types."""
    point = data["iteration_frontier"][Plan(data).point_index("max-throughput")]
    index = point["choices"][key][0]
    point["choices"][key] = [index] * data["workload"]["microbatches"]
    stage, instruction = key.split("/")
    types = sorted(data["stages"][int(stage)]["graphs"][instruction]["partition_types"].values())
    option = data["microbatch_options"][key][index]
    option["sequential"] = False
    option["configs"] = {tid: {"comm_sms": comm_sms, "launch_slot": 0} for tid in types}
    return types[0]


def test_diff_reports_a_changed_configuration(planned, tmp_path, capsys):
    original = json.loads(planned[0].read_text())
    a, b = copy.deepcopy(original), copy.deepcopy(original)
    type_id = _run_nanobatched(a, "0/forward", comm_sms=8)
    _run_nanobatched(b, "0/forward", comm_sms=12)
    index = b["iteration_frontier"][Plan(b).point_index("max-throughput")]["choices"]["0/forward"][0]
    clock = b["microbatch_options"]["0/forward"][index]["clock_mhz"]
    b["microbatch_options"]["0/forward"][index]["clock_mhz"] = clock - 30
    for name, data in (("a", a), ("b", b)):
        write_plan(tmp_path / f"{name}.json", data)  # validates the edited copies

    assert main(["inspect", "--diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "[max-throughput configuration]" in out
    every = f"0-{original['workload']['microbatches'] - 1}"
    assert f"0/forward microbatches {every}: clock {clock} -> {clock - 30} MHz" in out
    assert (
        f"0/forward microbatches {every} {type_id}: {clock} MHz, 8 SMs, slot 0 -> {clock - 30} MHz, 12 SMs, slot 0"
    ) in out
    assert "1/forward" not in out and "0/backward" not in out  # untouched steps are not reported

    assert main(["inspect", "--diff", str(planned[0]), str(tmp_path / "a.json")]) == 0
    # every microbatch reported un-split -> nanobatched, grouped by what else changed (the planned
    # fastest point may run microbatches off the critical path at another clock: compose/slack.py)
    split = re.findall(r"0/forward microbatch(?:es)? ([\d, -]+): un-split -> nanobatched", capsys.readouterr().out)
    reported = set()
    for part in ", ".join(split).split(", "):
        first, _, last = part.partition("-")
        reported |= set(range(int(first), int(last or first) + 1))
    assert reported == set(range(original["workload"]["microbatches"])), split
    assert diff_plans(load_plan(tmp_path / "a.json"), load_plan(tmp_path / "a.json")) == []


def test_diff_of_dumps_reports_partition_changes(planned, capsys):
    dumps = planned[1] / "dumps"
    (split,) = (dumps / "stage0-nanobatched").glob("*.json")
    (whole,) = (dumps / "stage0-sequential").glob("*.json")
    assert main(["inspect", "--diff", str(split), str(whole)]) == 0
    out = capsys.readouterr().out
    assert "partition type removed" in out and "nodes" in out


def test_bad_plan_and_mixed_diff_fail_with_clear_errors(planned, tmp_path, capsys):
    data = json.loads(planned[0].read_text())
    del data["stages"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    assert main(["inspect", str(bad)]) == 2
    assert "bad.json: missing stages" in capsys.readouterr().err
    (dump,) = (planned[1] / "dumps" / "stage0-nanobatched").glob("*.json")
    assert main(["inspect", "--diff", str(planned[0]), str(dump)]) == 2
    assert "two plans or two dumps" in capsys.readouterr().err
    assert main(["inspect"]) == 2
