"""Executes one scheduled batch: builds the flat input tensors, runs the model, returns logits.

The runner owns the model, its KV cache and, on CUDA, one captured graph per decode batch-size
bucket: decode steps replay a graph (no per-kernel launch cost), everything else runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from goodserve.config import EngineConfig
from goodserve.engine.kv_cache import allocate_kv_cache
from goodserve.engine.scheduler import ScheduledBatch
from goodserve.model.llama import LlamaForCausalLM
from goodserve.ops.attention import AttentionMetadata, LayerKVCache


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: list[int]  # index into batch.seqs of the sequences that sample a token this step
    logits_indices: torch.Tensor  # [len(sample_rows)]: their last token's row in the flat batch
    prompt_logit_spans: dict[int, tuple[int, int]]  # batch row -> flat [start, end) wanting logits


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [len(sample_rows), V] float32
    prompt_logits: dict[int, torch.Tensor]  # batch row -> [n, V] float32


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batches run in the smallest captured size that holds them; the padding is wasted work."""
    sizes = [1, 2, 4, 8] + list(range(16, 256, 16)) + list(range(256, max_num_seqs, 32))
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


class ModelRunner:
    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, num_blocks: int,
                 kv_dtype: torch.dtype, max_model_len: int, device: torch.device) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-max_model_len // config.block_size)
        self.kv_caches: list[LayerKVCache] = allocate_kv_cache(
            model.spec, num_blocks, config.block_size, device, kv_dtype
        )
        self.graphs: dict[int, _DecodeGraph] = {}
        self._staging: dict[torch.dtype, torch.Tensor] = {}
        # The torch attention path sizes tensors from the batch's lengths, so it cannot be captured.
        if device.type == "cuda" and not config.enforce_eager and config.attention_backend != "torch":
            self._capture_graphs()

    # ---- inputs --------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch) -> ModelInput:
        """Flatten the batch into token-level arrays; two host-to-device copies in all."""
        bs = self.block_size
        input_ids, positions, slots = [], [], []
        query_lens, seq_lens, sample_rows, logits_indices = [], [], [], []
        prompt_spans: dict[int, tuple[int, int]] = {}
        for row, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            table, offset = seq.block_table, len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(num_new)
            seq_lens.append(end)
            if seq.wants_prompt_logprobs and start < seq.num_prompt_tokens - 1:
                prompt_spans[row] = (offset, offset + min(end, seq.num_prompt_tokens - 1) - start)
            if end == seq.num_tokens:
                sample_rows.append(row)
                logits_indices.append(offset + num_new - 1)
        width = max(len(seq.block_table) for seq in batch.seqs)
        tables = np.zeros((len(batch.seqs), width), dtype=np.int32)
        for row, seq in enumerate(batch.seqs):
            tables[row, : len(seq.block_table)] = seq.block_table
        num_tokens, num_seqs = len(input_ids), len(batch.seqs)
        longs = self._to_device(np.array(input_ids + positions + slots + logits_indices, dtype=np.int64))
        ints = self._to_device(np.concatenate([np.cumsum([0] + query_lens, dtype=np.int32),
                                               np.array(seq_lens, dtype=np.int32), tables.ravel()]))
        meta = AttentionMetadata(
            slot_mapping=longs[2 * num_tokens : 3 * num_tokens],
            query_start_loc=ints[: num_seqs + 1],
            seq_lens=ints[num_seqs + 1 : 2 * num_seqs + 1],
            block_tables=ints[2 * num_seqs + 1 :].view(num_seqs, width),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
        )
        return ModelInput(
            input_ids=longs[:num_tokens],
            positions=longs[num_tokens : 2 * num_tokens],
            meta=meta,
            sample_rows=sample_rows,
            logits_indices=longs[3 * num_tokens :],
            prompt_logit_spans=prompt_spans,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type != "cuda":
            return tensor
        # Reused pinned staging buffers: pinning fresh memory every step costs more than the copy.
        staging = self._staging.get(tensor.dtype)
        if staging is None or staging.numel() < tensor.numel():
            staging = torch.empty(max(tensor.numel(), 1 << 16), dtype=tensor.dtype).pin_memory()
            self._staging[tensor.dtype] = staging
        staging[: tensor.numel()].copy_(tensor)
        return staging[: tensor.numel()].to(self.device, non_blocking=True)

    # ---- execution -----------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, inputs: ModelInput) -> ModelOutput:
        num_seqs = len(inputs.meta.seq_lens_host)
        graph = self._graph_for(inputs, num_seqs)
        if graph is not None:  # decode-only: every sequence samples, in batch order
            return ModelOutput(graph.replay(inputs), {})
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        prompt_logits = {
            row: self.model.compute_logits(hidden[start:end])
            for row, (start, end) in inputs.prompt_logit_spans.items()
        }
        return ModelOutput(logits, prompt_logits)

    def _graph_for(self, inputs: ModelInput, num_seqs: int) -> "_DecodeGraph | None":
        if not self.graphs or not inputs.meta.is_decode_only or inputs.prompt_logit_spans:
            return None
        size = next((s for s in self.graphs if s >= num_seqs), None)
        return self.graphs.get(size) if size is not None else None

    def _capture_graphs(self) -> None:
        sizes = sorted(graph_batch_sizes(self.config.max_num_seqs), reverse=True)
        pool = torch.cuda.graph_pool_handle()
        for size in sizes:  # largest first, so smaller graphs fit in its memory pool
            self.graphs[size] = _DecodeGraph(self, size, pool)
        self.graphs = dict(sorted(self.graphs.items()))


class _DecodeGraph:
    """A CUDA graph of one decode step (forward + logits) for up to `size` sequences."""

    def __init__(self, runner: ModelRunner, size: int, pool) -> None:
        device = runner.device
        self.size = size
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(size, dtype=torch.int32, device=device)  # padding rows attend nothing
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(size, runner.max_blocks_per_seq, dtype=torch.int32, device=device)
        max_len = runner.max_blocks_per_seq * runner.block_size
        self.meta = AttentionMetadata(
            slot_mapping=self.slot_mapping, query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens, block_tables=self.block_tables, max_query_len=1,
            max_seq_len=max_len, query_lens_host=[1] * size, seq_lens_host=[max_len] * size,
        )
        model, caches = runner.model, runner.kv_caches
        with torch.inference_mode():
            for _ in range(2):  # warm up: autotuning and lazy initialization stay out of the graph
                model.compute_logits(model(self.input_ids, self.positions, caches, self.meta))
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                hidden = model(self.input_ids, self.positions, caches, self.meta)
                self.logits = model.compute_logits(hidden)

    def replay(self, inputs: ModelInput) -> torch.Tensor:
        n = len(inputs.meta.seq_lens_host)
        width = inputs.meta.block_tables.shape[1]
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(inputs.meta.slot_mapping)
        self.slot_mapping[n:].fill_(-1)
        self.seq_lens[:n].copy_(inputs.meta.seq_lens)
        self.seq_lens[n:].fill_(0)
        self.block_tables[:n, :width].copy_(inputs.meta.block_tables)
        self.graph.replay()
        return self.logits[:n]
