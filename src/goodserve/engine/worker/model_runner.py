"""Executes one scheduled step on the device: flattens the scheduler's rows into input tensors, runs
the model, samples.

The runner owns the model, its KV cache, the persistent input buffers (pinned staging on the host,
a captured graph's own buffer on the device), the CUDA graphs (engine/worker/cuda_graphs.py), the sampler,
per sequence what sampling needs for its whole life (model_inputs.RequestState), and, with a draft
model, the drafter (engine/worker/drafter.py) that proposes after each step for the next. It reads
plain data (engine/seam/scheduler_output.py) and gives back plain data (engine/seam/runner_output.py),
so it can live in a worker process (engine/worker/worker.py).

A step is two calls: execute_model launches the forward; sample_tokens, given the grammar bitmask
the engine filled meanwhile, samples and starts copying the tokens to the host. The tokens also
stay on the device, where a step scheduled ahead of them (async scheduling) takes its first rows'
inputs without waiting for the host. Either way a step's inputs reach the device in one
host-to-device copy: they are all int32, laid out in a pinned staging buffer exactly as the device
tensors that read them.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace

import torch

from goodserve.config import EngineConfig
from goodserve.engine.worker.context_parallel import ContextParallel, LocalShare
from goodserve.engine.worker.cuda_graphs import StepGraphs, capture_graphs, graph_for
from goodserve.engine.worker.drafter import Drafter
from goodserve.engine.worker.isolation import rewind_generators
from goodserve.engine.setup.kv_cache import allocate_kv_cache
from goodserve.engine.setup.kv_groups import kv_groups
from goodserve.engine.worker.input_layout import InputLayout
from goodserve.engine.worker.model_inputs import (
    FlatBatch, ModelInput, ModelOutput, RequestState, as_one_token_rows, flatten, leading_decodes, pooled_sums,
    token_slots)
from goodserve.engine.seam.runner_output import ModelRunnerOutput, PendingOutput
from goodserve.engine.worker.sampling_inputs import GrammarBitmask, SamplingRow, build_sampling_batch
from goodserve.engine.seam.scheduler_output import SchedulerOutput
from goodserve.engine.spec_decode.acceptance import kept_tokens
from goodserve.engine.seam.drafts import BranchOutput
from goodserve.engine.spec_decode.rejection import kept_by_rejection
from goodserve.model.llama import LlamaForCausalLM
from goodserve.ops.attention import AttentionMetadata, LayerKVCache, with_kv_groups
from goodserve.ops.sampler import SamplerOutput, gather_logprobs, sample
from goodserve.ops.tree_attention import BranchTree, SideBranches, tree_mask
from goodserve.quant.linear import CPU_NATIVE_MAX_M


@dataclass
class _Launched:
    """A step between execute_model and sample_tokens."""

    out: SchedulerOutput
    inputs: ModelInput
    output: ModelOutput
    prepare_s: float
    launch_s: float


class ModelRunner:
    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, num_blocks: int, kv_dtype: torch.dtype,
                 eos_token_ids: list[int], cp: ContextParallel = ContextParallel(), drafter: Drafter | None = None) -> None:
        self.config = config
        self.model = model
        self.drafter = drafter  # a draft model's proposals, on the rank whose output the engine reads
        self.cp = cp  # context parallelism: prefills split over the ranks (engine/worker/context_parallel.py)
        self.device = device = torch.device(config.device)
        self.block_size = config.block_size
        self.kv_groups = groups = kv_groups(model.spec, config)
        # A table's entries: a block of each group per block of tokens (engine/core/kv_cache_manager.py).
        self.max_blocks_per_seq = -(-config.max_model_len // config.block_size) * groups.num_groups
        self.vocab_size = model.spec.vocab_size
        self.eos_token_ids = eos_token_ids
        assert num_blocks * config.block_size < 2**31, "slot numbers must fit int32"
        # This rank's KV heads (all of them at TP=1) of its stage's layers (all at PP=1), in blocks the
        # scheduler numbers for every rank.
        self.kv_caches: list[LayerKVCache] = allocate_kv_cache(
            model.pp.local_spec(model.tp.local_spec(model.spec)), num_blocks, config.block_size, device, kv_dtype,
            groups, model.pp.layers(model.spec.num_layers))
        self.requests: dict[str, RequestState] = {}
        self._launched: _Launched | None = None
        # The last step's sampled tokens on the device, and the sequences they belong to, in order.
        self._last_sampled: tuple[list[str], torch.Tensor] | None = None
        # Two sets of host buffers, used in turn: with async scheduling a step is prepared while the
        # last one's copies may still be queued behind the step before it. Staging holds a step's
        # int32 inputs; tokens holds row 0: sampled tokens out (one per position that samples), row
        # 1: row indices in.
        cuda = device.type == "cuda"
        self._staging = [torch.empty(0, dtype=torch.int32)] * 2
        max_samples = config.max_num_seqs * (1 + (config.num_speculative_tokens if config.speculative_method else 0))
        self._tokens = [torch.zeros(2, max_samples, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._copied = [torch.cuda.Event() for _ in range(2)] if cuda else [None, None]
        self._turn = 0
        self.graphs = StepGraphs()
        # The torch attention path sizes tensors from the batch's lengths, so it cannot be captured.
        if cuda and num_blocks >= 3 * groups.num_groups:
            self._warm_up_eager_kernels()
            torch.cuda.synchronize(device)
        if cuda and not config.enforce_eager and model.kernels.triton:
            self.graphs = capture_graphs(self)

    def _warm_up_eager_kernels(self) -> ModelOutput:
        """One eager step of a prefill chunk beside a decode, so the Triton kernels of the eager path
        (prefill attention above all) compile now, not in the first requests' time to first token
        (about a second on an H100). It writes K/V into blocks 0-2 of each group, which hold nothing yet."""
        bs, prefill_len, groups = self.block_size, self.block_size + 3, self.kv_groups.num_groups
        tables = [[*range(2 * groups)], [*range(2 * groups, 3 * groups)]]  # 2 blocks of tokens, then 1
        slots = [slot for g in range(groups) for slot in token_slots(tables[0], 0, prefill_len, bs, groups, g)
                 + token_slots(tables[1], 4, 5, bs, groups, g)]
        flat = FlatBatch(
            input_ids=[0] * (prefill_len + 1), positions=[*range(prefill_len), 4],
            slots=slots, query_lens=[prefill_len, 1],
            seq_lens=[prefill_len, 5], block_tables=tables, sample_rows=[0, 1],
            logits_indices=[prefill_len - 1, prefill_len], prompt_logit_spans={})
        return self.forward(self._eager_input(flat))

    # ---- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> None:
        """Build the step's inputs and launch its forward."""
        t0 = time.perf_counter()
        self._update_requests(out)
        self._turn ^= 1
        flat = flatten(out, self.requests, self.block_size, self.kv_groups.num_groups)
        share = self.cp.split(flat, self.device)
        inputs = self._prepare(flat) if share is None else self._share_input(share)
        if out.num_ahead and (share is None or self.cp.rank == 0):  # rank 0 holds the decodes of a split step
            self._take_last_sampled(out, inputs)
        t1 = time.perf_counter()
        self._launched = _Launched(out, inputs, self.forward(inputs), t1 - t0, time.perf_counter() - t1)

    @torch.inference_mode()
    def sample_tokens(self, grammar: GrammarBitmask | None = None, trial: bool = False) -> PendingOutput:
        """Sample the launched step's tokens and start their copy to the host. trial: a run that
        keeps nothing (the seeded generators give their noise back)."""
        step, self._launched = self._launched, None
        t0 = time.perf_counter()
        out, rows = step.out, step.inputs.sample_rows
        drafts = [out.draft_token_ids.get(r, []) for r in rows]
        # A trial verifies sampled drafts as point masses: the rejection rule would draw on seeded generators.
        drafting = self.drafter is not None and out.draft_token_ids and not trial
        draft_probs = self.drafter.draft_probs(out, rows) if drafting else {}
        sampled, seeded = None, []
        if rows and self.model.pp.is_last:  # stages before the last have no logits: rank 0 takes the last's output
            sampling = build_sampling_batch(_sampling_rows(out, rows, drafts, self.requests), self.vocab_size,
                                            self.device, self.eos_token_ids, _per_position(grammar, drafts))
            if not trial and not sampling.all_greedy and out.draft_token_ids:
                seeded = _seeded_drafting_rows(rows, drafts, out, draft_probs, self.requests)
            with rewind_generators(sampling, always=trial):
                sampled = sample(step.output.logits, sampling, self.model.kernels, step.output.logits_argmax)
            # Every rank samples from the same gathered logits; rank 0's tokens are the ones the engine
            # gets, and the others take them too, so a token that feeds the next step from the device
            # (async scheduling) is the same on every rank whatever their random streams did.
            self.model.tp.broadcast_from_first(sampled.token_ids)
            self.cp.broadcast_from_first(sampled.token_ids)
            # A copy of its own: the next replay of the same graph overwrites the graph's argmax buffer.
            sampled.token_ids = sampled.token_ids.clone()
            if not trial:
                self._last_sampled = ([out.seq_ids[r] for r in rows], sampled.token_ids)
        host_tokens = self._tokens[self._turn][0, : len(rows) + sum(map(len, drafts))]
        if sampled is not None:
            host_tokens.copy_(sampled.token_ids, non_blocking=True)
        # Recorded for every step, sampling or not: waiting for it is what keeps the host from reusing
        # a staging buffer whose copy to the device is still queued (two steps later).
        copied = self._copied[self._turn]
        if copied is not None:
            copied.record()
        prompt_logprobs = self._prompt_logprobs(out, step.output)
        sample_s = time.perf_counter() - t0

        def fetch() -> ModelRunnerOutput:
            t1 = time.perf_counter()
            if copied is not None:
                copied.synchronize()
            host = host_tokens.tolist()
            kept = kept_tokens(host, drafts)
            _draw_as_if_not_drafted(seeded, kept, self.vocab_size)
            if draft_probs:
                _verify_sampled_drafts(kept, sampled.probs, host, rows, drafts, out, draft_probs, self.requests)
            output = ModelRunnerOutput(
                rows, kept, _sampled_logprobs(sampled, step.output.logits, rows, drafts, kept, out, draft_probs,
                                              self.requests),
                {row: (first, *(t.tolist() for t in lists)) for row, (first, *lists) in prompt_logprobs.items()},
                {row: total.cpu() for row, total in step.output.pooled.items()},
                step.prepare_s, step.launch_s + time.perf_counter() - t1, sample_s,
                branches=_branch_outputs(out, step.output.branch_argmax, host, rows, drafts),
                context_parallel=step.inputs.shared_logit_rows is not None)
            if self.drafter is not None and not trial:  # the next step's drafts, from the tokens just kept
                t2 = time.perf_counter()
                output.spec_token_ids = self.drafter.propose(out, rows, kept)
                output.propose_s = time.perf_counter() - t2
            return output

        return PendingOutput(fetch, replayed_graph=step.inputs.graph is not None)

    def _update_requests(self, out: SchedulerOutput) -> None:
        """Idempotent: a retried step carries the same news again."""
        if self.drafter is not None:
            self.drafter.update(out)
        for seq_id in out.finished_seq_ids:
            self.requests.pop(seq_id, None)
        for new in out.new_requests:
            if new.seq_id not in self.requests:
                self.requests[new.seq_id] = RequestState(
                    new.seq_id, new.params, new.prompt_token_ids, new.params.prompt_logprobs is not None and new.index == 0,
                    self._generator(new.params.seed, new.index))

    def _generator(self, seed: int | None, index: int) -> torch.Generator | None:
        if seed is None:
            return None
        # manual_seed takes 64 bits; negative seeds wrap as it wraps them itself
        return torch.Generator(device=self.device).manual_seed((seed + index) % 2**64)

    def _take_last_sampled(self, out: SchedulerOutput, inputs: ModelInput) -> None:
        """The ahead rows' input tokens: the last step's samples, still on the device. Decodes lead
        the batch, a token each; the copy follows the inputs' own on the same stream."""
        seq_ids, tokens = self._last_sampled
        ahead = out.seq_ids[: out.num_ahead]
        if ahead != seq_ids[: out.num_ahead]:
            where = {seq_id: i for i, seq_id in enumerate(seq_ids)}
            index = self._tokens[self._turn][1, : out.num_ahead]
            index.numpy()[:] = [where[seq_id] for seq_id in ahead]
            tokens = tokens.index_select(0, index.to(self.device, non_blocking=True))
        inputs.input_ids[: out.num_ahead].copy_(tokens[: out.num_ahead])

    def _prompt_logprobs(self, out: SchedulerOutput, output: ModelOutput) -> dict[int, tuple]:
        """row -> (index of the first prompt token predicted, values, ids, ranks) on the device.
        Logits at position p predict token p + 1; a chunk starts at its first uncomputed position (0
        again after a preemption, which recomputes the prompt)."""
        found = {}
        for row, logits in output.prompt_logits.items():
            state = self.requests[out.seq_ids[row]]
            first = out.num_computed_tokens[row] + 1
            targets = torch.tensor(state.prompt_token_ids[first : first + logits.shape[0]], device=logits.device)
            found[row] = (first, *gather_logprobs(logits, targets, state.params.prompt_logprobs))
        return found

    # ---- inputs --------------------------------------------------------------------------
    def _prepare(self, flat: FlatBatch) -> ModelInput:
        """The batch's input tensors on the device, in one host-to-device copy."""
        if self.model.native_decode is not None and len(flat.input_ids) <= CPU_NATIVE_MAX_M:
            flat = as_one_token_rows(flat)  # verify rows too then run the native decode stack
        graph = None if flat.branches else graph_for(flat, self.graphs)
        if graph is not None:
            return graph.load(flat, self._staging_buffer(graph.layout.used(flat)))
        return self._eager_input(flat)

    def _eager_input(self, flat: FlatBatch) -> ModelInput:
        """The batch in the step input layout (engine/worker/input_layout.py), sized to it exactly."""
        num_tokens, num_seqs = len(flat.input_ids), len(flat.seq_lens)
        layout = InputLayout(num_tokens, num_seqs, max(map(len, flat.block_tables)), self.kv_groups.num_groups)
        host = self._staging_buffer(layout.size)[: layout.size]
        layout.pack(flat, host.numpy())
        views = layout.views(host.to(self.device, non_blocking=True) if self.device.type == "cuda" else host)
        meta = AttentionMetadata(
            slot_mapping=views.slot_mapping[0, :num_tokens], query_start_loc=views.query_start_loc[: num_seqs + 1],
            seq_lens=views.seq_lens[:num_seqs], block_tables=views.block_tables[:num_seqs],
            max_query_len=max(flat.query_lens), max_seq_len=max(flat.seq_lens), query_lens_host=flat.query_lens,
            seq_lens_host=flat.seq_lens, num_leading_decodes=leading_decodes(flat.query_lens)
            if self.config.kernels.decode_kernel_for_mixed_decodes else 0,
        )
        meta = with_kv_groups(meta, views.slot_mapping[:, :num_tokens], views.block_tables[:num_seqs])
        if flat.branches:
            meta = _with_branches(meta, flat)
        return ModelInput(views.input_ids[:num_tokens], views.positions[:num_tokens], meta, flat.sample_rows,
                          views.logits_indices[: len(flat.logits_indices)], flat.prompt_logit_spans,
                          pooling_spans=flat.pooling_spans, branch_logit_rows=flat.branch_logit_rows)

    def _share_input(self, share: LocalShare) -> ModelInput:
        """This rank's share of a split step (always eager: its layers exchange K/V)."""
        inputs = self._eager_input(share.flat)
        inputs.meta = replace(inputs.meta, kv_exchange=share.kv_exchange)
        inputs.shared_logit_rows = share.num_logit_rows
        return inputs

    def _staging_buffer(self, count: int) -> torch.Tensor:
        """A reusable int32 host buffer of >= count entries, pinned on CUDA (pinning fresh memory every
        step costs more than the copy). Reuse is safe: steps alternate between two buffers, and the
        engine has the results of step N-1 (so its copy has landed) before it prepares step N+1."""
        if self._staging[self._turn].numel() < count:
            self._staging[self._turn] = torch.empty(max(count, 1 << 16), dtype=torch.int32,
                                                    pin_memory=self.device.type == "cuda")
        return self._staging[self._turn]

    # ---- execution -----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, inputs: ModelInput) -> ModelOutput:
        if inputs.graph is not None:
            return inputs.graph.run(inputs)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if hidden is None:  # a stage before the last: its output went to the next stage
            return ModelOutput(None, {})
        rows = hidden[inputs.logits_indices]
        if inputs.shared_logit_rows is not None:
            rows = self.cp.from_first(rows, inputs.shared_logit_rows)
        logits = self.model.compute_logits(rows)
        prompt_logits = {
            row: self.model.compute_logits(hidden[start:end])
            for row, (start, end) in inputs.prompt_logit_spans.items()
        }
        branch_argmax = self.model.compute_logits(hidden[inputs.branch_logit_rows]).argmax(dim=-1) \
            if inputs.branch_logit_rows else None
        return ModelOutput(logits, prompt_logits, pooled=pooled_sums(hidden, inputs.pooling_spans),
                           branch_argmax=branch_argmax)


def _with_branches(meta: AttentionMetadata, flat: FlatBatch) -> AttentionMetadata:
    """meta (for all tokens) as the rows' own metadata plus the side branches after them."""
    num_own = flat.num_own_tokens
    main = replace(meta, slot_mapping=meta.slot_mapping[:num_own])
    trees = [BranchTree(row, first - num_own, first - num_own + len(parents), context_len, tree_mask(parents))
             for row, first, context_len, parents in flat.branches]
    return replace(main, slot_mapping=meta.slot_mapping, branches=SideBranches(num_own, main, trees))


def _branch_outputs(out: SchedulerOutput, branch_argmax: torch.Tensor | None, sampled: list[int], rows: list[int],
                    drafts: list[list[int]]) -> dict[int, BranchOutput]:
    """Per row with a branch: the greedy tokens after its branch's logit rows (in the order the
    branches were laid out), and its samples at its last token and each draft."""
    if not out.branches:
        return {}
    greedy, samples, at = branch_argmax.tolist(), {}, 0
    for row, row_drafts in zip(rows, drafts):
        samples[row] = sampled[at : at + 1 + len(row_drafts)]
        at += 1 + len(row_drafts)
    found, at = {}, 0
    for row, branch in out.branches.items():
        found[row] = BranchOutput(greedy[at : at + len(branch.logit_rows)], samples.get(row, []))
        at += len(branch.logit_rows)
    return found


def _sampling_rows(out: SchedulerOutput, rows: list[int], drafts: list[list[int]],
                   requests: dict[str, RequestState]) -> list[SamplingRow]:
    """One per position that samples: a row with k drafts samples at 1 + k positions, position j as if
    its first j drafts were already output (penalties count them, min_tokens is j tokens nearer)."""
    seq_ids, num_output, penalized = out.seq_ids, out.num_output_tokens, out.penalty_token_ids
    if not out.draft_token_ids:  # a position a row: one comprehension
        return [SamplingRow(requests[seq_ids[row]], num_output[row], penalized.get(row)) for row in rows]
    found = []
    for row, row_drafts in zip(rows, drafts):
        state, tokens = requests[seq_ids[row]], penalized.get(row)
        for j in range(1 + len(row_drafts)):
            found.append(SamplingRow(state, num_output[row] + j, None if tokens is None else tokens + row_drafts[:j]))
    return found


def _per_position(grammar: GrammarBitmask | None, drafts: list[list[int]]) -> GrammarBitmask | None:
    """The grammar masks' rows among the sampled positions (a sequence with a grammar never drafts)."""
    if grammar is None or not any(drafts):
        return grammar
    first = [0, *itertools.accumulate(1 + len(d) for d in drafts)]
    return GrammarBitmask(grammar.bitmask, [first[i] for i in (grammar.rows or range(len(drafts)))])


def _seeded_drafting_rows(rows: list[int], drafts: list[list[int]], out: SchedulerOutput,
                          draft_probs: dict[int, torch.Tensor],
                          requests: dict[str, RequestState]) -> list[tuple[int, torch.Generator, torch.Tensor]]:
    """(index, generator, state before sampling) of the drafting rows with a seed and point-mass
    drafts (the rejection rule of sampled drafts draws on from where sampling left the generator)."""
    found = []
    for i, (row, row_drafts) in enumerate(zip(rows, drafts)):
        generator = requests[out.seq_ids[row]].generator
        if row_drafts and generator is not None and row not in draft_probs:
            found.append((i, generator, generator.get_state()))
    return found


def _draw_as_if_not_drafted(seeded: list, kept: list[list[int]], vocab_size: int) -> None:
    """A seeded row drew noise for each of its 1 + k positions; plain decoding would have drawn it for
    the tokens it kept only. Set its generator where plain decoding leaves it, so a seed samples the
    same tokens with or without speculation (the noise of position j is the j-th draw either way)."""
    for i, generator, state in seeded:
        generator.set_state(state)
        for _ in kept[i]:
            torch.empty(vocab_size, device=generator.device).exponential_(generator=generator)


def _verify_sampled_drafts(kept: list[list[int]], probs: torch.Tensor, sampled: list[int], rows: list[int],
                           drafts: list[list[int]], out: SchedulerOutput, draft_probs: dict[int, torch.Tensor],
                           requests: dict[str, RequestState]) -> None:
    """The rows whose drafts a draft model sampled (from draft_probs[row]) keep what the rejection
    rule keeps (in place); the target's own sample at the position after their drafts is the bonus token."""
    at = 0
    for i, (row, row_drafts) in enumerate(zip(rows, drafts)):
        end = at + len(row_drafts)
        if row in draft_probs:
            kept[i] = kept_by_rejection(probs[at : end + 1], draft_probs[row], row_drafts, sampled[end],
                                        requests[out.seq_ids[row]].generator)
        at = end + 1


def _sampled_logprobs(sampled: SamplerOutput | None, logits: torch.Tensor, rows: list[int], drafts: list[list[int]],
                      kept: list[list[int]], out: SchedulerOutput, draft_probs: dict[int, torch.Tensor],
                      requests: dict[str, RequestState]) -> dict[int, list[tuple[list[float], list[int], int]]]:
    """Per sampled row that asked for logprobs: per kept token, its logprob and its top alternatives'.
    A row verifying sampled drafts may keep tokens other than the sampler's: those are looked up."""
    if sampled is None or sampled.logprobs is None:
        return {}
    values, ids, ranks = sampled.logprobs.tolist(), sampled.logprob_token_ids.tolist(), sampled.ranks.tolist()
    found, at = {}, 0
    for i, (row, row_drafts, tokens) in enumerate(zip(rows, drafts, kept)):
        num_top = requests[out.seq_ids[row]].params.logprobs
        if num_top is not None and row in draft_probs:
            own = gather_logprobs(logits[at : at + len(tokens)], torch.tensor(tokens, device=logits.device), num_top)
            found[i] = list(zip(*(t.tolist() for t in own)))
        elif num_top is not None:
            found[i] = [(values[p][: 1 + num_top], ids[p][: 1 + num_top], ranks[p])
                        for p in range(at, at + len(tokens))]
        at += 1 + len(row_drafts)
    return found
