"""A draft model proposes: another model that shares the target's vocabulary (`--speculative-model
smollm2-135m | PATH | dummy:<preset>`), or the target's own weights quantized (`self:int4`,
`self:gguf`: on the CPU the native int4 / GGUF kernels run them at a fraction of float32's cost, and
they agree with the target on most tokens).

It runs in a worker, the runner's drafter (engine/worker/drafter.py: after each step, for the next),
with a paged KV cache of its own (draft_kv.py) of as many blocks as the target's pool. Its weights
are loaded before the pool is sized (load_draft), so the target's pool is sized from the memory
they leave, with room for the draft's blocks beside its own (draft_kv_bytes_per_block). Each
proposal, for every speculating sequence at once:
one forward over what its draft cache lacks (the whole prompt the first time; after a
verification the one or two tokens past the accepted drafts), then one forward per further draft.
All of them are decode steps for the attention (a sequence's few new tokens are laid out as
one-token rows over the same block table: every layer writes the step's K/V before it attends),
so on the CPU they take the native one-call-per-step path. Greedy sequences take the draft's argmax
(a point mass); sampled ones draw from the draft's softmax at their temperature and hand over those
distributions for the exact rejection rule (rejection.py). The drafts ignore the target's penalties
and top-k/p: what the draft proposes changes only how many the target accepts, never what it keeps.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from goodserve.config import SELF_DRAFT_PREFIX, EngineConfig
from goodserve.engine.setup.config_resolution import torch_dtype
from goodserve.engine.setup.kv_cache import allocate_kv_cache, bytes_per_block
from goodserve.engine.setup.model_builder import build_model
from goodserve.engine.worker.model_inputs import MAX_SPLIT_TOKENS  # more tokens (a prompt) go as one prefill row
from goodserve.engine.spec_decode.draft_kv import DraftKV
from goodserve.engine.seam.drafts import DraftRequest, Drafts
from goodserve.errors import InvalidRequestError
from goodserve.model.loader import LoadedModel, load_spec
from goodserve.model.spec import ModelSpec
from goodserve.ops.attention import AttentionMetadata
from goodserve.ops.kernel_choice import use_kernels
from goodserve.quant.linear import Int4Linear

SELF_INT4_GROUP_SIZE = 32


def draft_config(config: EngineConfig) -> EngineConfig:
    """The engine config the draft model is built with: the target's device and dtype; self:<q> the
    target's weights quantized q (int4 in groups of 32: on the embedded model groups of 64 kept half
    the drafts, 32 nearly all), another model its own default quantization."""
    name = config.speculative_model
    base = dataclasses.replace(config, speculative_method=None, speculative_model=None, quantized_checkpoint=None,
                               quantization_awq=False, quantization_group_size=None, quantize_lm_head=False)
    if name.startswith(SELF_DRAFT_PREFIX):
        quantization = name.removeprefix(SELF_DRAFT_PREFIX)
        return dataclasses.replace(base, quantization=quantization,
                                   quantization_group_size=SELF_INT4_GROUP_SIZE if quantization == "int4" else None)
    other = dataclasses.replace(base, model=name, tokenizer=None, quantization=None)
    return dataclasses.replace(other, quantization=other.resolved_quantization(torch.device(config.device).type))


def check_vocabulary(name: str, draft: ModelSpec, draft_tokenizer, target: ModelSpec, target_tokenizer) -> None:
    """A draft proposes token ids the target verifies: both must mean the same tokens by them."""
    sizes = (draft.vocab_size, target.vocab_size)
    texts = [tok.vocab_size if tok is not None else None for tok in (draft_tokenizer, target_tokenizer)]
    if sizes[0] != sizes[1] or (None not in texts and texts[0] != texts[1]):
        raise InvalidRequestError(
            f"speculative model {name!r} has a vocabulary of {sizes[0]} tokens (tokenizer: {texts[0]}), the target "
            f"{sizes[1]} (tokenizer: {texts[1]}): a draft model must share the target's tokenizer")


def int4_tied_lm_head(model, group_size: int) -> None:
    """A draft reads its lm_head every step; on the embedded model (49152 x 576) that costs in float32
    (15-25 ms on this project's CPU) as much as all its int4 layers, in int4 3 ms (int8's CPU kernel:
    60). So a tied lm_head, whose float table the embedding keeps, becomes int4 too."""
    if not model.spec.tie_word_embeddings:
        return
    table = model.model.embed_tokens.weight
    head = torch.nn.Linear(table.shape[1], table.shape[0], bias=False, device="meta")
    head.weight = table
    model.lm_head = Int4Linear.from_linear(head, group_size)
    use_kernels(model.lm_head, model.kernels)


def load_draft(config: EngineConfig, target: ModelSpec, target_tokenizer) -> LoadedModel:
    """The draft model the (device-resolved) config names, on its device; refused unless it shares
    the target's vocabulary."""
    built = draft_config(config)
    loaded = build_model(built)
    check_vocabulary(config.speculative_model, loaded.spec, loaded.tokenizer, target, target_tokenizer)
    if built.quantization == "int4" and config.speculative_model.startswith(SELF_DRAFT_PREFIX):
        int4_tied_lm_head(loaded.model, SELF_INT4_GROUP_SIZE)
    return loaded


def draft_kv_bytes_per_block(config: EngineConfig, target: ModelSpec) -> int:
    """What the draft's pool takes per block of the target's (a self-draft has the target's shapes)."""
    name = config.speculative_model
    spec = target if name.startswith(SELF_DRAFT_PREFIX) else load_spec(name)
    return bytes_per_block(spec, config.block_size, torch_dtype(draft_config(config)))


class DraftModelProposer:
    def __init__(self, config: EngineConfig, draft: LoadedModel) -> None:
        """draft: load_draft(config, ...); config: resolved for the pool (num_kv_blocks)."""
        self.model = draft.model
        self.device = torch.device(config.device)
        self.max_positions = draft.spec.max_position_embeddings
        self.kv = DraftKV(config.num_kv_blocks, config.block_size)
        self.kv_caches = allocate_kv_cache(draft.spec, config.num_kv_blocks, config.block_size, self.device,
                                           torch_dtype(draft_config(config)))
        self.generators: dict[str, torch.Generator] = {}  # seeded sequences' own draws

    def release(self, seq_id: str) -> None:
        self.kv.release(seq_id)
        self.generators.pop(seq_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Drafts]:
        drafts = {req.seq_id: Drafts([]) for req in requests}
        # (request, k, tokens to feed next): the first feed is what its draft cache lacks.
        active = []
        for req in requests:
            k = min(req.k, self.max_positions - len(req.token_ids))
            cached = self.kv.keep_common_prefix(req.seq_id, req.token_ids)
            if k > 0 and self.kv.reserve(req.seq_id, len(req.token_ids) + k - 1):
                active.append((req, k, req.token_ids[cached:]))
        sampled = [req for req, _, _ in active if req.temperature > 0]
        probs: dict[str, list[torch.Tensor]] = {req.seq_id: [] for req in sampled}
        for j in range(max((k for _, k, _ in active), default=0)):
            active = [(req, k, feed) for req, k, feed in active if k > j]
            logits = self._forward([(req.seq_id, feed) for req, _, feed in active])
            tokens = self._draw(logits, [req for req, _, _ in active], probs)
            for (req, _, feed), token in zip(active, tokens):
                self.kv.tokens[req.seq_id].extend(feed)
                drafts[req.seq_id].token_ids.append(token)
            active = [(req, k, [token]) for (req, k, _), token in zip(active, tokens)]
        for req in sampled:
            drafts[req.seq_id].probs = torch.stack(probs[req.seq_id]) if probs[req.seq_id] else None
        return [drafts[req.seq_id] for req in requests]

    def _forward(self, rows: list[tuple[str, list[int]]]) -> torch.Tensor:
        """Each row's new tokens (positions after what its draft cache holds) -> logits at its last."""
        split = all(len(feed) <= MAX_SPLIT_TOKENS for _, feed in rows)
        input_ids, positions, slots, query_lens, seq_lens, tables, last = [], [], [], [], [], [], []
        for seq_id, feed in rows:
            start = len(self.kv.tokens[seq_id])
            input_ids += feed
            positions += range(start, start + len(feed))
            slots += (self.kv.slot(seq_id, p) for p in range(start, start + len(feed)))
            pieces = [(1, start + i + 1) for i in range(len(feed))] if split else [(len(feed), start + len(feed))]
            query_lens += (n for n, _ in pieces)
            seq_lens += (end for _, end in pieces)
            tables += [self.kv.tables[seq_id]] * len(pieces)
            last.append(len(input_ids) - 1)
        hidden = self.model(self._tensor(input_ids), self._tensor(positions), self.kv_caches,
                            self._metadata(slots, query_lens, seq_lens, tables))
        return self.model.compute_logits(hidden[self._tensor(last)])

    def _metadata(self, slots: list[int], query_lens: list[int], seq_lens: list[int],
                  tables: list[list[int]]) -> AttentionMetadata:
        width = max(map(len, tables))
        return AttentionMetadata(
            slot_mapping=self._tensor(slots), query_start_loc=self._tensor([0, *itertools.accumulate(query_lens)]),
            seq_lens=self._tensor(seq_lens), block_tables=self._tensor([t + [0] * (width - len(t)) for t in tables]),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_host=query_lens,
            seq_lens_host=seq_lens)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    def _draw(self, logits: torch.Tensor, reqs: list[DraftRequest], probs: dict[str, list[torch.Tensor]]) -> list[int]:
        """Greedy requests: the argmax; sampled ones: a draw from softmax(logits / temperature),
        whose distribution joins probs."""
        tokens = logits.argmax(dim=-1).tolist()
        for i, req in enumerate(reqs):
            if req.seq_id in probs:
                q = (logits[i] / req.temperature).softmax(dim=-1)
                tokens[i] = int(torch.multinomial(q, 1, generator=self._generator(req)))
                probs[req.seq_id].append(q)
        return tokens

    def _generator(self, req: DraftRequest) -> torch.Generator | None:
        """A seeded request draws its drafts from a generator of its own: the same seed, the same run."""
        if req.seed is None:
            return None
        if req.seq_id not in self.generators:
            self.generators[req.seq_id] = torch.Generator(self.device).manual_seed(req.seed % 2**64)
        return self.generators[req.seq_id]
