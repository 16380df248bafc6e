"""What tune hands back: the ranked table, the winning `goodserve serve` command line and the
config file serve reads (--config), a JSON of every trial, and an HTML page with the trade-off
charts (goodput capacity against quality loss, and against cost), drawn as bench's report draws."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import jinja2
from rich.console import Console
from rich.table import Table

from goodserve.bench.capacity import MIN_HELD_FRACTION, held
from goodserve.bench.report import cell, figure_png
from goodserve.engine_args import dataclass_argv
from goodserve.tune.measure import engine_config
from goodserve.tune.search import Outcome, accepted, ranked

NEAR_CEILING = 0.8  # of the most an overloaded probe sustained, served at the targets: little room left


def serve_command(options: dict) -> str:
    return shlex.join(["goodserve", "serve", *dataclass_argv(engine_config(options))])


def _p90(trial: dict, name: str) -> float | None:
    return (trial.get("at_capacity") or {}).get(f"p90_{name}_ms")


def rows(outcome: Outcome) -> list[dict]:
    """One row a trial, ranked: accepted ones by capacity, then the rejected and failed."""
    return [{"rank": i + 1 if accepted(t) else None, "step": t["move"], "status": t.get("status", ""),
             "capacity_req_s": t.get("capacity"), "p90_ttft_ms": _p90(t, "ttft"), "p90_tpot_ms": _p90(t, "tpot"),
             "perplexity_increase": t["quality"].get("loss"), "cost_per_1m_tokens": t.get("cost_per_1m_tokens"),
             "why": t["why"], "note": t.get("error") or t["quality"].get("summary", "")}
            for i, t in enumerate(ranked(outcome.trials))]


def ranked_table(outcome: Outcome) -> Table:
    table = Table(title="goodserve tune: configurations by goodput capacity")
    for column in ("#", "step", "status", "capacity req/s", "p90 TTFT ms", "p90 TPOT ms", "ppl +%", "$/1M tok"):
        table.add_column(column, justify="left" if column in ("step", "status") else "right")
    for row in rows(outcome):
        loss = row["perplexity_increase"]
        table.add_row(cell(row["rank"]), row["step"], row["status"], cell(row["capacity_req_s"]),
                      cell(row["p90_ttft_ms"]), cell(row["p90_tpot_ms"]),
                      "-" if loss is None else f"{100 * loss:+.2f}", cell(row["cost_per_1m_tokens"]))
    return table


def print_outcome(outcome: Outcome, console: Console, quality_note: str | None) -> None:
    console.print(ranked_table(outcome))
    if quality_note:
        console.print(f"[yellow]{quality_note}[/yellow]")
    start, best = outcome.trials[0], outcome.best
    console.print(f"stopped: {outcome.stop_reason}")
    if start["capacity"] > 0:
        versus = f", {best['capacity'] / start['capacity']:.2f}x the starting configuration"
    else:
        versus = " (the starting configuration met the targets at no rate tried)"
    if best is start:
        versus += "; no step raised the goodput capacity: the start is the best measured"
    console.print(f"best: {best['move']} at {best['capacity']:.3g} req/s{versus}")
    if headroom := headroom_note(start):
        console.print(headroom)
    if best is not start and (headroom := headroom_note(best, start["capacity"])):
        console.print(headroom)
    console.print(f"serve it: [bold]{serve_command(best['options'])}[/bold]")


def headroom_note(trial: dict, start_capacity: float | None = None) -> str | None:
    """A trial's capacity at the targets beside the most its engine kept up with when a probe offered
    more than it could serve (the highest rate an overloaded probe sustained; the all-at-once probe is
    left out: its drain, the longest answers at a thinning batch, dominates it). Near that ceiling, no
    step that only reorders, admits or batches requests can raise the capacity much; only a faster
    step can. For a trial after the start (start_capacity given), the ceiling is also weighed against
    the start's capacity: the most scheduling steps on top of it could reach. None when no rated probe
    overloaded the engine."""
    overloaded = [p["sustained_request_rate"] for p in trial.get("probes", [])
                  if math.isfinite(p["request_rate"]) and not held(p)]
    capacity = trial.get("capacity")
    if not overloaded or not capacity:
        return None
    ceiling = max(overloaded)
    share = capacity / ceiling
    who = "the starting configuration" if start_capacity is None else trial["move"]
    versus_start = f" ({ceiling / start_capacity:.2f}x the starting configuration's capacity)" if start_capacity else ""
    note = f"headroom: overloaded, {who} kept up with {ceiling:.3g} req/s at most{versus_start}; "
    if share > 1:
        # A probe holds its rate from MIN_HELD_FRACTION of it, and each probe draws its own requests.
        note += (f"at the targets it serves {capacity:.3g} req/s, as much or more (a probe holds a rate it sustains "
                 f"{100 * MIN_HELD_FRACTION:.0f}% of, on requests of its own draw): it meets the targets at its ceiling")
    else:
        note += f"at the targets it serves {capacity:.3g} req/s, {100 * share:.0f}% of that"
    if share >= NEAR_CEILING:
        return note + (": steps that reorder, admit or batch requests have little room left; more capacity needs "
                       "a faster step (fewer bytes or FLOPs a token, more GPUs)")
    return note + ": the targets, not the engine's throughput, limit it; scheduling steps have room"


def write_outputs(outcome: Outcome, out_dir: Path, settings: dict) -> dict[str, Path]:
    paths = {"json": out_dir / "tune.json", "config": out_dir / "serve-config.json", "html": out_dir / "tune.html"}
    best = outcome.best
    paths["config"].write_text(json.dumps(best["options"], indent=2) + "\n")
    result = {"settings": settings, "stop_reason": outcome.stop_reason, "winner": best["options"],
              "serve_command": serve_command(best["options"]), "ranked": rows(outcome), "rounds": outcome.rounds,
              "skipped": outcome.skipped, "trials": outcome.trials}
    paths["json"].write_text(json.dumps(result, indent=2, default=str) + "\n")
    write_html(outcome, settings, paths["html"])
    return paths


def _tradeoff_plot(outcome: Outcome, x_key: str, x_label: str) -> str | None:
    import matplotlib.pyplot as plt

    points = [(row[x_key], row["capacity_req_s"] or 0.0, row["step"], row["status"]) for row in rows(outcome)
              if row[x_key] is not None]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for x, y, step, status in points:
        rejected = status.startswith("rejected")
        ax.scatter([x * 100 if x_key == "perplexity_increase" else x], [y], marker="x" if rejected else "o",
                   color="tab:red" if rejected else "tab:blue")
        ax.annotate(step, (x * 100 if x_key == "perplexity_increase" else x, y), fontsize=7,
                    textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel(x_label)
    ax.set_ylabel("goodput capacity (req/s; 0 = not timed)")
    ax.grid(alpha=0.3)
    return figure_png(fig)


_HTML = jinja2.Template("""<!doctype html>
<html><head><meta charset="utf-8"><title>goodserve tune: {{ title }}</title>
<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}td.l{text-align:left}img{margin:8px}</style></head>
<body><h1>goodserve tune</h1><p>{{ title }}</p><p>stopped: {{ stop }}</p>
<p>serve it: <code>{{ command }}</code></p>
<table><tr>{% for c in columns %}<th>{{ c }}</th>{% endfor %}</tr>
{% for row in rows %}<tr>{% for c in columns %}<td{% if c in ("step", "status", "why", "note") %} class="l"{% endif %}>
{{ fmt(row[c]) }}</td>{% endfor %}</tr>
{% endfor %}</table>
{% for name, png in plots %}<h2>{{ name }}</h2><img alt="{{ name }}" src="data:image/png;base64,{{ png }}">
{% endfor %}
<h2>rounds</h2><ul>{% for r in rounds %}<li>from {{ r["from"] }}: {{ r["bottleneck"] }}</li>{% endfor %}</ul>
<h2>steps skipped</h2><ul>{% for s in skipped %}<li>round {{ s["round"] }}: {{ s["step"] }}: {{ s["why"] }}</li>
{% endfor %}</ul></body></html>
""", autoescape=True)


def write_html(outcome: Outcome, settings: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    charts = [("goodput capacity against quality loss",
               _tradeoff_plot(outcome, "perplexity_increase", "perplexity increase over the unoptimized baseline (%)")),
              ("goodput capacity against cost", _tradeoff_plot(outcome, "cost_per_1m_tokens", "$ per 1M tokens"))]
    table = rows(outcome)
    title = (f"{settings['model']}, workload {settings['workload']}, TTFT <= {settings['slos_ms']['ttft']:g} ms, "
             f"TPOT <= {settings['slos_ms']['tpot']:g} ms")
    path.write_text(_HTML.render(title=title, stop=outcome.stop_reason, command=serve_command(outcome.best["options"]),
                                 columns=list(table[0]) if table else [], rows=table, fmt=_text,
                                 plots=[(name, png) for name, png in charts if png], rounds=outcome.rounds,
                                 skipped=outcome.skipped))


def _text(value) -> str:
    return value if isinstance(value, str) else cell(value)
