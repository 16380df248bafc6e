"""Shared fixtures. The embedded model (float32 and GGUF) and its Hugging Face twin load once per test session."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

# The tests run on the CPU, so every Triton kernel runs in the interpreter. Set before anything
# imports triton: its own library functions (tl.cdiv, ...) are decorated when it is first imported,
# and kernels would otherwise fail or pass depending on which test imported triton first.
os.environ.setdefault("TRITON_INTERPRET", "1")

# The tiers' folders (docs/testing.md) share helpers by importing one another's modules by name
# (`from test_async_scheduling import drive`), whichever folder a run starts from.
sys.path[:0] = [str(Path(__file__).parent / tier) for tier in ("unit", "kernels", "engine", "server", "e2e")]

# Servers started by tests keep their Batch API data (--data-dir's default) in a directory of their own,
# never in the user's ~/.local/share/goodserve.
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="goodserve-tests-")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def embedded_llm():
    from goodserve import LLM

    # The float32 path (not the CPU's default gguf codes): tests compare it with HF transformers.
    return LLM("smollm2-135m", quantization="none", cpu_kv_cache_bytes=256 << 20)


@pytest.fixture(scope="session")
def embedded_gguf_llm():
    """The embedded model as the CPU serves it by default (its GGUF codes, native decode): a reference
    that tests only generate with and read (a test that changes its layers builds its own)."""
    from goodserve import LLM

    return LLM("smollm2-135m", cpu_kv_cache_bytes=64 << 20)


@pytest.fixture(scope="session")
def hf_embedded():
    """transformers' own model read from the same GGUF file: the independent reference."""
    import transformers

    from goodserve.model_names import embedded_gguf_path

    path = embedded_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32)
    return model.eval()
