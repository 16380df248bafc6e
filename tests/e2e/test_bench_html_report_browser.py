"""The bench HTML report as a browser lays it out: headless Chromium renders a sweep's report (four
runs with SLO targets, a cost basis and the engine config, through bench's own metrics and result
code) and a script on the page records what it measured into the DOM, which --dump-dom hands back.
At 1,300 px nothing widens the page, every figure loads and fits; at 700 px the run table scrolls
inside its own box while the page still does not overflow.

Chromium is a system package (CI's .ci/run installs it): without it the test skips, except under CI,
where a missing browser is a failure, not a silent skip."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from goodserve.bench import report
from goodserve.bench.metrics import GpuCost, attainment_by_slo_scale, compute_metrics
from goodserve.bench.records import RequestRecord
from goodserve.bench.result import build_result

SLOS = {"ttft": 500.0, "tpot": 50.0}
ENGINE = {"model": "smollm2-135m", "dtype": "bfloat16", "max_num_seqs": 256, "max_model_len": 2048,
          "kv_cache_dtype": "auto", "quantization": None, "enable_prefix_caching": True,
          "tensor_parallel_size": 1, "scheduler_policy": "slo", "attention_backend": "triton"}
# Records each table's, its box's and each image's extent once everything (the PNGs too) has loaded.
MEASURE = """<script>addEventListener("load", () => {
  const box = e => { const r = e.getBoundingClientRect();
    return {left: r.left, right: r.right, top: r.top, width: r.width, scroll: e.scrollWidth, client: e.clientWidth}; };
  document.body.dataset.layout = JSON.stringify({
    viewport: document.documentElement.clientWidth, page: document.documentElement.scrollWidth,
    tables: [...document.querySelectorAll("table")].map(t => ({table: box(t), box: box(t.parentElement)})),
    images: [...document.images].map(i => ({...box(i), natural: i.naturalWidth, complete: i.complete}))});
});</script>"""


def browser() -> str:
    path = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: .ci/run installs it before the suite")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return path


def sweep_run(rate: float) -> dict:
    """A run at `rate`: TTFT and TPOT grow with the load, so the runs and their plots differ."""
    records = []
    for i in range(20):
        ttft, tpot, sent = 0.1 * rate * (1 + i / 10), 0.01 * rate, i / rate
        chunks = [sent + ttft + k * tpot for k in range(16)]
        records.append(RequestRecord(index=i, prompt_len=128, expected_output_len=16, send_time=sent,
                                     first_token_time=chunks[0], chunk_times=chunks, end_time=chunks[-1],
                                     output_len=16, output_len_source="usage", success=True))
    metrics = compute_metrics(records, slos=SLOS, cost=GpuCost(2.5, 2))
    metrics["slo_scale_sweep"] = attainment_by_slo_scale(records, SLOS, [0.5, 1.0, 2.0, 4.0])
    return build_result({"request_rate": rate, "max_concurrency": None, "engine_config": ENGINE}, metrics, records)


class LayoutOf(HTMLParser):
    """The data-layout attribute the script wrote on <body>."""

    def __init__(self):
        super().__init__()
        self.layout = None

    def handle_starttag(self, tag, attrs):
        if tag == "body" and dict(attrs).get("data-layout"):
            self.layout = json.loads(dict(attrs)["data-layout"])


def layout(chromium: str, page, width: int, tmp_path) -> dict:
    measured = tmp_path / f"measured_{width}.html"
    measured.write_text(page.read_text().replace("</body>", MEASURE + "</body>"))
    dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={width},900",
                          "--virtual-time-budget=10000", "--dump-dom", measured.as_uri()],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    parser = LayoutOf()
    parser.feed(dom)
    assert parser.layout is not None, f"the page's script did not run: {dom[:500]}"
    return parser.layout


def test_the_report_fits_a_1300_px_window_and_its_table_scrolls_in_a_narrow_one(tmp_path):
    chromium = browser()
    page = tmp_path / "report.html"
    report.write_html({"model_id": "smollm2-135m", "backend": "openai", "base_url": "http://127.0.0.1:8000",
                       "engine_config": ENGINE, "sweep": [sweep_run(r) for r in (1.0, 2.0, 4.0, 8.0)]}, page)

    wide = layout(chromium, page, 1300, tmp_path)
    assert wide["viewport"] == 1300 and wide["page"] <= wide["viewport"]
    (table,) = wide["tables"]
    assert table["table"]["right"] <= table["box"]["right"] <= wide["viewport"]  # the whole table shows
    assert len(wide["images"]) == 6
    for image in wide["images"]:
        assert image["complete"] and image["natural"] > 0  # the PNG decoded
        assert 0 <= image["left"] and image["right"] <= wide["viewport"]
        assert image["width"] >= 0.8 * image["natural"]  # side by side, yet not shrunk out of reading
    tops = [image["top"] for image in wide["images"]]
    assert tops[0::2] == tops[1::2]  # two figures a row: the page is half as long

    narrow = layout(chromium, page, 700, tmp_path)
    assert narrow["page"] <= narrow["viewport"] == 700
    (table,) = narrow["tables"]
    assert table["box"]["right"] <= narrow["viewport"] and table["box"]["scroll"] > table["box"]["client"]
    assert all(image["right"] <= narrow["viewport"] for image in narrow["images"])
