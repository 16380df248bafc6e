"""Every model source x dtype x quantization x KV dtype x execution mode, greedy against the torch path;
float32 of every source against Hugging Face transformers on the same weights.

The full product is 3 x 2 x 7 x 3 x 3 = 378 engines pairs (less gguf's exclusions): MATRIX is a
pairwise covering array instead, 21 cases in which every value of each axis meets every value of
every other axis at least once (test_matrix_covers_every_pair checks it). Axes:
  source: dummy (dummy:tiny random weights), hf (a tiny Llama saved as safetensors), gguf (the
          embedded SmolLM2-135M Q4_1 file: real weights);
  dtype: float32, bfloat16;
  quantization: none, int8, int4, each with and without quantize_lm_head, fp8 (weights and
          activations; GPUs of compute capability 8.9+), and gguf (the file's own codes: a GGUF source
          only, never with quantize_lm_head);
  KV cache: auto, int8, fp8;
  mode: CUDA graphs with async scheduling, graphs without it, eager.
The reference is the same model, quantization and KV dtype on the plain-torch attention path,
eager, on the same device.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import transformers
from gate_checks import (
    MODES, TORCH_PATH, assert_within, build, compare, engine_scores, greedy, hf_scores, hf_twin,
    leading_agreement, tolerance,
)

from goodserve.model.loader import load_model
from goodserve.model.tokenizer_loader import embedded_tokenizer
from goodserve.model_names import EMBEDDED_MODEL
from goodserve.quant.fp8_linear import FP8_MIN_CAPABILITY

SOURCES = ("dummy", "hf", "gguf")
DTYPES = ("float32", "bfloat16")
QUANTIZATIONS = ("none", "int8", "int8+head", "int4", "int4+head", "fp8", "gguf")
KV_DTYPES = ("auto", "int8", "fp8")
AXES = (SOURCES, DTYPES, QUANTIZATIONS, KV_DTYPES, tuple(MODES))

MATRIX = [
    ("gguf", "float32", "none", "auto", "graphs+async"),
    ("dummy", "bfloat16", "none", "int8", "graphs"),
    ("hf", "bfloat16", "none", "fp8", "eager"),
    ("hf", "float32", "int8", "auto", "graphs"),
    ("gguf", "float32", "int8", "int8", "eager"),
    ("dummy", "bfloat16", "int8", "fp8", "graphs+async"),
    ("dummy", "float32", "int8+head", "auto", "eager"),
    ("hf", "bfloat16", "int8+head", "int8", "graphs+async"),
    ("gguf", "float32", "int8+head", "fp8", "graphs"),
    ("gguf", "bfloat16", "int4", "auto", "graphs"),
    ("hf", "float32", "int4", "int8", "eager"),
    ("dummy", "bfloat16", "int4", "fp8", "graphs+async"),
    ("hf", "bfloat16", "int4+head", "auto", "eager"),
    ("dummy", "float32", "int4+head", "int8", "graphs+async"),
    ("gguf", "bfloat16", "int4+head", "fp8", "graphs"),
    ("dummy", "bfloat16", "fp8", "auto", "graphs+async"),
    ("hf", "float32", "fp8", "int8", "graphs"),
    ("gguf", "bfloat16", "fp8", "fp8", "eager"),
    ("gguf", "float32", "gguf", "auto", "graphs+async"),
    ("gguf", "bfloat16", "gguf", "int8", "graphs"),
    ("gguf", "bfloat16", "gguf", "fp8", "eager"),
]

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "In 1969, three astronauts flew 384,400 km to the Moon aboard Apollo 11. Neil Armstrong and Buzz "
    "Aldrin walked on the surface while Michael Collins orbited above. The mission returned safely, and",
]
RANDOM_PROMPT_LENS = (5, 23, 70)  # one step of 98 rows: past every small-batch kernel's bound


def allowed(case) -> bool:
    source, _, quantization, _, _ = case
    return quantization != "gguf" or source == "gguf"


def case_id(case) -> str:
    return "-".join(case)


def model_name(source: str, request) -> str:
    if source == "hf":
        return str(request.getfixturevalue("hf_dir"))
    return {"dummy": "dummy:tiny", "gguf": EMBEDDED_MODEL}[source]


def quantization_options(quantization: str) -> dict:
    method, _, head = quantization.partition("+")
    return {} if method == "none" else dict(quantization=method, quantize_lm_head=bool(head))


def prompts_for(source: str, vocab_size: int) -> list[list[int]]:
    if source == "gguf":
        return [embedded_tokenizer().encode(text) for text in TEXTS]
    generator = torch.Generator().manual_seed(len(source))
    return [torch.randint(2, vocab_size, (n,), generator=generator).tolist() for n in RANDOM_PROMPT_LENS]


def check_mode(llm, mode: str, device: str, record_property) -> None:
    """The switches did what they say: graphs captured or not, steps pipelined or not."""
    pipelined = llm.engine.stats().num_pipelined_steps
    record_property("pipelined_steps", pipelined)
    if device != "cuda":
        return
    assert bool(llm.engine.executor.worker.runner.graphs.decode.graphs) == (mode != "eager")
    assert (pipelined > 0) == (mode == "graphs+async")


def test_matrix_covers_every_pair():
    def pairs(cases):
        return {(i, case[i], j, case[j]) for case in cases for i, j in itertools.combinations(range(len(AXES)), 2)}

    every_case = [case for case in itertools.product(*AXES) if allowed(case)]
    assert all(allowed(case) for case in MATRIX)
    assert pairs(every_case) <= pairs(MATRIX)


@pytest.mark.parametrize("case", MATRIX, ids=case_id)
def test_engine_matches_torch_path(case, device, request, record_property):
    source, dtype, quantization, kv_cache_dtype, mode = case
    if source == "gguf" and device != "cuda":
        pytest.skip("the embedded model's cases run on CUDA only")
    if quantization == "fp8" and device == "cuda" and torch.cuda.get_device_capability() < FP8_MIN_CAPABILITY:
        pytest.skip(f"no FP8 tensor cores on {torch.cuda.get_device_name()}")
    options = dict(dtype=dtype, kv_cache_dtype=kv_cache_dtype, **quantization_options(quantization))
    model = model_name(source, request)

    fast = build(model, device, **options, **MODES[mode])
    prompts = prompts_for(source, fast.spec.vocab_size)
    tokens = greedy(fast, prompts)
    check_mode(fast, mode, device, record_property)
    sequences = [p + t for p, t in zip(prompts, tokens)]
    ours = engine_scores(fast, sequences)
    del fast

    reference = build(model, device, **options, **TORCH_PATH)
    comparison = compare(sequences, [len(p) for p in prompts], ours, engine_scores(reference, sequences))
    for prop in [*comparison.properties(), ("token_agreement", leading_agreement(tokens, greedy(reference, prompts)))]:
        record_property(*prop)
    assert_within(comparison, tolerance(dtype, kv_cache_dtype, quantization))


def hf_reference(source: str, request, device: str):
    if source == "gguf":
        return request.getfixturevalue("hf_embedded_on_device")
    if source == "hf":
        path = request.getfixturevalue("hf_dir")
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    return hf_twin(load_model("dummy:tiny", torch.float32, device).model)


@pytest.mark.parametrize("source", SOURCES)
def test_float32_matches_transformers(source, device, request, record_property):
    if source == "gguf" and device != "cuda":
        pytest.skip("the embedded model's cases run on CUDA only")
    fast = build(model_name(source, request), device, dtype="float32")  # graphs and async: the defaults
    prompts = prompts_for(source, fast.spec.vocab_size)
    tokens = greedy(fast, prompts)
    sequences = [p + t for p, t in zip(prompts, tokens)]
    ours = engine_scores(fast, sequences)
    comparison = compare(sequences, [len(p) for p in prompts], ours,
                         hf_scores(hf_reference(source, request, device), sequences))
    for prop in comparison.properties():
        record_property(*prop)
    assert_within(comparison, tolerance("float32", "auto"))
