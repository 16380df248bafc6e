"""What vLLM resolved at its defaults: its config's scheduler limits, compilation, CUDA graphs,
attention backend and cache, and the lines of its log that name them (each release words them a
little differently, and some, the attention backend among them, only its log says for sure).

The server's own config is rebuilt as `vllm serve` builds it (its engine arguments, the OpenAI
server's usage context, which sets its scheduler defaults apart from the offline LLM's) in a process
of its own, after the server has gone: building it reads the card and allocates nothing.

Every vLLM import is inside a function: this module imports without vLLM.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

# vLLM's startup lines that say what it resolved.
_SETTING_LINE = re.compile(
    r"non-default args|Initializing a V1 LLM engine|max_num_batched_tokens|max_num_seqs|backend|"
    r"cudagraph|CUDA graph|KV cache|Maximum concurrency|[Cc]hunked prefill|torch.compile|prefix caching")


def settings_log(text: str, limit: int = 40, line_chars: int = 4000) -> list[str]:
    """The lines of a vLLM log that name a resolved setting (its engine-config line is long)."""
    return [line[:line_chars] for line in text.splitlines() if _SETTING_LINE.search(line)][:limit]


def vllm_settings(config) -> dict:
    """The settings a VllmConfig resolved."""
    import vllm

    scheduler, compilation, cache = config.scheduler_config, config.compilation_config, config.cache_config
    return {"version": vllm.__version__, "max_num_seqs": scheduler.max_num_seqs,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "max_model_len": config.model_config.max_model_len,
            "enforce_eager": config.model_config.enforce_eager,
            "compilation": str(getattr(compilation, "mode", getattr(compilation, "level", None))),
            "cudagraph_mode": str(getattr(compilation, "cudagraph_mode", None)),
            "attention_backend": os.environ.get("VLLM_ATTENTION_BACKEND") or attention_backend(config),
            "enable_prefix_caching": cache.enable_prefix_caching, "block_size": cache.block_size,
            "gpu_memory_utilization": cache.gpu_memory_utilization}


def attention_backend(config) -> str:
    """The backend vLLM picks, where this version's selector answers (else see the log's lines)."""
    try:
        from vllm.attention.selector import get_attn_backend

        model = config.model_config
        return get_attn_backend(model.get_head_size(), model.dtype, config.cache_config.cache_dtype,
                                config.cache_config.block_size).get_name()
    except Exception as exc:  # noqa: BLE001 - the selector's module and signature move between releases
        return f"unknown ({type(exc).__name__})"


def server_settings(engine_args: dict, env: dict[str, str], timeout_s: float = 120.0) -> dict:
    """`vllm serve`'s config for these engine arguments (AsyncEngineArgs' fields), rebuilt in a
    process of its own."""
    try:
        done = subprocess.run([sys.executable, __file__, json.dumps(engine_args)], env=env, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"not built in {timeout_s:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": f"exit {done.returncode}: {done.stderr[-1500:]}"}
    return json.loads(lines[-1])


def _print_server_settings(engine_args: dict) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    config = AsyncEngineArgs(**engine_args).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    print(json.dumps(vllm_settings(config), default=str))


if __name__ == "__main__":
    _print_server_settings(json.loads(sys.argv[1]))
