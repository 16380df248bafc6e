"""The engine core's seams on CUDA: a worker in its own process runs the same CUDA graphs
and gives the same tokens, and two engines with different kernel choices in one process each keep
their own (the Triton one replays graphs, the torch one runs eagerly), both within the float32
tolerance of transformers on the embedded model."""

from __future__ import annotations

from gate_checks import assert_within, build, compare, engine_scores, greedy, hf_scores, tolerance

from goodserve.model.tokenizer_loader import embedded_tokenizer
from goodserve.model_names import EMBEDDED_MODEL

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def prompt_ids() -> list[list[int]]:
    tokenizer = embedded_tokenizer()
    return [tokenizer.encode(p) for p in PROMPTS]


def test_a_worker_process_on_cuda_gives_the_same_tokens(device, cuda_only, record_property):
    prompts = prompt_ids()
    expected = greedy(build(EMBEDDED_MODEL, device, dtype="float32"), prompts)
    llm = build(EMBEDDED_MODEL, device, dtype="float32", executor_backend="mp")
    try:
        assert llm.engine.executor.info.cuda_graphs
        got = greedy(llm, prompts)
    finally:
        llm.engine.executor.shutdown()
    record_property("tokens", got)
    assert got == expected


def test_two_engines_keep_their_own_kernels(device, cuda_only, hf_embedded_on_device, record_property):
    prompts = prompt_ids()
    on_triton = build(EMBEDDED_MODEL, device, dtype="float32", attention_backend="triton")
    on_torch = build(EMBEDDED_MODEL, device, dtype="float32", attention_backend="torch")
    assert on_triton.engine.executor.info.cuda_graphs and not on_torch.engine.executor.info.cuda_graphs
    for name, llm in (("triton", on_triton), ("torch", on_torch), ("triton_again", on_triton)):
        sequences = [ids + tokens for ids, tokens in zip(prompts, greedy(llm, prompts))]
        comparison = compare(sequences, [len(ids) for ids in prompts], engine_scores(llm, sequences),
                             hf_scores(hf_embedded_on_device, sequences))
        record_property(name, comparison.properties())
        assert_within(comparison, tolerance("float32", "auto"))


def test_steps_that_sample_nothing_wait_for_their_inputs(device, cuda_only, record_property):
    """Prefill chunks sample nothing, so no token copy makes the host wait for them; the runner still
    waits for each step's end before a later step reuses its staging buffer. A 200-token prompt in
    64-token chunks through mixed graphs gave other tokens than the eager engine while it did not
    (the host rewrote a staging buffer whose copy to the device was still queued)."""
    torch_prompt = list(range(3, 203))
    outputs = {mode: greedy(build("dummy:smollm2-135m", device, dtype="float32", max_num_batched_tokens=64,
                                  **options), [torch_prompt])[0]
               for mode, options in (("graphs+async", {}), ("eager", {"enforce_eager": True}))}
    record_property("tokens", outputs)
    assert outputs["graphs+async"] == outputs["eager"]


def test_a_dropped_engine_leaves_the_next_one_its_memory(device, cuda_only, record_property):
    """Two engines built in turn in one process, the first merely dropped (its CUDA graphs captured,
    its frames perhaps in a lazy import's reference cycle): the second sizes its KV cache as the first
    did, so the first's weights, KV cache and graph pools went back to the device, the caching
    allocator's blocks included (a second engine once found room for 3,344 tokens)."""
    first = build("dummy:smollm2-135m", device, dtype="bfloat16", num_kv_blocks=None)
    greedy(first, [[3, 4, 5]])
    blocks = first.engine.config.num_kv_blocks
    del first
    second = build("dummy:smollm2-135m", device, dtype="bfloat16", num_kv_blocks=None)
    record_property("kv_blocks", {"first": blocks, "second": second.engine.config.num_kv_blocks})
    assert second.engine.config.num_kv_blocks >= 0.99 * blocks  # the CUDA context's own growth aside
    second.shutdown()
