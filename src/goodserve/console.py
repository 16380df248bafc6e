"""Terminal output for the commands: rich where a person watches, full text where output is piped.

Rich lays a table out for 80 columns when stdout is not a terminal, folding or cutting cells
with an ellipsis, so `goodserve bench ... > run.txt` lost numbers. Off a terminal the console is
as wide as any line needs; tables are never expanded to that width, only spared from cutting.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

PIPED_WIDTH = 1000


def make_console(stderr: bool = False) -> Console:
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=PIPED_WIDTH)


@contextlib.contextmanager
def stage_progress(command: str) -> Iterator[Callable[[str, int, int], None]]:
    """Yields hook(stage, done, total): a bar per stage on a terminal's stderr, else one plain line
    per update, so a log still shows a long command moving."""
    console = make_console(stderr=True)
    if not console.is_terminal:
        start = time.perf_counter()

        def line(stage: str, done: int, total: int) -> None:
            print(f"{command}: {stage} {done}/{total} ({time.perf_counter() - start:.0f} s)", file=sys.stderr,
                  flush=True)

        yield line
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        tasks: dict[str, int] = {}

        def bar(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = progress.add_task(stage, total=total)
            progress.update(tasks[stage], completed=done, total=total)

        yield bar
