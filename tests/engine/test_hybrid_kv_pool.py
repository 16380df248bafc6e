"""The hybrid KV pool (engine/setup/kv_groups.py) on a tiny Gemma 3 (five local layers with a 16-token window
to one global): a block holds one layer's K/V, so the same bytes make six times the blocks; a local
layer's blocks before its window are released as a sequence grows, so at a long context the pool holds
more sequences than an all-global one; and the tokens stay transformers'. Counts are computed here
from the model's shape, not read from the engine's own arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest

from goodserve.engine.frontend.input_processor import sequence_id
from goodserve.llm import LLM
from goodserve.sampling_params import SamplingParams
from helpers import engine_of
from test_async_scheduling import engine_mode
from test_families import assert_greedy_matches, save_tiny_model
from test_gemma import WINDOW, gemma3_config

transformers = pytest.importorskip("transformers")

BLOCK = 8
NUM_LAYERS, NUM_LOCAL = 6, 5
# K and V of one layer and token: 2 KV heads of 16 float32s each (test_gemma's shape)
LAYER_TOKEN_BYTES = 2 * 2 * 16 * 4
ALL_GLOBAL_BLOCKS = 30
BUDGET = ALL_GLOBAL_BLOCKS * NUM_LAYERS * BLOCK * LAYER_TOKEN_BYTES
PROMPT = 6 * WINDOW  # six windows long


def _llm(path: Path, **settings) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", block_size=BLOCK, cpu_kv_cache_bytes=BUDGET,
               max_num_batched_tokens=32, enable_chunked_prefill=True, max_num_seqs=10, **settings)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gemma3-hybrid")
    save_tiny_model(gemma3_config(), path)
    return path


def blocks_at(context: int, local: bool) -> int:
    """The blocks one layer keeps of a sequence of `context` tokens whose next query sits at `context`:
    all of them, or (local) those holding one of the keys that query reads, its last WINDOW - 1 ones."""
    last = -(-context // BLOCK)
    return last if not local else last - max(context - WINDOW + 1, 0) // BLOCK


def peak_long_sequences(llm: LLM, prompts: list[list[int]], long: int) -> int:
    """The most sequences at once whose context reached `long` tokens, stepping the engine."""
    engine = engine_of(llm)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, sum(seq.num_computed_tokens >= long for seq in engine.scheduler.running))
    assert engine.kv.num_used_blocks == 0, "blocks leaked"
    return peak


def test_hybrid_pool_holds_more_long_sequences_than_all_global(hybrid_dir: Path, tmp_path: Path):
    save_tiny_model(gemma3_config(layer_types=["full_attention"] * NUM_LAYERS), tmp_path)
    hybrid, all_global = _llm(hybrid_dir), _llm(tmp_path)
    # The same bytes: an all-global block holds six layers, a hybrid one one layer.
    assert engine_of(all_global).kv.num_blocks == ALL_GLOBAL_BLOCKS
    assert engine_of(hybrid).kv.num_blocks == NUM_LAYERS * ALL_GLOBAL_BLOCKS
    prompts = [[3 + (i * 7 + j) % 250 for j in range(PROMPT)] for i in range(10)]
    global_fit = ALL_GLOBAL_BLOCKS // blocks_at(PROMPT, local=False)
    per_hybrid_sequence = blocks_at(PROMPT, local=False) + NUM_LOCAL * blocks_at(PROMPT, local=True)
    hybrid_fit = NUM_LAYERS * ALL_GLOBAL_BLOCKS // per_hybrid_sequence
    assert (global_fit, hybrid_fit) == (2, 8)
    assert peak_long_sequences(all_global, prompts, PROMPT) <= global_fit
    assert global_fit < peak_long_sequences(hybrid, prompts, PROMPT) <= hybrid_fit


def test_local_layers_release_their_blocks_as_a_sequence_grows(hybrid_dir: Path):
    """One sequence from an 8-token prompt to eight windows: after each step it holds every block of
    the global layer, and of each local layer those its next query reads."""
    engine = engine_of(_llm(hybrid_dir))
    engine.add_request("long", list(range(3, 11)), SamplingParams(temperature=0, max_tokens=8 * WINDOW,
                                                                  ignore_eos=True))
    seq_id, longest = sequence_id("long", 0), 0
    while engine.has_unfinished():
        engine.step()
        seq = engine.scheduler.seqs.get(seq_id)
        if seq is None:
            break
        context = seq.num_computed_tokens
        expected = blocks_at(context, local=False) + NUM_LOCAL * blocks_at(context, local=True)
        engine.kv.allocate(seq, 0)  # releases what the next step no longer reads, as scheduling it would
        assert len(engine.kv.blocks_held(seq_id)) == engine.kv.num_used_blocks == expected
        longest = max(longest, context)
    assert longest >= 8 * WINDOW
    all_global = NUM_LAYERS * blocks_at(longest, local=False)
    assert expected < all_global / 3


def assert_tokens_equal_transformers_in_a_tight_pool(path: Path, **settings) -> None:
    """Prompts several windows long, batched and alone, in a pool small enough that released local
    blocks are soon taken by other sequences (and, with prefix caching, revived from the cache)."""
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    prompts = [[3 + (i * 11 + j * 5) % 290 for j in range(n)] for i, n in enumerate((5 * WINDOW, 3, 2 * WINDOW + 5))]
    prompts.append(prompts[0][: 3 * WINDOW] + [7, 8, 9])  # shares three windows with the first
    assert_greedy_matches(str(path), hf_model, prompts, block_size=BLOCK,
                          num_kv_blocks=NUM_LAYERS * ALL_GLOBAL_BLOCKS, **settings)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_tokens_equal_transformers_in_a_tight_hybrid_pool(hybrid_dir: Path, prefix_caching: bool):
    assert_tokens_equal_transformers_in_a_tight_pool(hybrid_dir, enable_prefix_caching=prefix_caching)


def test_decode_graphs_and_async_scheduling_read_each_groups_tables(hybrid_dir: Path):
    """The decode graphs' buffers (a slot row per group, the groups' tables interleaved, column-major)
    and steps launched ahead give the eager steps' tokens (stand-in graphs that run eagerly: the CPU
    has no CUDA graphs)."""
    llm = _llm(hybrid_dir)
    prompts = [{"prompt_token_ids": [3 + (i * 13 + j * 3) % 290 for j in range(n)]} for i, n in enumerate((40, 9, 70))]
    params = SamplingParams(temperature=0, max_tokens=3 * WINDOW, ignore_eos=True)
    expected = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    with engine_mode(llm, graphs=True, async_scheduling=True) as pipelined_steps:
        assert [out.outputs[0].token_ids for out in llm.generate(prompts, params)] == expected
        assert pipelined_steps() > 0


def test_the_servers_startup_line_counts_the_tokens_every_layer_could_keep(hybrid_dir: Path):
    from goodserve.server.app import ServerConfig, startup_message

    line = startup_message(engine_of(_llm(hybrid_dir)), ServerConfig(), "tiny-gemma3")
    # six one-layer groups of 180 blocks: 30 blocks of 8 tokens for every layer
    assert f"kv_pool=180 blocks x {BLOCK} in 6 layer groups = {ALL_GLOBAL_BLOCKS * BLOCK} tokens" in line
