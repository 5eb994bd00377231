"""`mixlen plan --html`: a self-contained page, rendered in headless Chromium (skipped when no
chromium binary is on PATH), whose DOM shows the policy table, per-rank timelines of the selected
step (checked against the plan dump of the same run), integer rank axes, offload ratios, the
planning times and the length histogram; and a screenshot of the window's size."""

from __future__ import annotations

import html
import json
import math
import re
import struct
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from _browser import CHROMIUM, SKIP_REASON, run_chromium

from datapipe.ingest.preprocess import PreprocessConfig, preprocess
from datapipe.plan.cost import CostModel
from tools.cli import main as cli_main

pytestmark = pytest.mark.timeout(240)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason=SKIP_REASON)
STEPS, RANKS = 3, 4
# 8 layers and cheap host copies so Eq. 3 offload is chosen (as in test_planners.py); a step term
OFFLOAD_COST = CostModel(
    2e-7, 5e-5, 1e-4, 64.0, 1e9, 8, 2000.0, 5e8, name="offload-test", step=0.25
)
# a dataset folder whose name would end the page's data early if a "<" reached the script
# element, and would fill the title with the data if the markers were replaced one by one
DS = "d<!--<script>__DATA__s"


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> dict:
    """A dataset of mixed lengths planned for 3 steps with offload and widen: the page, the dump
    of the same run and the dataset's lengths."""
    tmp = tmp_path_factory.mktemp("plan_html")
    rng = np.random.default_rng(0)
    with open(tmp / "in.jsonl", "w") as f:
        for _ in range(120):
            n = rng.choice([rng.integers(10, 100), rng.integers(100, 300), rng.integers(300, 480)],
                           p=[0.6, 0.3, 0.1])  # fmt: skip
            f.write(json.dumps({"text": "x" * int(n)}) + "\n")
    preprocess(PreprocessConfig([str(tmp / "in.jsonl")], str(tmp / DS), progress=False))
    (tmp / "cost.json").write_text(json.dumps(OFFLOAD_COST.to_dict()))
    args = ["plan", str(tmp / DS), "--ranks", str(RANKS), "--capacity", "128",
            "--global-batch-tokens", "2048", "--policy", "all", "--widen", "--offload",
            "--steps", str(STEPS), "--cost", str(tmp / "cost.json"), "--quiet",
            "--html", str(tmp / "plan.html"), "--dump", str(tmp / "dump.json")]  # fmt: skip
    assert cli_main(args) == 0
    dump = json.loads((tmp / "dump.json").read_text())
    lengths = pq.read_table(tmp / DS / "index.parquet").column("num_tokens").to_pylist()
    return {"tmp": tmp, "html": tmp / "plan.html", "dump": dump, "lengths": lengths, "args": args}


POLICIES = ["static", "naive-hdp+offload", "hdp+offload", "hdp+offload+widen"]


def _dump_step(page: dict, policy: int, step: int) -> dict:
    """The dump holds each policy's steps in turn, in the table's column order."""
    return page["dump"]["steps"][policy * STEPS + step]


def test_page_is_self_contained(page: dict) -> None:
    text = page["html"].read_text()
    assert "<link" not in text and "@import" not in text
    assert not re.search(r"""\ssrc\s*=""", text), "no external scripts or images"
    urls = set(re.findall(r"https?://[^\s\"'<>)]+", text))
    assert urls <= {"http://www.w3.org/2000/svg"}, urls  # the SVG namespace name, never fetched
    data = text.split('id="plan-data">')[1].split("</script>")[0]
    assert "<" not in data and json.loads(data)["title"].startswith(f"mixlen plan {page['tmp']}")
    (title,) = re.findall("<title>(.*?)</title>", text)
    assert title == html.escape(json.loads(data)["title"])


class DomTree(HTMLParser):
    """Elements of a dumped DOM as (tag, attrs, text, ancestors' tags and classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[dict] = []
        self._stack: list[dict] = []

    def handle_starttag(self, tag, attrs):
        el = {"tag": tag, "attrs": dict(attrs), "text": "", "parents": list(self._stack)}
        self.elements.append(el)
        if tag not in ("meta", "br", "input", "img", "link"):
            self._stack.append(el)

    def handle_endtag(self, tag):
        while self._stack:
            if self._stack.pop()["tag"] == tag:
                break

    def handle_data(self, data):
        if self._stack:
            self._stack[-1]["text"] += data

    def find(self, tag: str, cls: str | None = None, inside: dict | None = None) -> list[dict]:
        out = []
        for e in self.elements:
            if e["tag"] != tag:
                continue
            if cls is not None and cls not in e["attrs"].get("class", "").split():
                continue
            if inside is not None and not any(p is inside for p in e["parents"]):
                continue
            out.append(e)
        return out


def _dom(page: dict, fragment: str) -> DomTree:
    url = page["html"].resolve().as_uri() + fragment
    out = run_chromium(
        url, str(page["tmp"] / "profile"), "--dump-dom", "--virtual-time-budget=2000"
    )
    tree = DomTree()
    tree.feed(out)
    return tree


@needs_chromium
def test_dom_table_timelines_histogram(page: dict) -> None:
    dom = _dom(page, "#step=1")
    # the policy table: one column per policy; step times are the dump's, averaged over steps
    (table,) = [e for e in dom.find("table") if e["attrs"].get("id") == "policy-table"]
    head = [e["text"] for e in dom.find("th", inside=table) if e["attrs"].get("data-policy")]
    assert head == POLICIES
    (row,) = [
        e
        for e in dom.find("tr", inside=table)
        if e["attrs"].get("data-row", "").startswith("est. step")
    ]
    cells = [e["text"] for e in dom.find("td", inside=row)][1:]
    for i, cell in enumerate(cells):
        mean = sum(_dump_step(page, i, s)["est_step_time_s"] for s in range(STEPS)) / STEPS
        makespan = sum(_dump_step(page, i, s)["makespan_s"] for s in range(STEPS)) / STEPS
        assert cell == f"{mean:.3f}" and mean == pytest.approx(makespan + 0.25)
    (title,) = [e for e in dom.find("h1") if e["attrs"].get("id") == "title"]
    assert title["text"].startswith(f"mixlen plan {page['tmp'] / DS}: N={RANKS}")
    # planning times: every policy, numbers, measured after the warm-up pass
    (timing,) = [e for e in dom.find("table") if e["attrs"].get("id") == "timing-table"]
    rows = [e for e in dom.find("tr", inside=timing) if e["attrs"].get("data-policy")]
    assert [r["attrs"]["data-policy"] for r in rows] == POLICIES
    for r in rows:
        vals = [e["text"] for e in dom.find("td", inside=r)][1:]
        assert all(float(v) >= 0 for v in vals[:4]) and vals[4] == str(STEPS)
    # the step selector lists every step and "all steps"; #step=1 shows step 1 only
    options = [e["text"] for e in dom.find("option")]
    assert options == [f"step {s}" for s in range(STEPS)] + ["all steps"]
    steps = dom.find("div", "step")
    assert [s["attrs"]["data-step"] for s in steps] == ["1"]
    # one timeline per policy; a rectangle per (rank, micro-batch) of the dump, ring iff grouped
    svgs = dom.find("svg", "timeline")
    assert [s["attrs"]["data-policy"] for s in svgs] == POLICIES
    n_offload = n_ring = 0
    for i, svg in enumerate(svgs):
        want = {}
        for r in _dump_step(page, i, 1)["ranks"]:
            for mb in r["microbatches"]:
                want[(r["rank"], mb["slot"])] = (len(mb["group"]), round(mb["offload_ratio"], 4))
        rects = dom.find("rect", "mb", inside=svg)
        got = {
            (int(e["attrs"]["data-rank"]), int(e["attrs"]["data-slot"])): (
                int(e["attrs"]["data-k"]),
                float(e["attrs"]["data-offload"]),
            )
            for e in rects
        }
        assert len(rects) == len(want) and got == want
        for e in rects:
            kind = "ring" if int(e["attrs"]["data-k"]) > 1 else "local"
            assert kind in e["attrs"]["class"].split()
        n_ring += sum(k > 1 for k, _ in want.values())
        # integer rank axis: 0..N-1, one label per rank
        assert [e["text"] for e in dom.find("text", "rank-label", inside=svg)] == [
            str(r) for r in range(RANKS)
        ]
        labels = [e["text"] for e in dom.find("text", "offload-label", inside=svg)]
        ratios = {round(r, 3) for _, r in want.values() if r > 0}
        assert all(float(t.removeprefix("r=")) in ratios for t in labels)
        n_offload += len(labels)
        assert len(dom.find("rect", "idle", inside=svg)) == RANKS
    assert n_ring > 0 and n_offload > 0, "the scenario has ring groups and offloaded micro-batches"
    # the histogram: samples per power-of-two bin, against a plain count of the index's lengths
    bars = dom.find("rect", "bar")
    ref: dict[int, int] = {}
    for n in page["lengths"]:
        lo = 1 << (int(n).bit_length() - 1)
        ref[lo] = ref.get(lo, 0) + 1
    got = {int(b["attrs"]["data-lo"]): int(b["attrs"]["data-count"]) for b in bars}
    assert {k: v for k, v in got.items() if v} == ref
    assert sorted(got) == [
        1 << i for i in range(int(math.log2(min(ref))), int(math.log2(max(ref))) + 1)
    ]
    # all steps at once
    every = _dom(page, "#step=all")
    assert [s["attrs"]["data-step"] for s in every.find("div", "step")] == [
        str(s) for s in range(STEPS)
    ]
    assert len(every.find("svg", "timeline")) == STEPS * len(POLICIES)


@needs_chromium
def test_screenshot(page: dict) -> None:
    png = page["tmp"] / "plan.png"
    url = page["html"].resolve().as_uri() + "#step=1"
    run_chromium(url, str(page["tmp"] / "profile2"), f"--screenshot={png}", "--window-size=1280,1500",
                 "--virtual-time-budget=2000")  # fmt: skip
    data = Path(png).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert (width, height) == (1280, 1500)
    assert len(data) > 20_000, "a drawn page, not a blank window"


def _page_data(page: dict) -> dict:
    text = page["html"].read_text()
    return json.loads(text.split('id="plan-data">')[1].split("</script>")[0])


def test_page_speedups_over_static(page: dict) -> None:
    """The speedup over static is static's mean step time over the policy's (from the dump)."""
    data = _page_data(page)

    def mean_step(i: int) -> float:
        return sum(_dump_step(page, i, s)["est_step_time_s"] for s in range(STEPS)) / STEPS

    want = [[p, mean_step(0) / mean_step(i)] for i, p in enumerate(POLICIES) if p.startswith("hdp")]
    assert [p for p, _ in data["speedups"]] == [p for p, _ in want]
    for (_, got), (_, ref) in zip(data["speedups"], want):
        assert got == pytest.approx(ref, rel=1e-9)


@needs_chromium
def test_idle_labels_are_the_time_a_rank_is_not_busy(page: dict) -> None:
    """Each rank's "idle N%" label: 100 * (1 - its micro-batches' durations / makespan), from the
    page's own timeline data, summed here per rank."""
    data = _page_data(page)
    dom = _dom(page, "#step=1")
    svgs = dom.find("svg", "timeline")
    for tl, svg in zip(data["steps"][1]["plans"], svgs):
        busy = [0.0] * tl["drawn_ranks"]
        for m, dur in enumerate(tl["dur"]):
            lo, hi = tl["group_offsets"][m], tl["group_offsets"][m + 1]
            for r in tl["group_ranks"][lo:hi]:
                busy[r] += dur
        want = [f"idle {100 * max(1 - b / tl['makespan'], 0):.0f}%" for b in busy]
        assert [e["text"] for e in dom.find("text", "idle-label", inside=svg)] == want


def test_timings_and_byte_sizes_as_shown() -> None:
    """Planning times: mean, min and max of the timed steps; comm bytes in SI units."""
    from tools.report import _fmt_bytes
    from tools.report_html import Timings

    got = Timings(7.5, [3.0, 9.0, 2.0, 4.0]).to_dict()
    assert got == {"warmup_ms": 7.5, "mean_ms": 4.5, "min_ms": 2.0, "max_ms": 9.0, "steps": 4}
    sizes = {0: "0 B", 999: "999 B", 1000: "1.0 KB", 1010: "1.0 KB", 1500: "1.5 KB",
             2_500_000: "2.5 MB", 3e12: "3.0 TB", 4e18: "4000.0 PB"}  # fmt: skip
    assert {b: _fmt_bytes(b) for b in sizes} == sizes


def test_json_tokens_per_step_is_the_planned_steps_mean(page: dict, capsys) -> None:
    """`--json`'s tokens_per_step: the mean over the planned steps of their tokens, summed here
    from the dump's samples of the same run."""
    assert cli_main([*page["args"][:-4], "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    steps = [_dump_step(page, 0, s)["samples"] for s in range(STEPS)]
    assert out["tokens_per_step"] == sum(n for step in steps for _, n in step) / STEPS
