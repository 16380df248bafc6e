"""`goodserve bench compare A.json B.json`: two results side by side, with B/A ratios."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from goodserve.bench.result import load_json, runs_of
from goodserve.console import make_console

# Metrics worth comparing, and whether a higher value is better (colours the ratio).
_HIGHER_IS_BETTER = {
    "completed": True, "failed": False, "duration": False,
    "request_throughput": True, "input_throughput": True, "output_throughput": True,
    "total_token_throughput": True, "request_goodput": True, "slo_attainment": True,
    "cost_per_1m_output_tokens": False, "cost_per_request": False,
    "spec_decode_acceptance_rate": True, "spec_decode_acceptance_length": True,
}


def comparable_keys(a: dict, b: dict) -> list[tuple[str, bool]]:
    keys = [(k, better) for k, better in _HIGHER_IS_BETTER.items() if k in a and k in b]
    latency = [k for k, v in a.items() if k.endswith("_ms") and isinstance(v, (int, float))
               and k in b and not k.startswith("std_")]
    return keys + [(k, False) for k in latency]


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not a:
        return None
    return b / a


def compare_table(a: dict, b: dict, name_a: str, name_b: str) -> Table:
    table = Table(title="goodserve bench compare")
    for column in ("metric", name_a, name_b, "B/A"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for key, higher_better in comparable_keys(a, b):
        r = ratio(a[key], b[key])
        if r is None:
            shown = "-"
        else:
            colour = "green" if (r > 1) == higher_better and r != 1 else ("red" if r != 1 else "")
            shown = f"[{colour}]{r:.3f}x[/{colour}]" if colour else f"{r:.3f}x"
        table.add_row(key, _num(a[key]), _num(b[key]), shown)
    return table


def _num(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def compare_files(path_a: str, path_b: str, console: Console | None = None) -> None:
    console = console or make_console()
    runs_a, runs_b = runs_of(load_json(path_a)), runs_of(load_json(path_b))
    if len(runs_a) != len(runs_b):
        console.print(f"[yellow]{path_a} has {len(runs_a)} runs and {path_b} has {len(runs_b)}; "
                      f"comparing the first {min(len(runs_a), len(runs_b))} in order[/yellow]")
    for a, b in zip(runs_a, runs_b):
        console.print(compare_table(a, b, f"A: {path_a}", f"B: {path_b}"))
