"""The HTML report: the run table scrolls inside its box with short headers instead of overflowing
the page, the attainment axis runs 0-100% whatever the values, the CDFs rise from 0, goodput never
goes below 0, and the SLO targets, the cost basis and the engine the runs measured are on the page.
Read back with the standard library's HTML parser; the figures are inspected before they are
rendered to PNG. tests/e2e/test_bench_html_report_browser.py lays the page out in a browser."""

from __future__ import annotations

from html.parser import HTMLParser

from goodserve.bench import report
from goodserve.bench.metrics import GpuCost, compute_metrics
from goodserve.bench.records import RequestRecord
from goodserve.bench.result import build_result


def run(rate: float) -> dict:
    records = [RequestRecord(index=i, prompt_len=10, expected_output_len=4, send_time=float(i),
                             first_token_time=i + 2.0, chunk_times=[i + 2.0, i + 2.1, i + 2.2, i + 2.3],
                             end_time=i + 2.3, output_len=4, output_len_source="usage", success=True)
               for i in range(4)]
    metrics = compute_metrics(records, slos={"ttft": 100.0}, cost=GpuCost(2.5, 2))  # every TTFT 2 s: none met
    return build_result({"request_rate": rate, "max_concurrency": None}, metrics, records)


class Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.open: list[tuple[str, dict]] = []
        self.headers: list[str] = []
        self.table_in_scroll = False
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self.table_in_scroll = any(t == "div" and a.get("class") == "scroll" for t, a in self.open)
        self.open.append((tag, attrs))

    def handle_endtag(self, tag):
        while self.open and self.open.pop()[0] != tag:
            pass

    def handle_data(self, data):
        if self.open and self.open[-1][0] == "th":
            self.headers.append(data)
        self.text.append(data)


def test_report_table_fits_and_names_targets_cost_and_engine(tmp_path, monkeypatch):
    axes = []
    render = report.figure_png
    monkeypatch.setattr(report, "figure_png", lambda fig: axes.extend(fig.axes) or render(fig))
    result = {"model_id": "m", "backend": "openai", "engine_config": {"model": "m", "dtype": "bfloat16"},
              "sweep": [run(1.0), run(2.0)]}
    report.write_html(result, tmp_path / "r.html")
    page = Page()
    page.feed((tmp_path / "r.html").read_text())
    text = " ".join(page.text)
    assert page.table_in_scroll and "overflow-x:auto" in (tmp_path / "r.html").read_text()
    assert max(len(h) for h in page.headers) <= 20 and "SLO met (%)" in page.headers
    assert "ttft 100 ms" in text and "$2.5 per GPU-hour x 2 GPUs" in text and "model=m, dtype=bfloat16" in text
    assert "$ / 1M tok" in page.headers
    attainment = [ax for ax in axes if "attainment" in ax.get_ylabel()]
    assert attainment and all(ax.get_ylim() == (0.0, 102.0) for ax in attainment)
    # Every TTFT is 2 s and no goodput: the CDFs still rise from 0, the goodput axis starts at 0.
    cdfs = [ax for ax in axes if ax.get_ylabel() == "fraction of requests"]
    assert len(cdfs) == 2 and all(ax.get_ylim()[0] == 0.0 for ax in cdfs)
    assert all(min(line.get_ydata()) == 0.0 for ax in cdfs for line in ax.get_lines())
    (goodput,) = [ax for ax in axes if ax.get_ylabel() == "goodput (req/s)"]
    assert goodput.get_ylim()[0] == 0.0
