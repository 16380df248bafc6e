"""`goodserve generate`: stream one completion to the terminal."""

from __future__ import annotations

import argparse
import sys
import time

from goodserve.engine_args import add_engine_arguments
from goodserve.sampling_params import SamplingParams


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text from a prompt, streamed to the terminal",
        description="Generate text offline (no server) and stream it to the terminal.",
    )
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    add_engine_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)  # --seed: the engine's
    from goodserve.engine.frontend.engine import Engine  # torch loads only when a command needs it
    from goodserve.engine.frontend.preflight import checked_engine_config

    engine = Engine(checked_engine_config(args))
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        prompt = engine.tokenizer.encode(prompt, add_special_tokens=False)
    start = time.perf_counter()
    engine.add_request("cli", prompt, params)
    printed, num_tokens, first_token_at = 0, 0, None
    while engine.has_unfinished():
        for output in engine.step():
            text = output.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
            num_tokens = len(output.outputs[0].token_ids)
            if num_tokens and first_token_at is None:
                first_token_at = time.perf_counter()
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(summary_line(num_tokens, start, first_token_at, time.perf_counter()), file=sys.stderr)
    return 0


def summary_line(num_tokens: int, start: float, first_token_at: float | None, end: float) -> str:
    """Tokens, time to first token, and decode speed (tokens after the first over the time after it)."""
    if first_token_at is None:
        return f"0 tokens in {end - start:.2f} s"
    decode = f"{(num_tokens - 1) / (end - first_token_at):.1f} tok/s decode" if num_tokens > 1 else "no decode"
    return (f"{num_tokens} tokens, TTFT {1000 * (first_token_at - start):.0f} ms, {decode}, "
            f"{end - start:.2f} s total")
