"""`vllm bench serve` command lines as they are: vLLM's backend names, its general length flags, its
flags for the request body and the result file, and a message naming what to use instead for each
flag whose vLLM meaning goodserve does not have."""

from __future__ import annotations

import argparse
import json

from goodserve.errors import InvalidRequestError

# vLLM's backends that speak OpenAI's /v1/completions (its ASYNC_REQUEST_FUNCS map them to the same
# request function as "openai"); "vllm-chat" is the chat endpoint's.
COMPLETIONS_BACKENDS = ("vllm", "lmdeploy", "scalellm", "sglang", "llama.cpp")
CHAT_BACKENDS = ("vllm-chat",)
REFUSED_BACKENDS = {
    "tgi": "TGI's own /generate_stream API",
    "tensorrt-llm": "Triton's TensorRT-LLM generate_stream API",
    "deepspeed-mii": "DeepSpeed-MII's non-streaming API",
    "openai-audio": "audio transcription",
    "openai-embeddings": "embeddings", "openai-embeddings-chat": "embeddings",
    "openai-embeddings-clip": "embeddings", "openai-embeddings-vlm2vec": "embeddings",
    "infinity-embeddings": "embeddings", "vllm-pooling": "pooling", "vllm-rerank": "reranking",
}

# vLLM flags without a goodserve meaning: flag -> what to use instead.
REFUSED_FLAGS = {
    "--ramp-up-strategy": "goodserve ramps by runs: --sweep-request-rates 1,2,4,8 (one run per rate), or "
                          "--goodput-capacity to search the highest rate that meets the --goodput targets",
    "--ramp-up-start-rps": "--sweep-request-rates", "--ramp-up-end-rps": "--sweep-request-rates",
    "--lora-modules": "goodserve serves no LoRA adapters: benchmark the merged model",
    "--lora-assignment": "goodserve serves no LoRA adapters: benchmark the merged model",
    "--profile": "goodserve has no profiler endpoint: `goodserve serve --step-trace FILE` records every step",
    "--use-beam-search": "goodserve does not implement beam search: use n or --temperature",
    "--plot-timeline": "--save-html FILE (the HTML report)",
    "--plot-dataset-stats": "--save-html FILE (the HTML report)",
    "--tokenizer-mode": "goodserve loads Hugging Face tokenizers: --tokenizer PATH",
    "--probe-request-rate": "a second `goodserve bench` at the probe rate beside the first",
    "--self-timed": "--dataset-name custom with --request-rate",
    "--no-oversample": "--num-prompts no larger than the file's requests",
}


class _Refused(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} (a `vllm bench serve` flag) has no meaning here; instead: "
                     f"{REFUSED_FLAGS[option_string]}")


def add_vllm_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM's flags (`vllm bench serve` command lines run as they are)")
    g.add_argument("--served-model-name", help="the model name sent in requests (default: --model, which then "
                                               "names the tokenizer only)")
    g.add_argument("--input-len", type=int, help="sets --random-input-len, as in vLLM")
    g.add_argument("--output-len", type=int,
                   help="sets every dataset's output length (--random-output-len, --sharegpt-output-len, "
                        "--custom-output-len, --hf-output-len, --prefix-repetition-output-len), as in vLLM")
    g.add_argument("--label", help="the result's label and its file name's prefix (default: --backend)")
    g.add_argument("--save-detailed", action="store_true",
                   help="with --save-result: the per-request arrays too (input_lens, output_lens, ttfts, itls, "
                        "start_times, generated_texts, errors), as vLLM writes them")
    g.add_argument("--append-result", action="store_true", help="append the result as a line to the file")
    g.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", help="written into the result JSON")
    g.add_argument("--header", nargs="*", metavar="KEY=VALUE", help="HTTP headers sent with every request")
    g.add_argument("--extra-body", type=json.loads, help="a JSON object merged into every request body")
    for name, kind in (("top-p", float), ("top-k", int), ("min-p", float), ("frequency-penalty", float),
                       ("presence-penalty", float), ("repetition-penalty", float)):
        g.add_argument(f"--{name}", type=kind, help=f"{name.replace('-', '_')} in every request")
    g.add_argument("--logprobs", type=int, help="logprobs per token in every request")
    g.add_argument("--ready-check-timeout-sec", type=int, default=0,
                   help="wait up to this long for the server to answer before the run (0: check once)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted: the tokenizers loaded here never run code from the model's files")
    for flag in REFUSED_FLAGS:
        g.add_argument(flag, action=_Refused)


def backend_of(name: str) -> str:
    """goodserve's backend for a vLLM backend name; a backend it cannot measure is refused by name."""
    if name in COMPLETIONS_BACKENDS:
        return "openai"
    if name in CHAT_BACKENDS:
        return "openai-chat"
    if name in REFUSED_BACKENDS:
        raise InvalidRequestError(
            f"--backend {name} measures {REFUSED_BACKENDS[name]}, which goodserve bench does not speak: use "
            f"--backend openai (/v1/completions) or openai-chat (/v1/chat/completions) against any "
            f"OpenAI-compatible server")
    return name


def apply_general_lengths(args: argparse.Namespace) -> None:
    """vLLM's --input-len / --output-len, mapped onto the datasets' own flags as vLLM maps them."""
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        for name in ("random_output_len", "sharegpt_output_len", "custom_output_len", "hf_output_len",
                     "prefix_repetition_output_len"):
            setattr(args, name, args.output_len)


def key_values(items: list[str] | None, flag: str) -> dict[str, str]:
    pairs = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InvalidRequestError(f"{flag} {item!r}: expected KEY=VALUE")
        pairs[key.strip()] = value.strip()
    return pairs


def sampling_body(args: argparse.Namespace) -> dict:
    """The request-body fields vLLM's sampling flags set (only those given), then --extra-body's."""
    fields = ("top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "logprobs")
    body = {name: getattr(args, name) for name in fields if getattr(args, name) is not None}
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        raise InvalidRequestError("--extra-body must be a JSON object")
    return {**body, **(args.extra_body or {})}
