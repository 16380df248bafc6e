"""`goodserve generate`: stream one completion to the terminal."""

from __future__ import annotations

import argparse
import sys

from goodserve.sampling_params import SamplingParams
from goodserve.server.engine_args import add_engine_arguments, engine_config_from_args


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
    from goodserve.engine.engine import Engine  # torch loads only when a command needs it

    engine = Engine(engine_config_from_args(args))
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        prompt = engine.tokenizer.encode(prompt, add_special_tokens=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)  # --seed: the engine's
    engine.add_request("cli", prompt, params)
    printed = 0
    while engine.has_unfinished():
        for output in engine.step():
            text = output.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    sys.stdout.write("\n")
    return 0
