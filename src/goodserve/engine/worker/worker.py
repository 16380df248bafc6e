"""One device's share of the engine: builds the model, sizes and allocates the KV cache, and runs the
steps the executor hands it through its model runner. Under tensor parallelism there is one per
rank (`rank`): each holds its share of the weights and of the KV heads, and all agree on one number
of KV blocks, since the scheduler's block tables serve them all. Under pipeline parallelism a stage's
workers hold its layers only, and their KV cache those layers' (no CUDA graphs yet: the stages'
hand-off is not captured). A draft model (speculative_model) is the drafter's of one worker: the
one whose output the engine reads (engine/worker/drafter.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from goodserve.config import EngineConfig
from goodserve.engine.worker import distributed
from goodserve.engine.worker.context_parallel import ContextParallel
from goodserve.engine.setup.config_resolution import resolve_for_model, resolve_for_pool, torch_dtype
from goodserve.engine.setup.kv_cache import kv_storage_dtype, num_blocks_for_memory
from goodserve.engine.setup.kv_groups import kv_groups
from goodserve.engine.setup.model_builder import build_model
from goodserve.engine.worker.model_runner import ModelRunner
from goodserve.engine.seam.runner_output import PendingOutput
from goodserve.engine.worker.sampling_inputs import GrammarBitmask
from goodserve.engine.seam.scheduler_output import SchedulerOutput
from goodserve.engine.spec_decode.draft_model import DraftModelProposer, draft_kv_bytes_per_block, load_draft
from goodserve.engine.worker.drafter import Drafter
from goodserve.model.custom_all_reduce import set_up_custom_all_reduce
from goodserve.model.pipeline_parallel import PipelineParallel
from goodserve.model.spec import ModelSpec
from goodserve.model.tensor_parallel import TensorParallel
from goodserve.model.tokenizer import Tokenizer

logger = logging.getLogger("goodserve.engine")


@dataclass
class ModelInfo:
    """What the engine learns from the worker once the model is loaded (plain data)."""

    config: EngineConfig  # resolved for the model and the KV pool
    spec: ModelSpec
    tokenizer: Tokenizer | None
    eos_token_ids: list[int]
    revision: str  # identity of the weights
    cuda_graphs: bool
    # Tensor parallelism's all-reduce: "fused" (small tensors on symmetric memory, those before a norm
    # in its kernel), "custom" (small tensors one-shot on symmetric memory, the rest NCCL), "nccl" or
    # "gloo"; None without tensor parallelism.
    all_reduce: str | None
    # Decode steps run the CPU's native decoder stack (model/native_decode.py); a verify step does not
    native_decode: bool


class Worker:
    def __init__(self, config: EngineConfig, rank: distributed.Rank | None = None) -> None:
        tp, pp, cp = (rank.tp, rank.pp, rank.cp) if rank is not None else \
            (TensorParallel(), PipelineParallel(), ContextParallel())
        if pp.size > 1:
            config = replace(config, enforce_eager=True, async_scheduling=False)
        device = torch.device(config.device)
        if tp.size > 1 and not config.disable_custom_all_reduce:
            tp = replace(tp, custom_all_reduce=set_up_custom_all_reduce(
                tp.group, device, config.kernels.custom_all_reduce_max_bytes, config.kernels.fuse_all_reduce_into_norm))
        loaded = build_model(config, tp, pp)
        config = resolve_for_model(config, loaded.spec)
        kv_dtype = kv_storage_dtype(config, torch_dtype(config))
        local_spec = pp.local_spec(tp.local_spec(loaded.spec))
        # The drafting rank (tensor rank 0 of the last stage, whose output the engine reads) loads the
        # draft's weights before the pool is sized, which then holds as many draft blocks beside its
        # own (the pool is the smallest over the ranks: that rank's).
        drafts = config.speculative_model and tp.rank == 0 and pp.is_last
        draft = load_draft(config, loaded.spec, loaded.tokenizer) if drafts else None
        draft_block = draft_kv_bytes_per_block(config, loaded.spec) if draft is not None else 0
        groups = kv_groups(loaded.spec, config)
        num_blocks = num_blocks_for_memory(local_spec, config, device, torch_dtype(config), kv_dtype, draft_block,
                                           len(groups.slots(pp.layers(loaded.spec.num_layers))))
        if rank is not None:
            num_blocks = distributed.min_over_ranks(num_blocks, rank)
        config = resolve_for_pool(config, num_blocks, groups)
        tokenizer = loaded.tokenizer
        eos = sorted(set(loaded.spec.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else []))
        drafter = Drafter(DraftModelProposer(config, draft)) if draft is not None else None
        self.runner = ModelRunner(config, loaded.model, config.num_kv_blocks, kv_dtype, eos, cp, drafter)
        self.info = ModelInfo(config, loaded.spec, tokenizer, eos, loaded.revision,
                              self.runner.graphs.captured(),
                              _all_reduce_name(tp, device), loaded.model.native_decode is not None)
        logger.info(
            "model %s (%s) dtype=%s device=%s kv_cache=%d blocks x %d tokens (%s)%s max_model_len=%d%s%s%s",
            config.model, loaded.source, config.dtype, device, config.num_kv_blocks, config.block_size,
            str(kv_dtype).removeprefix("torch."),
            f" of {groups.num_groups} layer groups (windows {groups.windows})" if groups.is_hybrid else "",
            config.max_model_len,
            f" tensor-parallel rank {tp.rank}/{tp.size} ({self.info.all_reduce} all-reduce)" if tp.size > 1 else "",
            f" pipeline stage {pp.stage}/{pp.size} (layers {pp.layers(loaded.spec.num_layers)})" if pp.size > 1 else "",
            f" context-parallel rank {cp.rank}/{cp.size}" if cp.size > 1 else "",
        )

    def execute_model(self, out: SchedulerOutput) -> None:
        self.runner.execute_model(out)

    def sample_tokens(self, grammar: GrammarBitmask | None, trial: bool = False) -> PendingOutput:
        return self.runner.sample_tokens(grammar, trial)


def _all_reduce_name(tp: TensorParallel, device: torch.device) -> str | None:
    if tp.size == 1:
        return None
    if tp.custom_all_reduce is not None:
        return "fused" if tp.custom_all_reduce.lamport is not None else "custom"
    return "nccl" if device.type == "cuda" else "gloo"
