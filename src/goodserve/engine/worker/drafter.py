"""The runner's drafter: a draft model (engine/spec_decode/draft_model.py) that, once the runner has
sampled a step, proposes the next step's drafts for the rows the scheduler planned
(SchedulerOutput.num_next_drafts) and hands them back in the step's output
(ModelRunnerOutput.spec_token_ids), as vLLM v1's workers do; the scheduler reads them next step.
The distributions it sampled drafts from stay here, beside the verifier that needs them
(draft_probs): they never cross a process.

It keeps each sequence's tokens as the runner sampled them (its prompt, then what each step kept),
so the draft model needs nothing from the scheduler but the plan. Kept tokens the scheduler does
not append (past a stop token) end their sequence, which then leaves (finished_seq_ids); a
preempted sequence's draft K/V go (preempted_seq_ids), its tokens stay.

One rank drafts: the one whose output the engine reads (tensor rank 0 of the last pipeline stage,
worker.py). The other ranks verify sampled drafts as point masses, and nobody reads what they keep
(they take rank 0's sampled tokens for the next step's inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from goodserve.engine.seam.drafts import DraftRequest, Drafts
from goodserve.engine.seam.scheduler_output import SchedulerOutput
from goodserve.engine.spec_decode.draft_model import DraftModelProposer


@dataclass
class _Drafting:
    """What the drafter keeps of a sequence: its tokens, and what its draws depend on."""

    token_ids: list[int]  # the prompt, then each step's kept tokens
    temperature: float
    seed: int | None  # its request's seed plus its index: its drafts' own generator


class Drafter:
    def __init__(self, proposer: DraftModelProposer) -> None:
        self.proposer = proposer
        self.seqs: dict[str, _Drafting] = {}
        self.proposed: dict[str, Drafts] = {}  # after the last step, for the next, by sequence id

    def update(self, out: SchedulerOutput) -> None:
        """The step's news (idempotent, as the runner's own): sequences to keep, to drop, whose
        draft K/V to free."""
        for seq_id in out.finished_seq_ids:
            self.seqs.pop(seq_id, None)
            self.proposed.pop(seq_id, None)
        for seq_id in (*out.finished_seq_ids, *out.preempted_seq_ids):
            self.proposer.release(seq_id)
        for new in out.new_requests:
            if new.seq_id not in self.seqs:
                seed = None if new.params.seed is None else new.params.seed + new.index
                self.seqs[new.seq_id] = _Drafting(list(new.prompt_token_ids), new.params.temperature, seed)

    def draft_probs(self, out: SchedulerOutput, rows: list[int]) -> dict[int, torch.Tensor]:
        """row -> [k, vocab]: the distributions the k drafts it verifies were sampled from (rows whose
        drafts are a point mass, the draft model's argmax: none). A row verifies the first k of the
        drafts proposed for it after the last step."""
        found = {}
        for row in rows:
            drafts, proposed = out.draft_token_ids.get(row), self.proposed.get(out.seq_ids[row])
            if drafts and proposed is not None and proposed.probs is not None:
                if proposed.token_ids[: len(drafts)] != drafts:  # a sampled draft verified by the wrong rule: wrong tokens
                    raise RuntimeError(f"sequence {out.seq_ids[row]} verifies drafts its drafter did not propose")
                found[row] = proposed.probs[: len(drafts)]
        return found

    def propose(self, out: SchedulerOutput, rows: list[int], kept: list[list[int]]) -> dict[int, list[int]]:
        """After a step: per planned row, drafts to follow its sequence's tokens and the row's kept
        ones; then every sampled row's kept tokens join its sequence's (only once the proposals are
        made: a step that fails is run again). A row run ahead of its sequence's finish (async
        scheduling: never a planned one) may find it gone."""
        wanted, seqs = [], [self.seqs.get(seq_id) for seq_id in map(out.seq_ids.__getitem__, rows)]
        for row, seq, row_kept in zip(rows, seqs, kept):
            if seq is not None and (k := out.num_next_drafts.get(row)):
                wanted.append((row, DraftRequest(out.seq_ids[row], seq.token_ids + row_kept, k, seq.temperature,
                                                 seq.seed)))
        proposals = self.proposer.propose([request for _, request in wanted]) if wanted else []
        for seq, row_kept in zip(seqs, kept):
            if seq is not None:
                seq.token_ids.extend(row_kept)
        self.proposed = {request.seq_id: drafts for (_, request), drafts in zip(wanted, proposals)}
        return {row: drafts.token_ids for (row, _), drafts in zip(wanted, proposals) if drafts.token_ids}
