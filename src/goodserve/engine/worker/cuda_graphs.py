"""CUDA graphs of whole steps: one per decode batch-size bucket, and one per token-count bucket for
steps with prefill chunks (up to mixed_graph_max_tokens tokens). Such steps replay a graph (no
per-kernel launch cost); larger or unusual ones run eagerly. A graph reads and writes only its own
static buffers; a step's inputs reach its input buffer in one host-to-device copy. The limits come
from the engine's KernelOptions (config.py): mixed_graph_max_tokens, graph_time_tolerance.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from goodserve.engine.worker.input_layout import InputLayout
from goodserve.engine.worker.model_inputs import FlatBatch, ModelInput, ModelOutput, leading_decodes, pooled_sums
from goodserve.ops.attention import AttentionMetadata, with_kv_groups
from goodserve.ops.sampler import argmax

if TYPE_CHECKING:
    from goodserve.engine.worker.model_runner import ModelRunner
    from goodserve.model.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes captured as graphs; a batch runs in one that holds it, padded."""
    sizes = [1, 2, 4, 8] + list(range(16, 256, 16)) + list(range(256, max_num_seqs, 32))
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


# Steps with prefill chunks of up to mixed_graph_max_tokens tokens (2,048) replay a graph. Eagerly,
# an 8B model's step costs ~16 ms of kernel launches on an H100 host whatever its size (a 22-token
# step took 17.4 ms, a decode graph of 20 sequences 6.1 ms:
# benchmarks/results/gpu_engine_makespan_eager_h100.json); past a few thousand tokens the GPU's own
# time hides the launches.
# A mixed graph holds at most this many sequences after the leading decodes (prefill chunks and
# the decodes among them), the padding sequence included: it bounds the prefill kernel's grid.
MIXED_GRAPH_MAX_PREFILL_SEQS = 64
# Steps of up to this many tokens whose decodes are followed by one prefill sequence (a prefix hit's
# question, a new prompt beside running decodes) replay graphs that hold just that: their prefill
# launch has a few programs (a graph holding 64 sequences would launch ~70 query blocks, most of them
# exiting at once), so it splits each block's keys over more (KernelOptions.split_prefill_attention).
ONE_PREFILL_GRAPH_MAX_TOKENS = 256


def mixed_graph_token_counts(max_num_batched_tokens: int, max_tokens: int) -> list[int]:
    """The token counts of the mixed-step graphs (up to max_tokens); a step runs in one that holds
    it, padded."""
    top = min(max_num_batched_tokens, max_tokens)
    counts = [16, 32] + list(range(64, 1024, 64)) + list(range(1024, top, 128))
    return sorted({c for c in counts if c < top} | {-(-top // 16) * 16}) if top > 0 else []


def graph_size_for_each_batch(replay_ms: dict[int, float], tolerance: float) -> list[int]:
    """Index n: the captured size a batch of n sequences (or tokens) replays, the smallest whose replay
    time is within `tolerance` (a share) of the fastest size >= n. Padding rows cost little, but
    cuBLAS's choice of kernel for some row counts does: Llama-3.1-8B's gate_up takes 311 us at 448
    rows and 164 us at 512 on an H100 (benchmarks/results/gpu_gemm_h100.json)."""
    sizes = sorted(replay_ms)
    choice = [sizes[0]] * (sizes[-1] + 1)
    for n in range(1, sizes[-1] + 1):
        fits = [s for s in sizes if s >= n]
        fastest = min(replay_ms[s] for s in fits)
        choice[n] = next(s for s in fits if replay_ms[s] <= fastest * (1 + tolerance))
    return choice



def capture_graphs(runner: ModelRunner) -> StepGraphs:
    """The decode graphs (by sequence count), the mixed-step graphs and those of one prefill sequence
    (by token count)."""
    pool = torch.cuda.graph_pool_handle()
    # largest first, so smaller graphs fit in its memory pool
    config, options = runner.config, runner.config.kernels
    counts = sorted(mixed_graph_token_counts(config.max_num_batched_tokens, options.mixed_graph_max_tokens),
                    reverse=True)
    tp, tolerance = runner.model.tp, options.graph_time_tolerance
    mixed = GraphSet.timed({count: _MixedGraph(runner, count, pool) for count in counts}, tolerance, tp)
    one_prefill = GraphSet.timed({count: _MixedGraph(runner, count, pool, max_prefill_seqs=2) for count in counts
                                  if count <= ONE_PREFILL_GRAPH_MAX_TOKENS and options.split_prefill_attention},
                                 tolerance, tp)
    sizes = sorted(graph_batch_sizes(config.max_num_seqs), reverse=True)
    decode = GraphSet.timed({size: _DecodeGraph(runner, size, pool) for size in sizes}, tolerance, tp)
    for graphs, unit in ((decode, "sequence"), (mixed, "token"), (one_prefill, "token one-prefill")):
        for size, chosen in graphs.replaced().items():
            logger.info("batches that fit the %d-%s graph replay the %d one (%.2f ms against %.2f)", size, unit,
                        chosen, graphs.replay_ms[chosen], graphs.replay_ms[size])
    return StepGraphs(decode, mixed, one_prefill)


def graph_for(flat: FlatBatch, graphs: StepGraphs) -> _DecodeGraph | _MixedGraph | None:
    """The captured graph the batch replays: a decode graph if every sequence computes one token
    and samples, else a mixed-step graph (prefill chunks, and sequences verifying drafts: their logits
    rows are gathered from the graph's hidden states after it; one holding a single prefill sequence
    where one does) unless some sequence wants prompt logits. Those steps are rare (a prompt-logprobs
    request's prefill chunks) and run eagerly, the one path that computes logits over a span."""
    num_seqs = len(flat.seq_lens)
    if max(flat.query_lens) == 1 and len(flat.sample_rows) == num_seqs:
        return graphs.decode.holding(num_seqs)
    if flat.prompt_logit_spans:
        return None
    for mixed in (graphs.one_prefill, graphs.mixed):
        graph = mixed.holding(len(flat.input_ids))
        if graph is not None and graph.holds(flat):
            return graph
    return None


class GraphSet:
    """Captured graphs by size, and the graph each size replays: the smallest whose replay time is
    within `tolerance` of the fastest that holds it (`graph_size_for_each_batch`)."""

    def __init__(self, graphs: dict | None = None, replay_ms: dict[int, float] | None = None,
                 tolerance: float = 0.0) -> None:
        self.graphs = dict(sorted((graphs or {}).items()))
        self.replay_ms = replay_ms or {}
        self.size_for = graph_size_for_each_batch(self.replay_ms, tolerance) if self.graphs else []

    @classmethod
    def timed(cls, graphs: dict, tolerance: float, tp: TensorParallel) -> GraphSet:
        """Under tensor parallelism every rank must replay the same graph for a batch (their
        collectives must match), so all take the slowest rank's times."""
        replay_ms = torch.tensor([graph.time_replay() for graph in graphs.values()], dtype=torch.float64)
        return cls(graphs, dict(zip(graphs, tp.all_reduce_max(replay_ms).tolist())), tolerance)

    def holding(self, size: int):
        """The graph a batch of `size` replays; None when none holds it."""
        return self.graphs[self.size_for[size]] if size < len(self.size_for) else None

    def replaced(self) -> dict[int, int]:
        """Sizes whose batches replay a larger graph, and that graph's size."""
        return {size: self.size_for[size] for size in self.graphs if self.size_for[size] != size}


@dataclass
class StepGraphs:
    """A runner's captured graphs: decode graphs by sequence count, mixed-step graphs by token count,
    and the mixed graphs of one prefill sequence (ONE_PREFILL_GRAPH_MAX_TOKENS) by token count."""

    decode: GraphSet = field(default_factory=GraphSet)
    mixed: GraphSet = field(default_factory=GraphSet)
    one_prefill: GraphSet = field(default_factory=GraphSet)

    def captured(self) -> bool:
        return bool(self.decode.graphs or self.mixed.graphs)


class _StepGraph:
    """A CUDA graph of `_forward`, which reads and writes only static buffers."""

    def _capture(self, pool) -> None:
        with torch.inference_mode():
            for _ in range(2):  # warm up: autotuning and lazy initialization stay out of the graph
                self._forward()
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self._forward()

    def time_replay(self, repeats: int = 3) -> float:
        """Milliseconds per replay, with the capture-time inputs (all padding: nothing is written)."""
        self.graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            self.graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats


class _DecodeGraph(_StepGraph):
    """A CUDA graph of one decode step (forward, logits, their argmax) for up to `size` sequences,
    its inputs in one device buffer in the step input layout (engine/worker/input_layout.py)."""

    def __init__(self, runner: ModelRunner, size: int, pool) -> None:
        device, max_blocks = runner.device, runner.max_blocks_per_seq
        self.size = size
        self.layout = InputLayout(size, size, max_blocks, runner.kv_groups.num_groups)
        self.inputs = torch.zeros(self.layout.size, dtype=torch.int32, device=device)
        views = self.layout.views(self.inputs)
        self.input_ids, self.positions, slot_mapping = views.input_ids[:size], views.positions[:size], \
            views.slot_mapping[:, :size]
        slot_mapping.fill_(-1)
        max_len = max_blocks // runner.kv_groups.num_groups * runner.block_size
        self.meta = with_kv_groups(AttentionMetadata(
            slot_mapping=slot_mapping[0], query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
            seq_lens=views.seq_lens[:size], block_tables=views.block_tables[:size], max_query_len=1,
            max_seq_len=max_len, query_lens_host=[1] * size, seq_lens_host=[max_len] * size,
        ), slot_mapping, views.block_tables[:size])
        self.model, self.kv_caches = runner.model, runner.kv_caches
        self._capture(pool)

    def load(self, flat: FlatBatch, staging: torch.Tensor) -> ModelInput:
        """Write the batch into `staging` in the layout and copy what it filled to the device."""
        count = self.layout.used(flat)
        self.layout.pack(flat, staging[:count].numpy())
        self.inputs[:count].copy_(staging[:count], non_blocking=True)
        return ModelInput(self.input_ids, self.positions, self.meta, flat.sample_rows, None, {}, graph=self)

    def _forward(self) -> None:
        hidden = self.model(self.input_ids, self.positions, self.kv_caches, self.meta)
        self.logits = self.model.compute_logits(hidden)
        self.logits_argmax = argmax(self.logits, self.model.kernels)  # greedy tokens in the graph: no launch after it

    def replay(self, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.graph.replay()
        return self.logits[:num_seqs], self.logits_argmax[:num_seqs]

    def run(self, inputs: ModelInput) -> ModelOutput:
        """Every sequence samples, in batch order."""
        logits, logits_argmax = self.replay(len(inputs.sample_rows))
        return ModelOutput(logits, {}, logits_argmax)


class _MixedGraph(_StepGraph):
    """A CUDA graph of one step's forward over up to `num_tokens` tokens of up to `max_seqs` sequences,
    prefill chunks, decodes and decodes verifying drafts in any mix; the logits of the sampled rows
    (1 + k of a row verifying k drafts) are computed after it.

    The attention kernels' grids cover any batch of the graph's size, and the count of leading
    decodes (the decode kernel's; the prefill kernel takes the rest) is read on the device, from the
    step input layout's buffer (engine/worker/input_layout.py). The padding sequences have no tokens but
    the first, so their programs exit at once.
    """

    def __init__(self, runner: ModelRunner, num_tokens: int, pool, max_prefill_seqs: int | None = None) -> None:
        device, max_blocks = runner.device, runner.max_blocks_per_seq
        self.num_tokens = num_tokens
        # a batch's sequences and one padding sequence
        self.max_seqs = min(num_tokens, runner.config.max_num_seqs) + 1
        self.max_prefill_seqs = min(max_prefill_seqs or MIXED_GRAPH_MAX_PREFILL_SEQS, self.max_seqs)
        self.layout = InputLayout(num_tokens, self.max_seqs, max_blocks, runner.kv_groups.num_groups)
        self.inputs = torch.zeros(self.layout.size, dtype=torch.int32, device=device)
        views = self.layout.views(self.inputs)
        self.input_ids, self.positions, self.logits_indices = views.input_ids, views.positions, views.logits_indices
        views.slot_mapping.fill_(-1)
        self.meta = with_kv_groups(AttentionMetadata(  # host lengths unused: graphs run the Triton kernels only
            slot_mapping=views.slot_mapping[0], query_start_loc=views.query_start_loc, seq_lens=views.seq_lens,
            max_query_len=num_tokens, max_seq_len=max_blocks // runner.kv_groups.num_groups * runner.block_size,
            block_tables=views.block_tables, query_lens_host=[], seq_lens_host=[],
            leading_decodes=views.leading_decodes, max_prefill_seqs=self.max_prefill_seqs),
            views.slot_mapping, views.block_tables)
        self.model, self.kv_caches = runner.model, runner.kv_caches
        self._capture(pool)

    def holds(self, flat: FlatBatch) -> bool:
        """Whether the batch's sequences after its leading decodes, and the padding one, fit the bound."""
        return len(flat.seq_lens) - leading_decodes(flat.query_lens) < self.max_prefill_seqs

    def load(self, flat: FlatBatch, staging: torch.Tensor) -> ModelInput:
        count = self.layout.used(flat)
        self.layout.pack(flat, staging[:count].numpy())
        self.inputs[:count].copy_(staging[:count], non_blocking=True)
        return ModelInput(self.input_ids, self.positions, self.meta, flat.sample_rows,
                          self.logits_indices[: len(flat.logits_indices)], {}, graph=self,
                          pooling_spans=flat.pooling_spans)

    def _forward(self) -> None:
        self.hidden = self.model(self.input_ids, self.positions, self.kv_caches, self.meta)

    def replay(self) -> None:
        self.graph.replay()

    def run(self, inputs: ModelInput) -> ModelOutput:
        self.replay()
        return ModelOutput(self.model.compute_logits(self.hidden[inputs.logits_indices]), {},
                           pooled=pooled_sums(self.hidden, inputs.pooling_spans))
