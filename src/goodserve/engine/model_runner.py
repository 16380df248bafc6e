"""Executes one scheduled batch: builds the flat input tensors, runs the model, returns logits.

The runner owns the model, its KV cache and, on CUDA, captured graphs: one per decode batch-size
bucket, and one per token-count bucket for steps with prefill chunks (up to MIXED_GRAPH_MAX_TOKENS
tokens). Such steps replay a graph (no per-kernel launch cost); larger or unusual ones run eagerly.
Either way a step's inputs reach the device in one host-to-device copy: they are all int32, laid
out in a pinned staging buffer exactly as the device tensors that read them (for a graph, its own
input buffer).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from goodserve.config import EngineConfig
from goodserve.engine.kv_cache import allocate_kv_cache
from goodserve.engine.scheduler import ScheduledBatch
from goodserve.model.llama import LlamaForCausalLM
from goodserve.ops.attention import AttentionMetadata, LayerKVCache
from goodserve.ops.sampler import argmax

logger = logging.getLogger(__name__)


@dataclass
class FlatBatch:
    """A scheduled batch flattened on the host: the token-level lists every input is built from."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]  # index into batch.seqs of the sequences that sample a token this step
    logits_indices: list[int]  # their last token's row in the flat batch
    prompt_logit_spans: dict[int, tuple[int, int]]  # batch row -> flat [start, end) wanting logits
    pooling_spans: dict[int, tuple[int, int]] = field(default_factory=dict)  # batch row -> flat rows to sum


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: list[int]
    logits_indices: torch.Tensor | None  # [len(sample_rows)]; None when a graph replays (all rows, in order)
    prompt_logit_spans: dict[int, tuple[int, int]]
    graph: _DecodeGraph | _MixedGraph | None = None  # the captured graph whose input buffer holds the batch
    pooling_spans: dict[int, tuple[int, int]] = field(default_factory=dict)


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [len(sample_rows), V] float32
    prompt_logits: dict[int, torch.Tensor]  # batch row -> [n, V] float32
    logits_argmax: torch.Tensor | None = None  # [len(sample_rows)]: argmax(logits), when a graph computed it
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)  # batch row -> [hidden] float32 sum


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes captured as graphs; a batch runs in one that holds it, padded."""
    sizes = [1, 2, 4, 8] + list(range(16, 256, 16)) + list(range(256, max_num_seqs, 32))
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


# A larger graph than the smallest that holds a batch is used only if its replay is this much faster.
GRAPH_TIME_TOLERANCE = 0.03

# Steps with prefill chunks of up to this many tokens replay a graph. Eagerly, an 8B model's step
# costs ~16 ms of kernel launches on an H100 host whatever its size (a 22-token step took 17.4 ms,
# a decode graph of 20 sequences 6.1 ms: benchmarks/results/gpu_engine_makespan_eager_h100.json); past a
# few thousand tokens the GPU's own time hides the launches.
MIXED_GRAPH_MAX_TOKENS = 2048
# A mixed graph holds at most this many sequences after the leading decodes (prefill chunks and
# the decodes among them), the padding sequence included: it bounds the prefill kernel's grid.
MIXED_GRAPH_MAX_PREFILL_SEQS = 64


def mixed_graph_token_counts(max_num_batched_tokens: int) -> list[int]:
    """The token counts of the mixed-step graphs; a step runs in one that holds it, padded."""
    top = min(max_num_batched_tokens, MIXED_GRAPH_MAX_TOKENS)
    counts = [16, 32] + list(range(64, 1024, 64)) + list(range(1024, top, 128))
    return sorted({c for c in counts if c < top} | {-(-top // 16) * 16}) if top > 0 else []


def graph_size_for_each_batch(replay_ms: dict[int, float]) -> list[int]:
    """Index n: the captured size a batch of n sequences (or tokens) replays, the smallest whose replay
    time is within GRAPH_TIME_TOLERANCE of the fastest size >= n. Padding rows cost little, but
    cuBLAS's choice of kernel for some row counts does: Llama-3.1-8B's gate_up takes 311 us at 448
    rows and 164 us at 512 on an H100 (benchmarks/results/gpu_gemm_h100.json)."""
    sizes = sorted(replay_ms)
    choice = [sizes[0]] * (sizes[-1] + 1)
    for n in range(1, sizes[-1] + 1):
        fits = [s for s in sizes if s >= n]
        fastest = min(replay_ms[s] for s in fits)
        choice[n] = next(s for s in fits if replay_ms[s] <= fastest * (1 + GRAPH_TIME_TOLERANCE))
    return choice


def flatten(batch: ScheduledBatch, block_size: int) -> FlatBatch:
    flat = FlatBatch([], [], [], [], [], [], [], [], {})
    for row, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
        table, offset = seq.block_table, len(flat.input_ids)
        ahead = row < batch.num_ahead
        # ahead: the input token is the previous step's, still on the device; the engine copies it in.
        flat.input_ids.extend([0] if ahead else seq.token_ids[start:end])
        flat.positions.extend(range(start, end))
        flat.slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        flat.query_lens.append(num_new)
        flat.seq_lens.append(end)
        flat.block_tables.append(table)
        if seq.wants_prompt_logprobs and start < seq.num_prompt_tokens - 1:
            flat.prompt_logit_spans[row] = (offset, offset + min(end, seq.num_prompt_tokens - 1) - start)
        if seq.params.pooling == "mean":
            flat.pooling_spans[row] = (offset, offset + num_new)
        elif seq.params.pooling == "last" and end == seq.num_prompt_tokens:
            flat.pooling_spans[row] = (offset + num_new - 1, offset + num_new)
        if (end == seq.num_tokens and not seq.params.prefill_only) or ahead:
            flat.sample_rows.append(row)
            flat.logits_indices.append(offset + num_new - 1)
    return flat


def pooled_sums(hidden: torch.Tensor, spans: dict[int, tuple[int, int]]) -> dict[int, torch.Tensor]:
    """Per pooling row, the float32 sum of its final hidden states in this step (one row for 'last')."""
    return {row: hidden[start:end].float().sum(dim=0) for row, (start, end) in spans.items()}


def leading_decodes(query_lens: list[int]) -> int:
    """How many sequences at the head of the batch compute one token each."""
    return next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))


# Every input starts 16-byte aligned: Triton specializes kernels on pointer alignment, so inputs at
# arbitrary offsets would compile new kernel variants (each hundreds of ms) in the middle of a run.
ALIGN_INT32 = 4


def _aligned_concat(parts: list) -> tuple[np.ndarray, list[int]]:
    """One int32 array holding each part, each padded to a multiple of ALIGN_INT32; the padded sizes."""
    sizes = [-(-len(part) // ALIGN_INT32) * ALIGN_INT32 for part in parts]
    host = np.zeros(sum(sizes), dtype=np.int32)
    offset = 0
    for part, size in zip(parts, sizes):
        host[offset : offset + len(part)] = part
        offset += size
    return host, sizes


class ModelRunner:
    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, num_blocks: int,
                 kv_dtype: torch.dtype, max_model_len: int, device: torch.device) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-max_model_len // config.block_size)
        assert num_blocks * config.block_size < 2**31, "slot numbers must fit int32"
        self.kv_caches: list[LayerKVCache] = allocate_kv_cache(
            model.spec, num_blocks, config.block_size, device, kv_dtype
        )
        self.decode_graphs = GraphSet()  # by sequence count
        self.mixed_graphs = GraphSet()  # by token count
        # Two staging buffers, used in turn: with async scheduling a step is prepared while the last
        # one's host-to-device copy may still be queued behind the step before it.
        self._pinned = [torch.empty(0, dtype=torch.int32)] * 2
        self._turn = 0
        # The torch attention path sizes tensors from the batch's lengths, so it cannot be captured.
        if device.type == "cuda" and num_blocks >= 3:
            self._warm_up_eager_kernels()
            torch.cuda.synchronize(device)
        if device.type == "cuda" and not config.enforce_eager and config.attention_backend != "torch":
            self._capture_graphs()

    def _warm_up_eager_kernels(self) -> ModelOutput:
        """One eager step of a prefill chunk beside a decode, so the Triton kernels of the eager path
        (prefill attention above all) compile now, not in the first requests' time to first token
        (about a second on an H100). It writes K/V into blocks 0-2, which hold nothing yet."""
        bs, prefill_len = self.block_size, self.block_size + 3
        flat = FlatBatch(
            input_ids=[0] * (prefill_len + 1), positions=[*range(prefill_len), 4],
            slots=[*range(prefill_len), 2 * bs + 4], query_lens=[prefill_len, 1], seq_lens=[prefill_len, 5],
            block_tables=[[0, 1], [2]], sample_rows=[0, 1], logits_indices=[prefill_len - 1, prefill_len],
            prompt_logit_spans={})
        return self.execute(self._eager_input(flat))

    # ---- inputs --------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch) -> ModelInput:
        """The batch's input tensors on the device, in one host-to-device copy."""
        flat = flatten(batch, self.block_size)
        self._turn ^= 1
        graph = self._graph_for(flat)
        if graph is not None:
            return graph.load(flat, self._staging(graph.input_count(flat)))
        return self._eager_input(flat)

    def _eager_input(self, flat: FlatBatch) -> ModelInput:
        num_seqs = len(flat.seq_lens)
        width = max(map(len, flat.block_tables))
        tables = np.zeros((num_seqs, width), dtype=np.int32)
        for row, table in enumerate(flat.block_tables):
            tables[row, : len(table)] = table
        parts = [flat.input_ids, flat.positions, flat.slots, flat.logits_indices,
                 np.cumsum([0] + flat.query_lens), flat.seq_lens, tables.ravel()]
        host, sizes = _aligned_concat(parts)
        ids, positions, slots, logits_indices, query_start_loc, seq_lens, block_tables = (
            part[: len(source)] for part, source in zip(self._to_device(host).split(sizes), parts))
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=query_start_loc, seq_lens=seq_lens,
            block_tables=block_tables.view(num_seqs, width), max_query_len=max(flat.query_lens),
            max_seq_len=max(flat.seq_lens), query_lens_host=flat.query_lens, seq_lens_host=flat.seq_lens,
            num_leading_decodes=leading_decodes(flat.query_lens),
        )
        return ModelInput(ids, positions, meta, flat.sample_rows, logits_indices, flat.prompt_logit_spans,
                          pooling_spans=flat.pooling_spans)

    def _staging(self, count: int) -> torch.Tensor:
        """A reusable int32 host buffer of >= count entries, pinned on CUDA (pinning fresh memory every
        step costs more than the copy). Reuse is safe: steps alternate between two buffers, and the
        engine has the results of step N-1 (so its copy has landed) before it prepares step N+1."""
        if self._pinned[self._turn].numel() < count:
            self._pinned[self._turn] = torch.empty(max(count, 1 << 16), dtype=torch.int32,
                                                   pin_memory=self.device.type == "cuda")
        return self._pinned[self._turn]

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.from_numpy(array)
        staging = self._staging(array.size)[: array.size]
        staging.numpy()[:] = array
        return staging.to(self.device, non_blocking=True)

    # ---- execution -----------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, inputs: ModelInput) -> ModelOutput:
        if inputs.graph is not None:
            return inputs.graph.run(inputs)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        prompt_logits = {
            row: self.model.compute_logits(hidden[start:end])
            for row, (start, end) in inputs.prompt_logit_spans.items()
        }
        return ModelOutput(logits, prompt_logits, pooled=pooled_sums(hidden, inputs.pooling_spans))

    def _graph_for(self, flat: FlatBatch) -> _DecodeGraph | _MixedGraph | None:
        """The captured graph the batch replays: a decode graph if every sequence computes one token
        and samples, else a mixed-step graph unless some sequence wants prompt logits."""
        num_seqs = len(flat.seq_lens)
        if max(flat.query_lens) == 1 and len(flat.sample_rows) == num_seqs:
            return self.decode_graphs.holding(num_seqs)
        graph = None if flat.prompt_logit_spans else self.mixed_graphs.holding(len(flat.input_ids))
        return graph if graph is not None and graph.holds(flat) else None

    def _capture_graphs(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        # largest first, so smaller graphs fit in its memory pool
        counts = sorted(mixed_graph_token_counts(self.config.max_num_batched_tokens), reverse=True)
        self.mixed_graphs = GraphSet.timed({count: _MixedGraph(self, count, pool) for count in counts})
        sizes = sorted(graph_batch_sizes(self.config.max_num_seqs), reverse=True)
        self.decode_graphs = GraphSet.timed({size: _DecodeGraph(self, size, pool) for size in sizes})
        for graphs, unit in ((self.decode_graphs, "sequence"), (self.mixed_graphs, "token")):
            for size, chosen in graphs.replaced().items():
                logger.info("batches that fit the %d-%s graph replay the %d one (%.2f ms against %.2f)", size, unit,
                            chosen, graphs.replay_ms[chosen], graphs.replay_ms[size])


class GraphSet:
    """Captured graphs by size, and the graph each size replays: the smallest whose replay time is
    within GRAPH_TIME_TOLERANCE of the fastest that holds it (`graph_size_for_each_batch`)."""

    def __init__(self, graphs: dict | None = None, replay_ms: dict[int, float] | None = None) -> None:
        self.graphs = dict(sorted((graphs or {}).items()))
        self.replay_ms = replay_ms or {}
        self.size_for = graph_size_for_each_batch(self.replay_ms) if self.graphs else []

    @classmethod
    def timed(cls, graphs: dict) -> GraphSet:
        return cls(graphs, {size: graph.time_replay() for size, graph in graphs.items()})

    def holding(self, size: int):
        """The graph a batch of `size` replays; None when none holds it."""
        return self.graphs[self.size_for[size]] if size < len(self.size_for) else None

    def replaced(self) -> dict[int, int]:
        """Sizes whose batches replay a larger graph, and that graph's size."""
        return {size: self.size_for[size] for size in self.graphs if self.size_for[size] != size}


# Rows past the batch: input id and position 0, slot -1 (no K/V write), length 0 (nothing to attend).
_PADDING = (0, 0, -1, 0)


def _fill_column_major(tables: np.ndarray, block_tables: list[list[int]]) -> None:
    """A graph's block tables: sequence s's block j at tables[j, s], zeros elsewhere."""
    tables[:] = 0
    for seq, table in enumerate(block_tables):
        tables[: len(table), seq] = table


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
    """A CUDA graph of one decode step (forward, logits, their argmax) for up to `size` sequences.

    Its inputs live in one int32 device buffer, so a step's inputs arrive in one copy:
    [input_ids | positions | slot_mapping | seq_lens | block tables, column-major]. Column-major
    tables put the columns a step uses first, so the copy covers only those; columns past them keep
    valid block ids from earlier steps, which the kernels never read (seq_lens bound them).
    """

    def __init__(self, runner: ModelRunner, size: int, pool) -> None:
        device, max_blocks = runner.device, runner.max_blocks_per_seq
        self.size = size
        self.inputs = torch.zeros(4 * size + max_blocks * size, dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.slot_mapping, seq_lens = self.inputs[: 4 * size].view(4, size)
        self.slot_mapping.fill_(-1)
        max_len = max_blocks * runner.block_size
        self.meta = AttentionMetadata(
            slot_mapping=self.slot_mapping, query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
            seq_lens=seq_lens, block_tables=self.inputs[4 * size :].view(max_blocks, size).t(), max_query_len=1,
            max_seq_len=max_len, query_lens_host=[1] * size, seq_lens_host=[max_len] * size,
        )
        self.model, self.kv_caches = runner.model, runner.kv_caches
        self._capture(pool)

    def input_count(self, flat: FlatBatch) -> int:
        """How many leading entries of the input buffer the batch fills."""
        return self.size * (4 + max(map(len, flat.block_tables)))

    def load(self, flat: FlatBatch, staging: torch.Tensor) -> ModelInput:
        """Write the batch into `staging` in this graph's input layout and copy that to the device."""
        num_seqs, count = len(flat.seq_lens), self.input_count(flat)
        host = staging[:count].numpy()
        rows = host[: 4 * self.size].reshape(4, self.size)
        for row, values, pad in zip(rows, (flat.input_ids, flat.positions, flat.slots, flat.seq_lens), _PADDING):
            row[:num_seqs] = values
            row[num_seqs:] = pad
        _fill_column_major(host[4 * self.size :].reshape(-1, self.size), flat.block_tables)
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
    prefill chunks and decodes in any mix; the logits of the sampled rows are computed after it.

    The attention kernels' grids cover any batch of the graph's size, and the count of leading
    decodes (the decode kernel's; the prefill kernel takes the rest) is read on the device. Input
    buffer: [input_ids | positions | slot_mapping (token rows) | logits_indices | seq_lens |
    query_start_loc (sequence rows) | leading decodes | block tables, column-major]. The padding
    tokens after the batch's belong to the first padding sequence, of length 0: they write no K/V,
    and their attention output is 0 (not uninitialized memory). The other padding sequences have no
    tokens, so their programs exit at once.
    """

    def __init__(self, runner: ModelRunner, num_tokens: int, pool) -> None:
        device, max_blocks = runner.device, runner.max_blocks_per_seq
        self.num_tokens = num_tokens
        # a batch's sequences and one padding sequence, rounded up to keep the buffer's parts aligned
        self.max_seqs = -(-(min(num_tokens, runner.config.max_num_seqs) + 1) // ALIGN_INT32) * ALIGN_INT32
        self.max_prefill_seqs = min(MIXED_GRAPH_MAX_PREFILL_SEQS, self.max_seqs)
        self.seq_rows = self.max_seqs + ALIGN_INT32  # room for query_start_loc's extra entry, aligned
        self.tables_at = 3 * num_tokens + 3 * self.seq_rows + ALIGN_INT32
        self.inputs = torch.zeros(self.tables_at + max_blocks * self.max_seqs, dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.slot_mapping = self.inputs[: 3 * num_tokens].view(3, num_tokens)
        self.slot_mapping.fill_(-1)
        self.logits_indices, seq_lens, query_start_loc = self._seq_part(self.inputs).view(3, self.seq_rows)
        max_len = max_blocks * runner.block_size
        self.meta = AttentionMetadata(  # host lengths unused: graphs run the Triton kernels only
            slot_mapping=self.slot_mapping, query_start_loc=query_start_loc[: self.max_seqs + 1],
            seq_lens=seq_lens[: self.max_seqs], max_query_len=num_tokens, max_seq_len=max_len,
            block_tables=self.inputs[self.tables_at :].view(max_blocks, self.max_seqs).t(),
            query_lens_host=[], seq_lens_host=[], leading_decodes=self.inputs[self.tables_at - ALIGN_INT32 :][:1],
            max_prefill_seqs=self.max_prefill_seqs)
        self.model, self.kv_caches = runner.model, runner.kv_caches
        self._capture(pool)

    def _seq_part(self, buffer):
        return buffer[3 * self.num_tokens : 3 * self.num_tokens + 3 * self.seq_rows]

    def holds(self, flat: FlatBatch) -> bool:
        """Whether the batch's sequences after its leading decodes, and the padding one, fit the bound."""
        return len(flat.seq_lens) - leading_decodes(flat.query_lens) < self.max_prefill_seqs

    def input_count(self, flat: FlatBatch) -> int:
        return self.tables_at + self.max_seqs * max(map(len, flat.block_tables))

    def load(self, flat: FlatBatch, staging: torch.Tensor) -> ModelInput:
        num_tokens, num_seqs, count = len(flat.input_ids), len(flat.seq_lens), self.input_count(flat)
        host = staging[:count].numpy()
        tokens = host[: 3 * self.num_tokens].reshape(3, self.num_tokens)
        for row, values, pad in zip(tokens, (flat.input_ids, flat.positions, flat.slots), _PADDING):
            row[:num_tokens] = values
            row[num_tokens:] = pad
        logits_indices, seq_lens, query_start_loc = self._seq_part(host).reshape(3, self.seq_rows)
        logits_indices[: len(flat.logits_indices)] = flat.logits_indices
        seq_lens[:num_seqs] = flat.seq_lens
        seq_lens[num_seqs:] = 0
        query_start_loc[0] = 0
        query_start_loc[1 : num_seqs + 1] = np.cumsum(flat.query_lens)
        query_start_loc[num_seqs + 1 :] = self.num_tokens
        host[self.tables_at - ALIGN_INT32] = leading_decodes(flat.query_lens)
        _fill_column_major(host[self.tables_at :].reshape(-1, self.max_seqs), flat.block_tables)
        self.inputs[:count].copy_(staging[:count], non_blocking=True)
        return ModelInput(self.input_ids, self.positions, self.meta, flat.sample_rows,
                          self.logits_indices[: len(flat.sample_rows)], {}, graph=self,
                          pooling_spans=flat.pooling_spans)

    def _forward(self) -> None:
        self.hidden = self.model(self.input_ids, self.positions, self.kv_caches, self.meta)

    def replay(self) -> None:
        self.graph.replay()

    def run(self, inputs: ModelInput) -> ModelOutput:
        self.replay()
        return ModelOutput(self.model.compute_logits(self.hidden[inputs.logits_indices]), {},
                           pooled=pooled_sums(self.hidden, inputs.pooling_spans))
