"""The "slo" scheduler policy: serve each request within its latency targets, not first come first served.

A request may carry targets (SamplingParams.slo_ttft_ms, slo_tpot_ms; the server fills in its
--slo-ttft-ms / --slo-tpot-ms where the body sets none). The policy acts on them in these places:

- Waiting order: by slack, i.e. by the latest time the request can start and still meet its TTFT,
  deadline - predicted prefill time (the step-time model, engine/core/step_time_model.py), after the
  priority. A preempted request that already answered resumes first; one without a TTFT target
  comes after every one with a target. A request whose latest start has passed cannot meet its
  target any more: it moves behind those that still can (serving it first would make them late too,
  the domino effect of earliest-deadline-first under overload) and is served, FCFS, when they are.
- Prefill cap: the prompt tokens mixed into a step are capped so that the step, by the fitted model,
  lasts no longer than every running decode with a TPOT target can absorb. It plans the online work's
  step alone: batch rows are not counted (they compute only within the background share, on top),
  so a batch job leaves the online prompts' room as it was. The target is a mean over the request's
  tokens, so a step may outlast it by what the decode's tokens so far saved and
  what its next TPOT_HORIZON tokens (no more than it may still generate), at the fitted decode-only
  step time, will save: while decode steps run well under the targets the cap rarely binds, and as a
  large batch brings them near, prompt tokens give way. At least `margin` x the target, and at
  least MIN_PREFILL_CHUNK tokens, so prompts always progress; without a fit or a target, no cap.
- Margin: steps are planned to 1 / (1 + the model's relative error) of a TPOT target, so a model
  whose predictions miss (engine/core/step_time_model.py's EWMA of |measured - predicted| / predicted)
  plans conservatively. A fixed 0.9 on top of that made the running batch ~10% smaller than the
  target allows, and under bursts requests waited for room FCFS at the same ceiling gave them
  (cpu_slo_sim.py on the H100's fit at 63 / 81 req/s: 93.8 / 81.3% attainment, FCFS 100 / 96.4%;
  without it 100 / 91.1%: benchmarks/BENCHMARKS.md).
- Concurrency: a sequence joins the running ones only while a decode step of them all and it, every
  row reading its whole length (the fit's context term), lasts by the fitted model within `margin` x
  the tightest TPOT target among them and it (`has_room`): long contexts leave room for fewer rows.
  max_num_seqs stays the ceiling (CUDA graphs are captured up to it, memory), 1024 unless set
  (config.SLO_MAX_NUM_SEQS against FCFS's 256). A fixed max_num_seqs is either too low (on the
  H100 at 256, FCFS's queue waited seconds for a slot while steps took 28 ms against a 50 ms
  target) or, past capacity, lets TPOT grow without bound. Batch lines (no
  targets) take room up to the same limit and give it up first: an online request that finds no room
  displaces batch lines, the newest first (the victim order below), until it fits, never the other
  way round (engine/core/displacement.py); displaced lines wait, and rejoin only where a step with
  them still fits. Without a fit or a TPOT target: max_num_seqs.
- Preemption victim: the running request with the most slack (its TPOT budget ahead of the tokens
  it has produced, or its TTFT slack while it prefills), after the priority (batch lines first).
- Background share: requests without targets (batch lines) fill what targeted ones leave, but while
  a targeted one runs they may lengthen a step by BACKGROUND_SHARE (10%) of the targeted decodes'
  step, on top of what the online work plans alone (half in decode time, each batch row charged
  its row and its context's read, so long lines sit a step out first; half in prompt tokens, which
  also come out of the prefill cap's room left). Batch rows beyond it stay running (their K/V kept)
  but compute nothing that step. The prompt tokens are banked across steps (PromptBank, up to
  max_num_batched_tokens: the share holds on average, not in each step) and a batch prompt
  computes whole, in one step, once the bank covers it: sliced ~20 tokens a step, a prompt left an
  unfinished chunk in nearly every step, no step can launch ahead of such a step (async
  scheduling), and on the H100 54% of the steps beside the job paid the host's ~2 ms that steps
  ahead hide (cpu_slo_sim.py --sync-step-cost: 30% -> 0% of its steps). Without the bound the
  prefill cap spent the online decodes' TPOT slack on batch prompts; the card's measurements of
  each step of this are in benchmarks/BENCHMARKS.md (SLO-aware scheduling).

The admission check (engine/frontend/admission.py) reads the same model through `forecast` to
refuse, with 429, a request whose TTFT the queue ahead of it already makes impossible. What the new
request will see: slots up to `max_running` (has_room's rule at the running ones' mean length), a
batch line's counted free; steps of the targeted rows alone, with the context they read (batch rows
give way first, and add no more than the background share); of the prompts the server counts as
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

from goodserve.config import EngineConfig
from goodserve.engine.core.scheduling_policy import FcfsPolicy
from goodserve.engine.core.sequence import Sequence
from goodserve.engine.core.forecast import Forecast
from goodserve.engine.core.step_time_model import StepTimeFit, StepTimeModel
from goodserve.engine.core.waiting_queue import WaitingQueue

MIN_PREFILL_CHUNK = 64
TPOT_HORIZON = 16  # tokens after a step over which a decode's mean time per token may recover
BACKGROUND_SHARE = 0.1  # of the targeted decodes' step, what untargeted work may add to it


def ttft_deadline(seq: Sequence) -> float:
    ttft_ms = seq.params.slo_ttft_ms
    return math.inf if ttft_ms is None else seq.arrival_time + ttft_ms / 1000.0


def tokens_left(seq: Sequence) -> int:
    """Tokens seq may still generate (max_tokens, or the context). Read from its fields, not its
    properties: the slo policy asks it of every running sequence every step."""
    return min((seq.params.max_tokens or seq.max_len) + seq.num_prompt_tokens, seq.max_len) - len(seq.token_ids)


def has_targets(seq: Sequence) -> bool:
    return seq.params.slo_ttft_ms is not None or seq.params.slo_tpot_ms is not None


class PromptBank:
    """The prompt tokens sequences without targets have saved up, step by step, up to `size`: a batch
    prompt computes whole once they cover it (the module's docstring says why); one longer than a
    step offers it takes a chunk once the bank is full."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.tokens = 0.0

    def deposit(self, tokens: float) -> float:
        """Bank tokens (up to size); the amount banked."""
        before = self.tokens
        self.tokens = min(float(self.size), self.tokens + tokens)
        return self.tokens - before

    def withdraw(self, tokens: float) -> None:
        self.tokens = max(0.0, self.tokens - tokens)

    def take(self, num_new: int, whole: bool) -> int:
        """The tokens of num_new (the rest of a prompt when whole) it grants, and spends."""
        if whole and num_new <= self.tokens:
            granted = num_new
        elif self.tokens >= self.size:
            granted = min(num_new, self.size)
        else:
            return 0
        self.tokens -= granted
        return granted


class BackgroundAllowance:
    """What sequences without targets may still add to this step: decode time (each decode row costs
    its row and its context's K/V read, so a long line takes more of it) and the banked prompt tokens
    (none: no bound)."""

    def __init__(self, fit: StepTimeFit | None = None, decode_s: float = math.inf,
                 bank: PromptBank | None = None) -> None:
        self.fit = fit
        self.decode_s = decode_s
        self.bank = bank

    def grant(self, seq: Sequence, num_new: int) -> int:
        """The tokens of num_new that seq may compute this step (0: none; targeted ones: all)."""
        if has_targets(seq):
            return num_new
        if seq.num_uncomputed_tokens <= 1:  # a decode row
            return num_new if self.take_row(seq.num_tokens) else 0
        return num_new if self.bank is None else self.bank.take(num_new, num_new == seq.num_uncomputed_tokens)

    def take_row(self, context_tokens: int) -> bool:
        """Whether a decode row reading context_tokens fits what is left (and, if so, take it)."""
        if math.isinf(self.decode_s):
            return True
        cost_s = self.fit.b + self.fit.d * context_tokens
        if cost_s > self.decode_s + 1e-12:
            return False
        self.decode_s -= cost_s
        return True


def _has_answered(seq: Sequence) -> bool:
    return seq.num_output_tokens > 0


def _tpot_slack(seq: Sequence, now: float) -> float:
    """How long its next token may take with its mean time per output token still within its target."""
    first = seq.metrics.first_token_time
    return -math.inf if first is None else first + seq.params.slo_tpot_ms / 1000.0 * seq.num_output_tokens - now


def _tightest_step_budget(decodes: list[Sequence], now: float, decode_step_s: float, margin: float) -> float:
    """How long the next step may last with every decode's mean time per token (over its tokens so far,
    this one and its next TPOT_HORIZON at decode_step_s each) within margin x its TPOT target; at
    least margin x the target. One loop, reading fields rather than properties: it runs every step
    over every running decode (the largest part of begin_step's time at 512 rows)."""
    tightest = math.inf
    for seq in decodes:
        params = seq.params
        if params.slo_tpot_ms is None:
            continue
        per_token_s = margin * params.slo_tpot_ms / 1000.0
        first = seq.metrics.first_token_time
        num_output = len(seq.token_ids) - seq.num_prompt_tokens
        ahead = min(TPOT_HORIZON, max(tokens_left(seq) - 1, 0))
        # after this step: num_output intervals since the first token, then `ahead` more
        budget = (now if first is None else first) + per_token_s * (num_output + ahead) - now - decode_step_s * ahead
        tightest = min(tightest, max(per_token_s, budget))
    return tightest


class SloPolicy(FcfsPolicy):
    """FCFS's answers changed where the module's docstring says: every one but the batch gating."""

    def __init__(self, config: EngineConfig, step_time: StepTimeModel,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(config, step_time)
        max_num_batched_tokens = self.max_tokens = config.max_num_batched_tokens
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
        self.prompt_bank = PromptBank(max_num_batched_tokens)  # the background share's prompt tokens
        self.banked = 0.0  # what this step's plan put in the bank
        self.tightest_tpot_s = math.inf  # the running sequences' tightest TPOT target
        # The running sequences (those that joined this step too) and their lengths, summed: the K/V
        # a decode row of theirs reads, on average.
        self.num_running = 0
        self.running_tokens = 0

    # ---- waiting order ---------------------------------------------------------------------
    def waiting_key(self, seq: Sequence) -> tuple:
        """(priority, late, latest start, arrival, id): read when seq enters the waiting queue."""
        late = seq.seq_id in self.late
        return (seq.params.priority, late, -math.inf if _has_answered(seq) else self.latest_start(seq),
                seq.arrival_time, seq.seq_id)

    def latest_start(self, seq: Sequence) -> float:
        """The latest time seq's prefill may start and still meet its TTFT target."""
        deadline = ttft_deadline(seq)
        fit = self.step_time.fit
        if fit is None or math.isinf(deadline):
            return deadline
        return deadline - fit.prefill_seconds(seq.num_uncomputed_tokens, 0, self.max_tokens)

    def before_admitting(self, waiting: WaitingQueue) -> None:
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
        """This step's plan, from the running sequences in one pass (it runs every step, over up to
        max_num_seqs of them): the running tally, the prefill cap and the background share."""
        self.banked = 0.0
        self.num_running, self.running_tokens, self.num_decodes = len(running), 0, 0
        tightest_ms, targeted_decodes, context, any_targeted = math.inf, [], 0, False
        for seq in running:  # joined(seq) for each, and the decodes with targets
            params, num_tokens = seq.params, len(seq.token_ids)
            self.running_tokens += num_tokens
            targeted = has_targets(seq)
            if params.slo_tpot_ms is not None and params.slo_tpot_ms < tightest_ms:
                tightest_ms = params.slo_tpot_ms
            any_targeted |= targeted
            if num_tokens - seq.num_computed_tokens <= 1:
                self.num_decodes += 1
                if targeted:
                    targeted_decodes.append(seq)
                    context += num_tokens
        self.tightest_tpot_s = tightest_ms / 1000.0
        self.cap = self._prefill_cap(targeted_decodes, context)
        self.background = self._background_allowance(targeted_decodes, context) if any_targeted \
            else BackgroundAllowance()

    def joined(self, seq: Sequence) -> None:
        """seq runs from this step on: its TPOT target bounds the sequences that may run beside it, and
        its length the K/V each of their decode rows reads."""
        if seq.params.slo_tpot_ms is not None:
            self.tightest_tpot_s = min(self.tightest_tpot_s, seq.params.slo_tpot_ms / 1000.0)
        self.num_running += 1
        self.running_tokens += seq.num_tokens

    @property
    def margin(self) -> float:
        """What share of a TPOT target a step is planned to: less as the step-time model's predictions
        miss (its relative error), so a poorly fitted model plans conservatively."""
        return 1.0 / (1.0 + self.step_time.relative_error)

    def left(self, seq: Sequence) -> None:
        """seq stopped running this step (preempted, or displaced by a request of a higher priority)."""
        self.num_running -= 1
        self.running_tokens -= seq.num_tokens

    # ---- budgets -------------------------------------------------------------------------------
    @property
    def prefill_cap(self) -> int:
        return self.cap

    def running_budget(self) -> int:
        """The decodes (served first) and the prefill cap."""
        return min(self.max_tokens, self.num_decodes + self.cap)

    def admission_allowance(self, running: list[Sequence], num_scheduled: int) -> int:
        """What the cap leaves: the prefill chunks of the running ones count against it."""
        return max(self.cap - max(num_scheduled - self.num_decodes, 0), 0)

    def displacement_budget(self) -> int:
        return min(self.max_tokens, self.cap)

    def granted(self, seq: Sequence, num_new: int) -> int:
        """A request without targets computes only within the background share."""
        return self.background.grant(seq, num_new)

    def has_room(self, seq: Sequence, num_running: int, running_tokens: int) -> bool:
        """Whether seq may join num_running sequences of running_tokens tokens: under max_num_seqs,
        and a decode step of them all, every row reading its whole length, lasting, by the fitted
        model, within `margin` x the tightest TPOT target (of theirs and its). Long contexts leave
        room for fewer rows. Without a fit or a target: max_num_seqs alone."""
        if num_running >= self.config.max_num_seqs:
            return False
        fit = self.step_time.fit
        tightest_s = self._tightest_with(seq.params.slo_tpot_ms)
        if fit is None or math.isinf(tightest_s) or num_running == 0:
            return True
        return fit.seconds(num_running + 1, 0, running_tokens + seq.num_tokens) <= self.margin * tightest_s + 1e-9

    def max_running(self, ceiling: int) -> int:
        """The sequences that may run at once, by has_room's rule, each the running ones' mean length
        (what the admission forecast counts slots by). Without a fit or a target: the ceiling."""
        fit = self.step_time.fit
        tightest_s = self.tightest_tpot_s
        if fit is None or math.isinf(tightest_s):
            return ceiling
        mean_context = self.running_tokens / self.num_running if self.num_running else 0.0
        return max(1, min(ceiling, fit.max_decode_rows(self.margin * tightest_s + 1e-9, mean_context)))

    def forecast(self, running: list[Sequence]) -> Forecast:
        """What a new request of the default priority will see (Forecast), from the running sequences
        in one pass: the engine publishes it after every step."""
        steps_to_finish = []  # of the slots it waits for: a lower-priority sequence gives its own up
        targeted = context = prefilling = prefilled = 0  # batch rows give way first: not counted
        for seq in running:
            params, num_tokens = seq.params, len(seq.token_ids)
            if params.priority <= 0:  # and a step more while its prompt computes
                steps_to_finish.append(tokens_left(seq) + (num_tokens - seq.num_computed_tokens > 1))
            if has_targets(seq):
                targeted += 1
                context += num_tokens
                if not _has_answered(seq):
                    prefilling += 1
                    prefilled += seq.num_computed_tokens
        steps_to_finish.sort()
        return Forecast(self.step_time.fit, targeted, self.cap, context,
                           self.max_running(self.config.max_num_seqs) - len(steps_to_finish), tuple(steps_to_finish),
                           seqs_not_ahead=prefilling + len(self.behind), prompt_tokens_not_ahead=prefilled
                           + self.behind_tokens, step_seconds=self.step_time.last_seconds)

    def _tightest_with(self, tpot_ms: float | None) -> float:
        return self.tightest_tpot_s if tpot_ms is None else min(self.tightest_tpot_s, tpot_ms / 1000.0)

    def _background_allowance(self, targeted_decodes: list[Sequence], context: int) -> BackgroundAllowance:
        """What untargeted work may add to a step beside targeted sequences, targeted_decodes of them
        decoding over context tokens."""
        fit = self.step_time.fit
        if fit is None:
            return BackgroundAllowance()
        half_share_s = BACKGROUND_SHARE * fit.seconds(len(targeted_decodes), 0, context) / 2
        if fit.c <= 0:
            return BackgroundAllowance(fit, half_share_s)
        self.banked = self.prompt_bank.deposit(half_share_s / fit.c)
        return BackgroundAllowance(fit, half_share_s, self.prompt_bank)

    def step_refused(self) -> None:
        """The step just planned will not run (one asked for ahead of the step in flight, refused):
        its share leaves the bank, or the step planned again after it would bank it twice."""
        self.prompt_bank.withdraw(self.banked)
        self.banked = 0.0

    def _prefill_cap(self, targeted_decodes: list[Sequence], context: int) -> int:
        """The prompt tokens a step may carry beside the running decodes with targets (reading context
        tokens) and keep their TPOT. Batch rows are not counted: they compute only within the
        background share, on top of this plan."""
        fit = self.step_time.fit
        if fit is None:
            return self.max_tokens
        decode_step_s = fit.seconds(len(targeted_decodes), 0, context)
        budget_s = _tightest_step_budget(targeted_decodes, self.clock(), decode_step_s, self.margin)
        if math.isinf(budget_s):  # no TPOT target among them
            return self.max_tokens
        return max(MIN_PREFILL_CHUNK, min(self.max_tokens, fit.max_prefill_tokens(len(targeted_decodes), budget_s,
                                                                                  context)))

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

