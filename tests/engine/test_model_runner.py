"""The runner's decode-graph input path on the CPU: the graph's static buffers, filled by one copy
in their own layout (column-major block tables, padding rows), must give the eager path's tokens.

CUDA graphs need a GPU, so here a graph's replay runs its forward eagerly over the same buffers;
capture itself is checked on the GPU (benchmarks/gpu_engine.py --parts check).
"""

import pytest
import torch

from goodserve import SamplingParams
from goodserve.engine.worker import cuda_graphs
from goodserve.engine.worker.model_inputs import FlatBatch
from helpers import runner_of


class EagerDecodeGraph(cuda_graphs._DecodeGraph):
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
    runner = runner_of(embedded_llm)
    runner.graphs.decode = cuda_graphs.GraphSet({size: EagerDecodeGraph(runner, size, None) for size in (1, 2, 4)},
                                                 {1: 1.0, 2: 1.0, 4: 1.0})
    try:
        got = embedded_llm.generate(prompts, params)
    finally:
        runner.graphs.decode = cuda_graphs.GraphSet()
    assert EagerDecodeGraph.replays > 0
    for ours, ref in zip(got, expected):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
    assert got[0].outputs[0].logprobs == expected[0].outputs[0].logprobs


def test_decode_graph_inputs_through_fused_rotary_decode_attention_give_the_reference_tokens():
    """The decode graphs' buffers (column-major block tables, padding rows of length 0 and slot -1)
    through decode attention with RoPE + the cache write fused in, under the Triton interpreter, give
    the plain-torch path's tokens."""
    from goodserve import LLM
    from goodserve.config import KernelOptions

    torch.manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (n,)).tolist()} for n in (3, 20, 9)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (10, 4, 7)]
    settings = {"model": "dummy:tiny", "num_kv_blocks": 48, "max_num_seqs": 4}
    expected = LLM(**settings, attention_backend="torch").generate(prompts, params)
    llm = LLM(**settings, attention_backend="triton", kernels=KernelOptions(fuse_rotary_into_decode_attention=True))
    runner = runner_of(llm)
    runner.graphs.decode = cuda_graphs.GraphSet({size: EagerDecodeGraph(runner, size, None) for size in (1, 2, 4)},
                                                 {1: 1.0, 2: 1.0, 4: 1.0})
    replays = EagerDecodeGraph.replays
    got = llm.generate(prompts, params)
    assert EagerDecodeGraph.replays > replays
    for ours, ref in zip(got, expected):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids


class EagerMixedGraph(cuda_graphs._MixedGraph):
    replays = 0

    def _capture(self, pool) -> None:
        pass

    def replay(self) -> None:
        EagerMixedGraph.replays += 1
        self._forward()


@pytest.mark.slow  # the fast tier replays decode graphs' inputs (tests below)
def test_mixed_graph_inputs_give_the_reference_tokens():
    """Steps with prefill chunks through a mixed graph's buffers (padding tokens and sequences, every
    sequence in the prefill kernel, logits of the sampled rows only) under the Triton interpreter
    give the plain-torch path's tokens and logprobs."""
    from goodserve import LLM

    torch.manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (n,)).tolist()} for n in (3, 40, 9, 21, 2)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (12, 5, 8, 3, 10)]
    settings = {"model": "dummy:tiny", "num_kv_blocks": 48, "max_num_batched_tokens": 24, "max_num_seqs": 6}
    expected = LLM(**settings, attention_backend="torch").generate(prompts, params)
    llm = LLM(**settings, attention_backend="triton")
    runner = runner_of(llm)
    counts = cuda_graphs.mixed_graph_token_counts(24, 2048)
    assert counts == [16, 32]  # a 17..24-token step replays the 32-token graph, padded
    runner.graphs.mixed = cuda_graphs.GraphSet({count: EagerMixedGraph(runner, count, None) for count in counts},
                                                dict.fromkeys(counts, 1.0))
    got = llm.generate(prompts, params)
    assert EagerMixedGraph.replays >= 4
    for ours, ref in zip(got, expected):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
        for mine, theirs in zip(ours.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert list(mine) == list(theirs)
            assert [e.logprob for e in mine.values()] == pytest.approx([e.logprob for e in theirs.values()], abs=1e-4)


def test_a_mixed_graph_takes_a_bounded_number_of_prefill_sequences(monkeypatch):
    """The prefill kernel's grid in a mixed graph is sized for MIXED_GRAPH_MAX_PREFILL_SEQS sequences
    after the leading decodes (the padding sequence among them): a batch with more runs eagerly; a
    batch with one takes a graph sized for just that where there is one."""
    from goodserve import LLM

    monkeypatch.setattr(cuda_graphs, "MIXED_GRAPH_MAX_PREFILL_SEQS", 3)
    runner = runner_of(LLM("dummy:tiny", num_kv_blocks=16))
    graph = EagerMixedGraph(runner, 32, None)
    runner.graphs.mixed = cuda_graphs.GraphSet({32: graph}, {32: 1.0})

    def graph_for(flat):
        return cuda_graphs.graph_for(flat, runner.graphs)

    def batch(query_lens):
        num_tokens = sum(query_lens)
        return FlatBatch(
            input_ids=[1] * num_tokens, positions=list(range(num_tokens)), slots=list(range(num_tokens)),
            query_lens=query_lens, seq_lens=query_lens, block_tables=[[i] for i in range(len(query_lens))],
            sample_rows=list(range(len(query_lens))), logits_indices=[], prompt_logit_spans={})

    assert graph_for(batch([1, 1, 1, 5, 4])) is graph  # three leading decodes, two more
    assert graph_for(batch([1, 5, 1, 4])) is None  # a decode after a chunk counts: three more
    assert graph_for(batch([20, 13])) is None  # 33 tokens: no graph that large
    # With graphs of one prefill sequence, the batches that have one take them; the rest as before.
    one_prefill = EagerMixedGraph(runner, 32, None, max_prefill_seqs=2)
    runner.graphs.one_prefill = cuda_graphs.GraphSet({32: one_prefill}, {32: 1.0})
    assert graph_for(batch([1, 1, 1, 20])) is one_prefill and graph_for(batch([12])) is one_prefill
    assert graph_for(batch([1, 1, 1, 5, 4])) is graph


def test_the_cuda_warm_up_step_is_a_well_formed_batch():
    """The runner's start-up step (run on CUDA to compile the eager kernels) is a valid batch: run here
    on the CPU, it computes logits for its two sampling rows and leaves the engine working."""
    from goodserve import LLM

    llm = LLM("dummy:tiny", num_kv_blocks=16)
    output = runner_of(llm)._warm_up_eager_kernels()
    assert output.logits.shape == (2, llm.spec.vocab_size) and torch.isfinite(output.logits).all()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids) == 4


def test_eager_inputs_count_the_leading_decodes():
    """Mixed batches tell attention how many leading rows are decodes (the Triton path gives those to
    the decode kernel); a decode after a prefill chunk is not leading."""
    from goodserve import LLM

    llm = LLM("dummy:tiny", num_kv_blocks=16)
    flat = FlatBatch(
        input_ids=[1] * 8, positions=[4, 9, 0, 1, 2, 3, 4, 2], slots=[4, 25, 32, 33, 34, 35, 36, 50],
        query_lens=[1, 1, 5, 1], seq_lens=[5, 10, 5, 3], block_tables=[[0], [1], [2], [3]],
        sample_rows=[0, 1, 2, 3], logits_indices=[0, 1, 6, 7], prompt_logit_spans={})
    assert runner_of(llm)._eager_input(flat).meta.num_leading_decodes == 2
    flat.query_lens = [5, 1, 1, 1]
    assert runner_of(llm)._eager_input(flat).meta.num_leading_decodes == 0


def test_a_batch_replays_a_larger_graph_only_when_it_is_measurably_faster():
    ms = {1: 5.8, 2: 6.0, 4: 5.95, 8: 6.1, 16: 9.0, 32: 6.5, 64: 6.6}
    choice = cuda_graphs.graph_size_for_each_batch(ms, 0.03)
    assert len(choice) == 65
    assert choice[1] == 1 and choice[2] == 2  # 4 is faster than 2, but within the 3% tolerance
    assert choice[3] == 4 and choice[5] == 8
    assert choice[9] == choice[16] == 32  # 16 is slower than 32: pad further
    assert choice[17] == 32 and choice[33] == 64


def test_the_layout_holds_a_logits_row_per_token():
    """Two sequences verifying 4 and 3 drafts: 9 logits rows, more than the sequence rows hold (token
    rows are aligned to 12, sequence rows to 4 plus query_start_loc's extra entry: 8)."""
    import numpy as np

    from goodserve.engine.worker.input_layout import InputLayout

    flat = FlatBatch(input_ids=[11, 12, 13, 14, 15, 21, 22, 23, 24], positions=[5, 6, 7, 8, 9, 9, 10, 11, 12],
                     slots=[117, 118, 119, 120, 121, 57, 58, 59, 60], query_lens=[5, 4], seq_lens=[10, 13],
                     block_tables=[[7], [3, 4]], sample_rows=[0, 1], logits_indices=list(range(9)),
                     prompt_logit_spans={})
    layout = InputLayout(9, 2, 3)
    assert layout.used(flat) == 76 and layout.size == 80
    host = np.full(layout.used(flat), 99, dtype=np.int32)
    layout.pack(flat, host)
    assert host.tolist() == [
        11, 12, 13, 14, 15, 21, 22, 23, 24, 0, 0, 0,  # input ids
        5, 6, 7, 8, 9, 9, 10, 11, 12, 0, 0, 0,  # positions
        0, 1, 2, 3, 4, 5, 6, 7, 8, 99, 99, 99,  # logits indices: rows past the batch's never read nor written
        117, 118, 119, 120, 121, 57, 58, 59, 60, -1, -1, -1,  # slots
        10, 13, 0, 0, 0, 0, 0, 0,  # seq lens
        0, 5, 9, 12, 12, 12, 12, 12,  # query start locations
        0, 99, 99, 99,  # leading decodes: the first entry
        7, 3, 0, 0, 0, 4, 0, 0]  # block tables, column-major: the two columns used
    views = layout.views(torch.from_numpy(np.concatenate([host, np.zeros(4, dtype=np.int32)])))
    assert views.logits_indices[:9].tolist() == list(range(9)) and views.block_tables[1, :2].tolist() == [3, 4]


def test_a_hybrid_pool_steps_with_a_slot_row_and_a_table_per_layer_group():
    """Two layer groups (engine/setup/kv_groups.py): the tables interleave them (entry 2i + g: group g's block
    of the i-th block of tokens), each group's slots of a token come from its own blocks, and each
    group's metadata reads its own table and slots."""
    from goodserve.engine.worker.input_layout import InputLayout
    from goodserve.engine.worker.model_inputs import RequestState, flatten
    from goodserve.engine.seam.scheduler_output import SchedulerOutput
    from goodserve.ops.attention import AttentionMetadata, with_kv_groups

    block_size = 16
    out = SchedulerOutput(seq_ids=["a", "b"], num_new_tokens=[1, 2], num_computed_tokens=[16, 0],
                          token_ids=[[5], [6, 7]], block_tables=[[0, 1, 2, 3], [4, 5]], samples=[True, True])
    requests = {seq_id: RequestState(seq_id, SamplingParams(), [1], False, None) for seq_id in ("a", "b")}
    flat = flatten(out, requests, block_size, num_groups=2)
    # group 0: a's position 16 in block 2, b's 0 and 1 in block 4; group 1: blocks 3 and 5
    assert flat.slots == [2 * 16, 4 * 16, 4 * 16 + 1, 3 * 16, 5 * 16, 5 * 16 + 1]
    layout = InputLayout(3, 2, 4, num_groups=2)
    host = torch.zeros(layout.size, dtype=torch.int32)
    layout.pack(flat, host.numpy())
    views = layout.views(host)
    shared = AttentionMetadata(views.slot_mapping[0], views.query_start_loc, views.seq_lens, views.block_tables, 2,
                               17, flat.query_lens, flat.seq_lens)
    meta = with_kv_groups(shared, views.slot_mapping[:, :3], views.block_tables[:2]).for_new_step()
    assert [meta.for_group(g).slot_mapping.tolist() for g in (0, 1)] == [flat.slots[:3], flat.slots[3:]]
    assert [meta.for_group(g).block_tables[:, :2].tolist() for g in (0, 1)] == [[[0, 2], [4, 0]], [[1, 3], [5, 0]]]


def test_steps_verifying_drafts_replay_a_mixed_graph_and_prompt_logits_run_eagerly():
    from goodserve import LLM

    runner = runner_of(LLM("dummy:tiny", num_kv_blocks=16))
    graph = EagerMixedGraph(runner, 16, None)
    runner.graphs.mixed = cuda_graphs.GraphSet({16: graph}, {16: 1.0})
    flat = FlatBatch(input_ids=[1] * 5, positions=[5, 6, 7, 9, 10], slots=[5, 6, 7, 25, 26], query_lens=[3, 2],
                     seq_lens=[8, 11], block_tables=[[0], [1]], sample_rows=[0, 1], logits_indices=[0, 1, 2, 3, 4],
                     prompt_logit_spans={})
    assert cuda_graphs.graph_for(flat, runner.graphs) is graph
    assert graph.load(flat, torch.zeros(graph.layout.size, dtype=torch.int32)).logits_indices.tolist() == [0, 1, 2, 3, 4]
    flat.prompt_logit_spans = {0: (0, 2)}
    assert cuda_graphs.graph_for(flat, runner.graphs) is None


class VerifyCountingMixedGraph(EagerMixedGraph):
    verify_replays = 0

    def run(self, inputs):
        VerifyCountingMixedGraph.verify_replays += len(inputs.logits_indices) > len(inputs.sample_rows)
        return super().run(inputs)


@pytest.mark.slow  # the fast tier replays the mixed graph without speculation (test above)
def test_verify_steps_through_mixed_graph_buffers_give_the_speculation_off_tokens():
    """Greedy prompt lookup whose verify steps run in a mixed graph's buffers (a logits row per draft,
    gathered after the forward), under the Triton interpreter, gives the plain-torch path's tokens
    without speculation; the engine counts those steps as graphed verifications."""
    from goodserve import LLM

    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 4}, {"prompt_token_ids": [40, 41, 42] * 3 + [40]}]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    settings = {"model": "dummy:tiny", "num_kv_blocks": 48, "max_num_seqs": 4}
    expected = LLM(**settings, attention_backend="torch").generate(prompts, params)
    llm = LLM(**settings, attention_backend="triton", speculative_method="ngram", num_speculative_tokens=3,
              spec_policy="always")
    runner = runner_of(llm)
    counts = cuda_graphs.mixed_graph_token_counts(llm.engine.config.max_num_batched_tokens, 64)
    runner.graphs.mixed = cuda_graphs.GraphSet({c: VerifyCountingMixedGraph(runner, c, None) for c in counts},
                                                dict.fromkeys(counts, 1.0))
    got = llm.generate(prompts, params)
    stats = llm.engine.stats()
    assert VerifyCountingMixedGraph.verify_replays > 0 and stats.spec_decode_num_draft_tokens > 0
    assert 0 < stats.num_graphed_verify_steps == stats.num_verify_steps
    for ours, ref in zip(got, expected):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
