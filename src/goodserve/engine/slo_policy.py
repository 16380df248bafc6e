"""The "slo" scheduler policy: serve each request within its latency targets, not first come first served.

A request may carry targets (SamplingParams.slo_ttft_ms, slo_tpot_ms; the server fills in its
--slo-ttft-ms / --slo-tpot-ms where the body sets none). The policy acts on them in these places:

- Waiting order: by slack, i.e. by the latest time the request can start and still meet its TTFT,
  deadline - predicted prefill time (the step-time model, engine/step_time_model.py), after the
  priority. A preempted request that already answered resumes first; one without a TTFT target
  comes after every one with a target. A request whose latest start has passed cannot meet its
  target any more: it moves behind those that still can (serving it first would make them late too,
  the domino effect of earliest-deadline-first under overload) and is served, FCFS, when they are.
- Prefill cap: the prompt tokens mixed into a step are capped so that the step, by the fitted model,
  lasts no longer than every running decode with a TPOT target can absorb. The target is a mean
  over the request's tokens, so a step may outlast it by what the decode's tokens so far saved and
  what its next TPOT_HORIZON tokens (no more than it may still generate), at the fitted decode-only
  step time, will save: while decode steps run well under the targets the cap rarely binds, and as a
  large batch brings them near, prompt tokens give way. At least TPOT_MARGIN x the target, and at
  least MIN_PREFILL_CHUNK tokens, so prompts always progress; without a fit or a target, no cap.
- Concurrency: a sequence joins the running ones only while a decode step with one more row, by the
  fitted model, lasts within TPOT_MARGIN x the tightest TPOT target among them and it
  (`max_running`); max_num_seqs stays the ceiling (CUDA graphs are captured up to it, memory). A
  fixed max_num_seqs is either too low (on the H100 at 256, FCFS's queue waited seconds for a slot
  while steps took 28 ms against a 50 ms target) or, past capacity, lets TPOT grow without bound.
  Batch lines (no targets) take slots up to the same limit and give theirs up to an online request
  that needs one (Scheduler._displaced_running). Without a fit or a TPOT target: max_num_seqs.
- Preemption victim: the running request with the most slack (its TPOT budget ahead of the tokens
  it has produced, or its TTFT slack while it prefills), after the priority (batch lines first).
- Background share: requests without targets (batch lines) fill what targeted ones leave, but while
  a targeted one runs they may lengthen a step by BACKGROUND_SHARE of its targeted work at most (half
  in decode rows, half in prompt tokens). Without the bound the prefill cap spent the online decodes'
  TPOT slack on batch prompts: on the H100 a 64-line batch job took the online median TPOT from 12 to
  22 ms, online requests held their sequence slots that much longer, and the slots ran out.

The server's admission check (server/admission.py) reads the same model through `forecast` to
refuse, with 429, a request whose TTFT the queue ahead of it already makes impossible. What the new
request will see: slots up to `max_running`, a batch line's counted free; steps of the targeted rows
and the batch rows' background share (not every running row); of the prompts the server counts as
waiting, only those ahead of it (not yet computed, not late, not of a lower priority); and half the
step in flight first. Before, it counted the computed part of prompts being prefilled (refusing
some it could serve) and left out the step in flight (admitting some that then missed): on
cpu_slo_sim.py's long-prompt workload at 4 req/s, 186 refused and 49 served late before, 210 and 5
after (attainment 76.5 -> 78.5%).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from goodserve.engine.sequence import Sequence
from goodserve.engine.step_time_model import StepTimeFit, StepTimeModel
from goodserve.engine.waiting_queue import WaitingQueue

TPOT_MARGIN = 0.9  # aim a mixed step this far under the TPOT target: the fit is an average
MIN_PREFILL_CHUNK = 64
TPOT_HORIZON = 16  # tokens after a step over which a decode's mean time per token may recover
BACKGROUND_SHARE = 0.2  # of a step's targeted work, what untargeted work may add while it runs
_UNBOUNDED = 1 << 30


@dataclass(frozen=True)
class SloForecast:
    """What the admission check needs from the engine, published by its thread after every step."""

    fit: StepTimeFit | None
    decode_rows: int  # in the steps a new request will share: targeted rows, and the background share's
    prefill_tokens_per_step: int  # the step's prefill cap now
    free_seqs: int = 1 << 30  # the sequences that may run (max_running) - those a new request cannot displace
    # The running sequences' steps left (tokens they may still generate), ascending: when slots free
    # up. Exact with ignore_eos; otherwise max_tokens is an upper bound, and the forecast pessimistic.
    steps_to_finish: tuple[int, ...] = ()
    # Of the requests with targets that have not answered yet (the admission check counts them as
    # waiting ahead), those not ahead of a new one: running (a slot already theirs) or ranked behind it
    # (late, or of a lower priority); and their prompt tokens that are computed or ranked behind.
    seqs_not_ahead: int = 0
    prompt_tokens_not_ahead: int = 0
    # The latest step's time: a request arriving while one runs joins the step after it, half a step
    # later on average.
    step_seconds: float = 0.0

    def ttft_seconds(self, prompt_tokens_ahead: int, prompt_tokens: int, seqs_ahead: int = 0) -> float | None:
        """Predicted time to first token of a request queued behind seqs_ahead sequences holding
        prompt_tokens_ahead prompt tokens (the admission check's count: every request that has not
        answered yet, less what the engine knows is not ahead): its prompt starts once those ahead are
        computed and a sequence slot is free, whichever comes last."""
        if self.fit is None:
            return None
        prompt_tokens_ahead = max(prompt_tokens_ahead - self.prompt_tokens_not_ahead, 0)
        seqs_ahead = max(seqs_ahead - self.seqs_not_ahead, 0)
        both = self.fit.prefill_seconds(prompt_tokens_ahead + prompt_tokens, self.decode_rows,
                                        self.prefill_tokens_per_step)
        own = self.fit.prefill_seconds(prompt_tokens, self.decode_rows, self.prefill_tokens_per_step)
        return self.step_seconds / 2 + max(both, self._slot_wait_seconds(seqs_ahead) + own)

    def _slot_wait_seconds(self, seqs_ahead: int) -> float:
        short = seqs_ahead + 1 - self.free_seqs  # running sequences that must finish first
        if short <= 0 or not self.steps_to_finish:
            return 0.0
        rounds, i = divmod(short - 1, len(self.steps_to_finish))  # past one batch: it turns over again
        steps = rounds * self.steps_to_finish[-1] + self.steps_to_finish[i]
        return steps * self.fit.seconds(self.decode_rows, 0)


def ttft_deadline(seq: Sequence) -> float:
    ttft_ms = seq.params.slo_ttft_ms
    return math.inf if ttft_ms is None else seq.arrival_time + ttft_ms / 1000.0


def tokens_left(seq: Sequence) -> int:
    """Tokens seq may still generate (max_tokens, or the context)."""
    return min((seq.params.max_tokens or seq.max_len) - seq.num_output_tokens, seq.max_len - seq.num_tokens)


def has_targets(seq: Sequence) -> bool:
    return seq.params.slo_ttft_ms is not None or seq.params.slo_tpot_ms is not None


class BackgroundAllowance:
    """What sequences without targets may still add to this step: decode rows and prompt tokens."""

    def __init__(self, rows: int = _UNBOUNDED, tokens: int = _UNBOUNDED) -> None:
        self.rows = rows
        self.tokens = tokens

    def grant(self, seq: Sequence, num_new: int) -> int:
        """The tokens of num_new that seq may compute this step (0: none; targeted ones: all)."""
        if has_targets(seq):
            return num_new
        if seq.num_uncomputed_tokens <= 1:  # a decode row
            if self.rows <= 0:
                return 0
            self.rows -= 1
            return num_new
        granted = min(num_new, self.tokens)
        self.tokens -= granted
        return granted


def _has_answered(seq: Sequence) -> bool:
    return seq.num_output_tokens > 0


def _tpot_slack(seq: Sequence, now: float) -> float:
    """How long its next token may take with its mean time per output token still within its target."""
    first = seq.metrics.first_token_time
    return -math.inf if first is None else first + seq.params.slo_tpot_ms / 1000.0 * seq.num_output_tokens - now


def _step_budget(seq: Sequence, now: float, decode_step_s: float) -> float:
    """How long the next step may last with the decode seq's mean time per token, over its tokens so
    far, this one and its next TPOT_HORIZON at decode_step_s each, within TPOT_MARGIN x its target."""
    per_token_s = TPOT_MARGIN * seq.params.slo_tpot_ms / 1000.0
    first = now if seq.metrics.first_token_time is None else seq.metrics.first_token_time
    ahead = min(TPOT_HORIZON, max(tokens_left(seq) - 1, 0))
    # after this step: num_output_tokens intervals since the first token, then `ahead` more
    budget = first + per_token_s * (seq.num_output_tokens + ahead) - now - decode_step_s * ahead
    return max(per_token_s, budget)


class SloPolicy:
    def __init__(self, max_num_batched_tokens: int, model: StepTimeModel,
                 clock: Callable[[], float] = time.time) -> None:
        self.max_tokens = max_num_batched_tokens
        self.model = model
        self.clock = clock
        self.late: set[str] = set()  # waiting sequences whose TTFT can no longer be met
        # Waiting requests with targets, no answer yet and ranked behind a new request of the default
        # priority (late, or a lower priority): their prompt tokens, by id, and in all.
        self.behind: dict[str, int] = {}
        self.behind_tokens = 0
        # This step's (begin_step): the running decodes, and the prompt tokens the step may carry.
        self.num_decodes = 0
        self.cap = max_num_batched_tokens
        self.background = BackgroundAllowance()
        self.tightest_tpot_s = math.inf  # the running sequences' tightest TPOT target

    # ---- waiting order ---------------------------------------------------------------------
    def key(self, seq: Sequence) -> tuple:
        """(priority, late, latest start, arrival, id): read when seq enters the waiting queue."""
        late = seq.seq_id in self.late
        return (seq.params.priority, late, -math.inf if _has_answered(seq) else self.latest_start(seq),
                seq.arrival_time, seq.seq_id)

    def latest_start(self, seq: Sequence) -> float:
        """The latest time seq's prefill may start and still meet its TTFT target."""
        deadline = ttft_deadline(seq)
        fit = self.model.fit
        if fit is None or math.isinf(deadline):
            return deadline
        return deadline - fit.prefill_seconds(seq.num_uncomputed_tokens, 0, self.max_tokens)

    def demote_late(self, waiting: WaitingQueue) -> None:
        """Move the waiting heads that cannot meet their TTFT any more behind those that can."""
        now = self.clock()
        while (seq := waiting.peek()) is not None and seq.seq_id not in self.late:
            if _has_answered(seq) or self.latest_start(seq) >= now:
                return
            waiting.remove(seq)
            self.late.add(seq.seq_id)
            self._rank_behind(seq)
            waiting.add(seq)

    def entered_waiting(self, seq: Sequence) -> None:
        if seq.params.priority > 0 and has_targets(seq) and not _has_answered(seq):
            self._rank_behind(seq)

    def _rank_behind(self, seq: Sequence) -> None:
        if seq.seq_id not in self.behind:
            self.behind[seq.seq_id] = seq.num_prompt_tokens
            self.behind_tokens += seq.num_prompt_tokens

    def left_waiting(self, seq: Sequence) -> None:
        self.late.discard(seq.seq_id)
        self.behind_tokens -= self.behind.pop(seq.seq_id, 0)

    # ---- running -----------------------------------------------------------------------------
    def begin_step(self, running: list[Sequence]) -> None:
        self.num_decodes = sum(seq.num_uncomputed_tokens <= 1 for seq in running)
        self.cap = self.prefill_cap(running)
        self.background = self.background_allowance(running)
        self.tightest_tpot_s = math.inf
        for seq in running:
            self.joined(seq)

    def joined(self, seq: Sequence) -> None:
        """seq runs from this step on: its TPOT target bounds the sequences that may run beside it."""
        if seq.params.slo_tpot_ms is not None:
            self.tightest_tpot_s = min(self.tightest_tpot_s, seq.params.slo_tpot_ms / 1000.0)

    def max_running(self, ceiling: int, tpot_ms: float | None = None) -> int:
        """The sequences that may run at once, one with a TPOT target of tpot_ms among them: as many
        as a decode step holds, by the fitted model, within TPOT_MARGIN x the tightest target (of
        theirs and the running ones'), and at most `ceiling` (max_num_seqs). Without a fit or a
        target: the ceiling."""
        fit = self.model.fit
        tightest_s = self.tightest_tpot_s if tpot_ms is None else min(self.tightest_tpot_s, tpot_ms / 1000.0)
        if fit is None or math.isinf(tightest_s):
            return ceiling
        return max(1, min(ceiling, fit.max_decode_rows(TPOT_MARGIN * tightest_s)))

    def background_allowance(self, running: list[Sequence]) -> BackgroundAllowance:
        fit = self.model.fit
        targeted = [seq for seq in running if has_targets(seq)]
        if fit is None or not targeted:
            return BackgroundAllowance()
        targeted_decodes = sum(seq.num_uncomputed_tokens <= 1 for seq in targeted)
        half_share_s = BACKGROUND_SHARE * fit.seconds(targeted_decodes, 0) / 2
        return BackgroundAllowance(_UNBOUNDED if fit.b <= 0 else int(half_share_s / fit.b),
                                   _UNBOUNDED if fit.c <= 0 else int(half_share_s / fit.c))

    def forecast_rows(self, running: list[Sequence]) -> int:
        """The decode rows of the steps a new request with targets will share: the targeted ones', and
        of those without targets at most the background share's."""
        targeted = sum(has_targets(seq) for seq in running)
        return targeted + min(len(running) - targeted, self.background_allowance(running).rows)

    def prefill_cap(self, running: list[Sequence]) -> int:
        """The prompt tokens a step may carry beside the running decodes and keep their TPOT."""
        fit = self.model.fit
        decodes = [seq for seq in running if seq.num_uncomputed_tokens <= 1]
        targeted = [seq for seq in decodes if seq.params.slo_tpot_ms is not None]
        if fit is None or not targeted:
            return self.max_tokens
        now, decode_step_s = self.clock(), fit.seconds(len(decodes), 0)
        budget_s = min(_step_budget(seq, now, decode_step_s) for seq in targeted)
        return max(MIN_PREFILL_CHUNK, min(self.max_tokens, fit.max_prefill_tokens(len(decodes), budget_s)))

    def running_key(self, seq: Sequence) -> tuple:
        """Decodes first (the kernels want them leading), then prefill chunks by slack."""
        if seq.num_uncomputed_tokens <= 1:
            return (False, seq.params.priority, 0.0, seq.arrival_time)
        return (True, seq.params.priority, self.latest_start(seq), seq.arrival_time)

    def victim_key(self, seq: Sequence) -> tuple:
        """Larger is preempted first: the lowest priority, then the most slack."""
        return (seq.params.priority, self.slack(seq), seq.arrival_time)

    def slack(self, seq: Sequence) -> float:
        now = self.clock()
        if not _has_answered(seq):
            return self.latest_start(seq) - now
        return math.inf if seq.params.slo_tpot_ms is None else _tpot_slack(seq, now)

