"""A step while the scheduler decides it (which sequences, how many tokens each, their drafts), and
the decision as plain data for the runner (engine/seam/scheduler_output.py)."""

from __future__ import annotations

from goodserve.config import EngineConfig
from goodserve.engine.core.sequence import Sequence
from goodserve.engine.seam.drafts import Drafts
from goodserve.engine.seam.scheduler_output import SchedulerOutput


class StepDecision:
    """The sequences a step computes and how many tokens each, while it is being decided."""

    def __init__(self, num_ahead: int = 0, max_rows: int | None = None, busy: frozenset[str] = frozenset()) -> None:
        self.seqs: list[Sequence] = []
        self.max_rows = max_rows  # pipeline micro-batches: each takes its share of the sequences
        self.busy = busy  # ids of sequences another micro-batch in flight computes: not this step's
        self.num_new: list[int] = []  # drafts included
        self.drafts: list[Drafts | None] = []
        self.num_ahead = num_ahead
        self.preempted = False

    @classmethod
    def micro_batch(cls, busy: list[Sequence], num_unfinished: int, config: EngineConfig) -> StepDecision:
        """A pipeline micro-batch: it leaves the sequences of the steps in flight in the stages alone
        and takes its share of what the stages could hold in flight together."""
        share = -(-min(num_unfinished, config.max_num_seqs) // config.pipeline_parallel_size) or 1
        return cls(max_rows=share, busy=frozenset(seq.seq_id for seq in busy))

    @property
    def full(self) -> bool:
        return self.max_rows is not None and len(self.seqs) >= self.max_rows

    def add(self, seq: Sequence, num_new: int, drafts: Drafts | None = None) -> None:
        self.seqs.append(seq)
        self.num_new.append(num_new)
        self.drafts.append(drafts)

    def first_victim(self, running: list[Sequence], victim_key) -> Sequence:
        """The running sequence to preempt first, by the policy's victim_key: of those neither in this
        step nor in a micro-batch in flight (the one that asks for blocks is neither: there is one)."""
        return max((s for s in running if s not in self.seqs and s.seq_id not in self.busy), key=victim_key)

    def output(self, tables: dict[str, list[int]]) -> SchedulerOutput:
        """The decision as plain data: each row's tokens to compute, its block table (of the KV
        manager's tables), whether it samples."""
        out = SchedulerOutput(num_ahead=self.num_ahead)
        for row, (seq, num_new, drafts) in enumerate(zip(self.seqs, self.num_new, self.drafts)):
            draft_ids = drafts.token_ids if drafts else []
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new - len(draft_ids)
            ahead = row < self.num_ahead
            out.seq_ids.append(seq.seq_id)
            out.num_new_tokens.append(num_new)
            out.num_computed_tokens.append(start)
            out.token_ids.append([] if ahead else seq.token_ids[start:end] + draft_ids)
            out.block_tables.append(list(tables[seq.seq_id]))
            out.samples.append(ahead or (end == seq.num_tokens and not seq.params.prefill_only))
            if draft_ids:
                out.draft_token_ids[row] = draft_ids
            if drafts and drafts.branch is not None:
                out.branches[row] = drafts.branch
            out.num_output_tokens.append(seq.num_output_tokens)
            if seq.counts_output_tokens:
                out.penalty_token_ids[row] = seq.output_token_ids
        return out
