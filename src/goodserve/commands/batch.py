"""`goodserve batch run INPUT OUTPUT`: an OpenAI batch input file answered by the in-process engine.

Each line runs through the server's own line runner (server/batch_lines.py: the online endpoints'
handlers, bounded concurrency); every answer, success or error, is appended to OUTPUT as it
finishes, in OpenAI's output-line shape. Run again with the same OUTPUT, it resumes: lines whose
custom_id (or, for a line with none, whose line number) OUTPUT already holds are skipped, and a
line cut short by a kill is dropped first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from goodserve.console import stage_progress
from goodserve.errors import InvalidRequestError
from goodserve.engine_args import add_engine_arguments


def register(subparsers) -> None:
    parser = subparsers.add_parser("batch", help="run an OpenAI batch file offline",
                                   description="Batch jobs without a server.")
    actions = parser.add_subparsers(dest="batch_command", metavar="ACTION", required=True)
    run_parser = actions.add_parser(
        "run", help="answer every line of an OpenAI batch input file (JSONL) with the in-process engine",
        description="Answer each line ({custom_id, method, url, body}; url /v1/chat/completions, /v1/completions "
                    "or /v1/embeddings) as the server would, appending OpenAI output lines to OUTPUT. "
                    "Run again to resume.")
    run_parser.add_argument("input", type=Path, help="the batch input file (JSONL)")
    run_parser.add_argument("output", type=Path, help="where answers are appended (JSONL); read first to resume")
    run_parser.add_argument("--max-concurrency", type=int, default=64, help="most lines in the engine at once")
    run_parser.add_argument("--served-model-name", default=None,
                            help="the model name lines may give in their body (default: the --model value)")
    add_engine_arguments(run_parser)
    run_parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from goodserve.engine.frontend.async_engine import AsyncEngine  # torch loads only when a command needs it
    from goodserve.engine.frontend.preflight import check_input_file, check_output_file, checked_engine_config
    from goodserve.server.batch_lines import ENDPOINTS, parse_lines

    if args.max_concurrency < 1:
        raise InvalidRequestError("--max-concurrency must be at least 1")
    check_input_file(args.input, "batch input file")
    check_output_file(args.output, "output file")
    lines = parse_lines(args.input.read_bytes(), ENDPOINTS)  # malformed lines are answered as errors
    engine = AsyncEngine(checked_engine_config(args))
    succeeded, failed = asyncio.run(run_file(engine, lines, args.output, args.max_concurrency,
                                             args.served_model_name or engine.config.model))
    print(f"{succeeded} lines succeeded, {failed} failed: {args.output}", file=sys.stderr)
    return 0


async def run_file(engine, lines: list, output_path: Path, max_concurrency: int,
                   model_name: str) -> tuple[int, int]:
    """Answer the lines OUTPUT lacks; (succeeded, failed) among those answered now."""
    from goodserve.engine.frontend.admission import Admission
    from goodserve.server.batch_lines import LineResult, run_lines
    from goodserve.server.metrics import ServerMetrics, Slo
    from goodserve.server.serving import ServingContext

    answered_ids, answered_lines = _answered(output_path)
    pending = [line for line in lines
               if line.custom_id not in answered_ids and line.number not in answered_lines]
    metrics = ServerMetrics(engine, model_name, Slo())
    ctx = ServingContext(engine, model_name, Admission(max_waiting=max(1024, max_concurrency)), metrics)
    counts = {True: 0, False: 0}
    await engine.start()
    try:
        with stage_progress("batch") as progress, open(output_path, "a") as out:
            done = len(lines) - len(pending)
            progress("lines", done, len(lines))

            async def record(result: LineResult) -> None:
                nonlocal done
                out.write(json.dumps(result.record) + "\n")
                out.flush()  # a kill loses at most the line being written, which resume drops
                counts[result.ok] += 1
                done += 1
                progress("lines", done, len(lines))

            await run_lines(ctx, pending, max_concurrency, record)
    finally:
        await engine.shutdown(0)
        ctx.close()
    return counts[True], counts[False]


def _answered(output_path: Path) -> tuple[set[str], set[int]]:
    """The custom_ids, and the line numbers of id-less error lines, OUTPUT already answers. A last
    line without its newline (the writer was killed mid-line) is cut off."""
    if not output_path.exists():
        return set(), set()
    data = output_path.read_bytes()
    complete = data[:data.rfind(b"\n") + 1]
    if len(complete) < len(data):
        with open(output_path, "r+b") as f:
            f.truncate(len(complete))
    ids, numbers = set(), set()
    for raw in complete.splitlines():
        record = json.loads(raw)
        if record.get("custom_id") is not None:
            ids.add(record["custom_id"])
        else:
            numbers.add((record.get("error") or {}).get("line"))
    return ids, numbers
