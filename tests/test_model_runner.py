"""The runner's decode-graph input path on the CPU: the graph's static buffers, filled by one copy
in their own layout (column-major block tables, padding rows), must give the eager path's tokens.

CUDA graphs need a GPU, so here a graph's replay runs its forward eagerly over the same buffers;
capture itself is checked on the GPU (benchmarks/gpu_engine.py --parts check).
"""

import torch

from goodserve import SamplingParams
from goodserve.engine import model_runner


class EagerDecodeGraph(model_runner._DecodeGraph):
    replays = 0

    def _capture(self, pool) -> None:
        pass

    def replay(self, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        EagerDecodeGraph.replays += 1
        self._forward()
        return self.logits[:num_seqs], self.logits_argmax[:num_seqs]


def test_decode_graph_inputs_give_the_eager_tokens(embedded_llm):
    tok = embedded_llm.tokenizer
    prompts = [{"prompt_token_ids": tok.encode(p)} for p in (
        "The capital of France is", "def fibonacci(n):", "A long time ago, in a galaxy far, far away, there "
        "lived a small droid who dreamed of seeing the stars up close one day.")]
    # Different lengths, so the batch shrinks (3 -> 2 -> 1 rows) into smaller graphs with padding rows;
    # one request wants logprobs, which come from the graph's logits.
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2 if n == 6 else None)
              for n in (6, 24, 40)]
    expected = embedded_llm.generate(prompts, params)
    runner = embedded_llm.engine.runner
    runner.use_graphs({size: EagerDecodeGraph(runner, size, None) for size in (1, 2, 4)}, {1: 1.0, 2: 1.0, 4: 1.0})
    try:
        got = embedded_llm.generate(prompts, params)
    finally:
        runner.use_graphs({}, {})
    assert EagerDecodeGraph.replays > 0
    for ours, ref in zip(got, expected):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
    assert got[0].outputs[0].logprobs == expected[0].outputs[0].logprobs


def test_the_cuda_warm_up_step_is_a_well_formed_batch():
    """The runner's start-up step (run on CUDA to compile the eager kernels) is a valid batch: run here
    on the CPU, it computes logits for its two sampling rows and leaves the engine working."""
    from goodserve import LLM

    llm = LLM("dummy:tiny", num_kv_blocks=16)
    output = llm.engine.runner._warm_up_eager_kernels()
    assert output.logits.shape == (2, llm.spec.vocab_size) and torch.isfinite(output.logits).all()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids) == 4


def test_eager_inputs_count_the_leading_decodes():
    """Mixed batches tell attention how many leading rows are decodes (the Triton path gives those to
    the decode kernel); a decode after a prefill chunk is not leading."""
    from goodserve import LLM

    llm = LLM("dummy:tiny", num_kv_blocks=16)
    flat = model_runner.FlatBatch(
        input_ids=[1] * 8, positions=[4, 9, 0, 1, 2, 3, 4, 2], slots=[4, 25, 32, 33, 34, 35, 36, 50],
        query_lens=[1, 1, 5, 1], seq_lens=[5, 10, 5, 3], block_tables=[[0], [1], [2], [3]],
        sample_rows=[0, 1, 2, 3], logits_indices=[0, 1, 6, 7], prompt_logit_spans={})
    assert llm.engine.runner._eager_input(flat).meta.num_leading_decodes == 2
    flat.query_lens = [5, 1, 1, 1]
    assert llm.engine.runner._eager_input(flat).meta.num_leading_decodes == 0


def test_a_batch_replays_a_larger_graph_only_when_it_is_measurably_faster():
    ms = {1: 5.8, 2: 6.0, 4: 5.95, 8: 6.1, 16: 9.0, 32: 6.5, 64: 6.6}
    choice = model_runner.graph_size_for_each_batch(ms)
    assert len(choice) == 65
    assert choice[1] == 1 and choice[2] == 2  # 4 is faster than 2, but within the 3% tolerance
    assert choice[3] == 4 and choice[5] == 8
    assert choice[9] == choice[16] == 32  # 16 is slower than 32: pad further
    assert choice[17] == 32 and choice[33] == 64
