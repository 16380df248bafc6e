"""Reports of a bench result: a terminal table, per-request CSV, and an HTML page with plots."""

from __future__ import annotations

import base64
import csv
import io
from pathlib import Path

import jinja2
import numpy as np
from rich.console import Console
from rich.table import Table

from goodserve.bench.result import records_of, runs_of
from goodserve.console import make_console

# (label, key, format) rows of the terminal table, in vLLM's order.
_SUMMARY_ROWS = [
    ("Successful requests", "completed", "{:d}"),
    ("Failed requests", "failed", "{:d}"),
    ("Benchmark duration (s)", "duration", "{:.2f}"),
    ("Total input tokens", "total_input_tokens", "{:d}"),
    ("Total generated tokens", "total_output_tokens", "{:d}"),
    ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
    ("Input token throughput (tok/s)", "input_throughput", "{:.2f}"),
    ("Output token throughput (tok/s)", "output_throughput", "{:.2f}"),
    ("Total token throughput (tok/s)", "total_token_throughput", "{:.2f}"),
    ("Goodput: good requests/s at this load", "request_goodput", "{:.2f}"),
    ("Goodput: SLO attainment (%)", "slo_attainment", "{:.1f}"),
    ("$ per 1M input tokens", "cost_per_1m_input_tokens", "{:.4f}"),
    ("$ per 1M output tokens", "cost_per_1m_output_tokens", "{:.4f}"),
    ("$ per request", "cost_per_request", "{:.6f}"),
    # Speculative decoding (bench/spec_decode.py): what prompt lookup would predict, for any server;
    # what speculation did, where the server's /metrics has its counters.
    ("Prompt-lookup overlap (output words predicted)", "prompt_lookup_overlap", "{:.3f}"),
    ("Speculative drafts (verifications)", "spec_decode_num_drafts", "{:d}"),
    ("Draft tokens", "spec_decode_draft_tokens", "{:d}"),
    ("Accepted draft tokens", "spec_decode_accepted_tokens", "{:d}"),
    ("Draft acceptance rate (%)", "spec_decode_acceptance_rate", "{:.1f}"),
    ("Mean acceptance length (tokens/verification)", "spec_decode_acceptance_length", "{:.2f}"),
]
_LATENCY_NAMES = {"ttft": "Time to first token", "tpot": "Time per output token (excl. 1st)",
                  "itl": "Inter-token latency", "e2el": "End-to-end latency"}


def _fmt(fmt: str, value) -> str:
    if value is None:
        return "-"
    return fmt.format(int(value) if fmt == "{:d}" else value)


def latency_keys(run: dict, name: str) -> list[tuple[str, str]]:
    """(label, key) for every statistic of one latency metric present in the run."""
    suffix = f"_{name}_ms"
    return [(key[: -len(suffix)], key) for key in run if key.endswith(suffix)]


def summary_table(run: dict, title: str = "goodserve bench") -> Table:
    table = Table(title=title, show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, key, fmt in _SUMMARY_ROWS:
        if key in run:
            table.add_row(label, _fmt(fmt, run[key]))
    for name, label in _LATENCY_NAMES.items():
        keys = latency_keys(run, name)
        if keys:
            table.add_section()
            table.add_row(f"[bold]{label}[/bold]", "")
            for stat, key in keys:
                table.add_row(f"  {stat} (ms)", f"{run[key]:.2f}")
    return table


def sweep_table(runs: list[dict]) -> Table:
    table = Table(title="goodserve bench sweep (latencies in ms)")
    columns = [("rate", "request_rate"), ("conc", "max_concurrency"),
               ("req/s", "request_throughput"), ("tok/s", "output_throughput"),
               ("TTFT p50", "median_ttft_ms"), ("TTFT p99", "p99_ttft_ms"),
               ("TPOT p50", "median_tpot_ms"), ("TPOT p99", "p99_tpot_ms"),
               ("good req/s", "request_goodput"), ("SLO %", "slo_attainment"), ("failed", "failed")]
    if any("spec_decode_acceptance_rate" in run for run in runs):
        columns += [("accept %", "spec_decode_acceptance_rate"), ("accept len", "spec_decode_acceptance_length")]
    for label, _ in columns:
        table.add_column(label, justify="right")
    for run in runs:
        table.add_row(*(cell(run.get(key)) for _, key in columns))
    return table


def cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, list):  # per-position acceptance rates
        return " ".join(cell(v) for v in value)
    return str(value)


def print_report(result: dict, console: Console | None = None) -> None:
    console = console or make_console()
    runs = runs_of(result)
    if len(runs) == 1:
        console.print(summary_table(runs[0]))
    else:
        console.print(sweep_table(runs))
    for run in runs:
        if run.get("spec_decode_per_position_acceptance_rates"):
            rates = ", ".join(f"{rate:.3f}" for rate in run["spec_decode_per_position_acceptance_rates"])
            console.print(f"Per-position acceptance rate ({_run_label(run)}): {rates}")
        if "slo_scale_sweep" in run:
            cells = ", ".join(f"x{p['scale']:g}: {p['slo_attainment']:.1f}%" for p in run["slo_scale_sweep"])
            console.print(f"SLO attainment vs SLO scale ({_run_label(run)}): {cells}")
    if "capacity" in result:
        cap = result["capacity"]
        console.print(f"Goodput capacity (highest Poisson rate held, else sustained, with SLO attainment >= "
                      f"{cap['target_attainment'] * 100:.0f}%): [bold]{cap['rate']:.3f} req/s[/bold]")
        for warning in cap.get("warnings", []):
            console.print(f"[yellow]noisy probe: {warning}[/yellow]")


_CSV_FIELDS = ["run", "index", "success", "error", "prompt_len", "output_len", "output_len_source",
               "cached_tokens", "send_time", "ttft", "tpot", "e2el", "num_chunks"]


def write_csv(result: dict, path: Path) -> None:
    """One row per request, all runs of a sweep included."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=_CSV_FIELDS)
        writer.writeheader()
        for run_index, run in enumerate(runs_of(result)):
            for r in records_of(run):
                writer.writerow({"run": run_index, "index": r.index, "success": r.success,
                                 "error": r.error, "prompt_len": r.prompt_len,
                                 "output_len": r.output_len, "output_len_source": r.output_len_source,
                                 "cached_tokens": r.cached_tokens, "send_time": r.send_time,
                                 "ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2e,
                                 "num_chunks": len(r.chunk_times)})


def figure_png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _cdf_plot(runs: list[dict], metric: str, label: str) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        values = np.sort([getattr(r, metric) for r in records_of(run) if getattr(r, metric) is not None])
        if values.size:  # from 0 below the fastest request
            ax.step(np.r_[values[0], values] * 1000, np.arange(values.size + 1) / values.size, where="post",
                    label=_run_label(run))
    ax.set_xlabel(f"{label} (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)  # a CDF from 0: one latency for all requests is a step from 0 to 1, not a line at 1
    ax.set_title(f"{label} CDF")
    ax.grid(alpha=0.3)
    if len(runs) > 1:
        ax.legend(fontsize=7)
    return figure_png(fig)


def _run_label(run: dict) -> str:
    rate, conc = run.get("request_rate"), run.get("max_concurrency")
    return f"rate {rate}" + (f", conc {conc}" if conc else "")


def _sweep_plots(runs: list[dict]) -> list[tuple[str, str]]:
    import matplotlib.pyplot as plt

    plots = []
    fig, ax = plt.subplots(figsize=(6, 4))
    throughput = [run["output_throughput"] for run in runs]
    for key, label in [("median_ttft_ms", "p50 TTFT"), ("p99_ttft_ms", "p99 TTFT"),
                       ("median_tpot_ms", "p50 TPOT"), ("p99_tpot_ms", "p99 TPOT")]:
        if all(key in run for run in runs):
            ax.plot(throughput, [run[key] for run in runs], marker="o", label=label)
    ax.set_xlabel("output throughput (tok/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.set_title("Latency vs throughput")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    plots.append(("Latency vs throughput", figure_png(fig)))
    if all("slo_attainment" in run for run in runs):
        rates = [run["request_throughput"] for run in runs]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(rates, [run["request_goodput"] for run in runs], marker="o", label="goodput (req/s)")
        ax.plot(rates, rates, linestyle=":", color="grey", label="throughput = goodput")
        ax2 = ax.twinx()
        ax2.plot(rates, [run["slo_attainment"] for run in runs], marker="s", color="tab:red",
                 label="SLO attainment %")
        ax2.set_ylabel("SLO attainment (%)")
        ax2.set_ylim(0, 102)  # a percentage: 0 sits at the bottom, not mid-axis
        ax.set_xlabel("achieved request rate (req/s)")
        ax.set_ylabel("goodput (req/s)")
        ax.set_ylim(bottom=0)  # no negative goodput: a run that met no SLO sits on the axis
        ax.set_title("Goodput vs rate")
        ax.legend(loc="upper left", fontsize=8)
        ax2.legend(loc="lower right", fontsize=8)
        plots.append(("Goodput vs rate", figure_png(fig)))
    return plots


def _attainment_plots(runs: list[dict]) -> list[tuple[str, str]]:
    """DistServe's two curves: SLO attainment vs request rate (a sweep's runs) and vs SLO scale."""
    import matplotlib.pyplot as plt

    plots = []
    if len(runs) > 1 and all("slo_attainment" in run for run in runs):
        fig, ax = plt.subplots(figsize=(6, 4))
        rates = [run["request_rate"] if _finite(run.get("request_rate")) else run["request_throughput"]
                 for run in runs]
        ax.plot(rates, [run["slo_attainment"] for run in runs], marker="o")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(0, 102)
        ax.set_title("SLO attainment vs request rate")
        ax.grid(alpha=0.3)
        plots.append(("SLO attainment vs request rate", figure_png(fig)))
    scaled = [run for run in runs if "slo_scale_sweep" in run]
    if scaled:
        fig, ax = plt.subplots(figsize=(6, 4))
        for run in scaled:
            points = run["slo_scale_sweep"]
            ax.plot([p["scale"] for p in points], [p["slo_attainment"] for p in points], marker="o",
                    label=_run_label(run))
        ax.set_xlabel("SLO scale (x the --goodput targets)")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(0, 102)
        ax.set_title("SLO attainment vs SLO scale")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        plots.append(("SLO attainment vs SLO scale", figure_png(fig)))
    return plots


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and np.isfinite(value)


_HTML = jinja2.Template("""<!doctype html>
<html><head><meta charset="utf-8"><title>goodserve bench: {{ title }}</title>
<style>body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse}
.scroll{overflow-x:auto;max-width:100%}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}
th{white-space:normal;max-width:7em;font-size:90%}dl{display:grid;grid-template-columns:max-content auto;gap:2px 1em}
dt{font-weight:bold}.plots{display:flex;flex-wrap:wrap;gap:1em;margin-top:1.5em}
figure{margin:0;flex:1 1 560px;max-width:100%}img{max-width:100%}</style></head>
<body><h1>goodserve bench</h1><p>{{ title }}</p>
<dl>{% for name, value in settings %}<dt>{{ name }}</dt><dd>{{ value }}</dd>{% endfor %}</dl>
<div class="scroll"><table><tr><th>run</th>{% for key, label in columns %}<th title="{{ key }}">{{ label }}</th>{% endfor %}</tr>
{% for run in runs %}<tr><td>{{ loop.index0 }}</td>{% for key, label in columns %}<td>{{ fmt(run.get(key)) }}</td>{% endfor %}</tr>
{% endfor %}</table></div>
<div class="plots">{% for name, png in plots %}
<figure><img alt="{{ name }}" src="data:image/png;base64,{{ png }}"></figure>
{% endfor %}</div></body></html>
""", autoescape=True)

# Result keys the run table shows, and their headers (the key itself is each header's tooltip).
_HTML_COLUMNS = {"request_rate": "rate (req/s)", "max_concurrency": "concurrency", "completed": "done",
                 "failed": "failed", "request_throughput": "req/s", "output_throughput": "output tok/s",
                 "median_ttft_ms": "TTFT p50 (ms)", "p99_ttft_ms": "TTFT p99 (ms)",
                 "median_tpot_ms": "TPOT p50 (ms)", "p99_tpot_ms": "TPOT p99 (ms)",
                 "median_itl_ms": "ITL p50 (ms)", "p99_itl_ms": "ITL p99 (ms)",
                 "request_goodput": "goodput (req/s)", "slo_attainment": "SLO met (%)",
                 "cost_per_1m_output_tokens": "$ / 1M output tok", "cost_per_1m_total_tokens": "$ / 1M tok",
                 "spec_decode_acceptance_rate": "draft acceptance (%)",
                 "spec_decode_acceptance_length": "acceptance length"}


def _settings(result: dict, runs: list[dict]) -> list[tuple[str, str]]:
    """What the runs were held to and ran on: the SLO targets, the cost basis, the engine."""
    first = runs[0] if runs else {}
    slos = first.get("goodput_slos_ms")
    rows = [("SLO targets", ", ".join(f"{name} {ms:g} ms" for name, ms in slos.items()) if slos else "none given")]
    if first.get("gpu_hourly_cost") is not None:
        rows.append(("cost basis", f"${first['gpu_hourly_cost']:g} per GPU-hour x {first.get('num_gpus', 1)} GPUs"))
    engine = result.get("engine_config") or first.get("engine_config")
    rows.append(("engine", ", ".join(f"{k}={v}" for k, v in engine.items()) if engine else "not reported"))
    return rows


def write_html(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    runs = runs_of(result)
    plots = [("TTFT CDF", _cdf_plot(runs, "ttft", "TTFT")), ("TPOT CDF", _cdf_plot(runs, "tpot", "TPOT"))]
    if len(runs) > 1:
        plots += _sweep_plots(runs)
    plots += _attainment_plots(runs)
    title = f"{result.get('model_id', '')} on {result.get('base_url') or result.get('backend', '')}"
    columns = [(key, label) for key, label in _HTML_COLUMNS.items() if any(run.get(key) is not None for run in runs)]
    path.write_text(_HTML.render(title=title, runs=runs, columns=columns, plots=plots, fmt=cell,
                                 settings=_settings(result, runs)))
