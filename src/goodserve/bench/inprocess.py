"""A bench target that drives goodserve's AsyncEngine directly, with no HTTP in between.

Run the same workload here and against `goodserve serve` and the difference is the server's cost
(HTTP, JSON, SSE, detokenization on the response path). Token counts are exact: the engine
reports its token ids. A model without a tokenizer (dummy:...) gets prompts of made-up token ids, no
two alike at their start across every run on the target (prompt_for; for as many requests as the
vocabulary has ids), so none hits the prefix cache.

With SLOs (slo_ms: {"ttft": ms, "tpot": ms}, --goodput) each request carries them as its targets;
under the "slo" scheduler policy the admission check the server applies runs here too (engine/frontend/admission.py),
and a request it refuses is recorded as the 429 a client would get (refuses_late=False: every
request is admitted, as where each client sends slo_best_effort, to measure what the refusals cost).
Each record also carries TTFT and TPOT by the engine's own token times (engine_ttft, engine_tpot):
the client here shares the engine's process and GIL, so the difference is how late it read them.
With engine_process (bench --engine-process) the engine runs in a process of its own, as `goodserve
serve` runs it, and the client shares no GIL with it.
"""

from __future__ import annotations

import itertools

from goodserve.bench.client import Clock
from goodserve.bench.records import RequestRecord
from goodserve.bench.workloads import BenchRequest
from goodserve.config import EngineConfig
from goodserve.engine.frontend.admission import Admission
from goodserve.errors import GoodserveError
from goodserve.sampling_params import SamplingParams


class InProcessTarget:
    def __init__(self, config: EngineConfig, ignore_eos: bool = False, temperature: float = 0.0,
                 use_chat_template: bool = False, slo_ms: dict[str, float] | None = None,
                 refuses_late: bool = True, engine_process: bool = False, shed_costly: bool = False,
                 engine=None):
        """engine: an Engine the caller loaded already (for config), run on a thread of this process."""
        from goodserve.engine.frontend.async_engine import AsyncEngine  # pulls in torch and the model
        from goodserve.engine.frontend.engine_process import EngineProcess

        if engine is not None:
            self.engine = AsyncEngine(engine=engine)
        else:
            self.engine = EngineProcess(config) if engine_process else AsyncEngine(config)
        self.ignore_eos = ignore_eos
        self.temperature = temperature
        self.use_chat_template = use_chat_template
        self.slo_ms = slo_ms or {}
        checks_ttft = refuses_late and config.scheduler_policy == "slo" and "ttft" in self.slo_ms
        self.admission = Admission(max_waiting=1 << 62, shed_costly=shed_costly) if checks_ttft else None
        self.description = f"{'engine process' if engine_process else 'in-process engine'} ({config.model})"
        self._ids = itertools.count()
        self._started = False

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def start(self) -> None:
        if not self._started:
            await self.engine.start()
            self._started = True

    def prompt_for(self, request: BenchRequest, number: int) -> str | list[int]:
        """number: the request's own, never reused on this target. Without a tokenizer its ids start
        from it, so no two requests share a prefix, also across runs: from the request's index in its
        run, a probe after another found the earlier one's prompts in the prefix cache (gpu_slo.py's
        later rungs computed only the part of each prompt longer than its namesake's)."""
        if self.engine.tokenizer is None:
            vocab = self.engine.spec.vocab_size
            return [(number * 7919 + i * 31) % (vocab - 1) + 1 for i in range(request.prompt_len)]
        if self.use_chat_template:
            return self.engine.tokenizer.apply_chat_template(request.chat_messages())
        return request.completion_prompt()

    async def send(self, request: BenchRequest, index: int, clock: Clock) -> RequestRecord:
        await self.start()
        record = RequestRecord(index=index, prompt_len=request.prompt_len,
                               expected_output_len=request.output_len, send_time=clock(),
                               conversation_id=request.conversation_id, output_len_source="engine")
        params = SamplingParams(max_tokens=request.output_len, temperature=self.temperature,
                                ignore_eos=self.ignore_eos, slo_ttft_ms=self.slo_ms.get("ttft"),
                                slo_tpot_ms=self.slo_ms.get("tpot"), output_kind="delta")
        seen_tokens, last, text = 0, None, []
        queued = 0  # prompt tokens this request holds in the admission count until its first token
        try:
            if self.admission is not None:
                self.admission.check_ttft(self.engine.forecast(), request.prompt_len, params.slo_ttft_ms,
                                          request.output_len)
                self.admission.admit(1, request.prompt_len)
                queued = request.prompt_len
            number = next(self._ids)
            async for out in self.engine.generate(f"bench-{number}", self.prompt_for(request, number), params):
                if queued:
                    self.admission.started(1, queued)
                    queued = 0
                completion, last = out.outputs[0], out
                now = clock()
                if completion.token_ids:
                    record.chunk_times.append(now)
                    seen_tokens += len(completion.token_ids)
                text.append(completion.text)
                record.prompt_len = len(out.prompt_token_ids)
                record.cached_tokens = out.num_cached_tokens
        except GoodserveError as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        finally:
            if queued:
                self.admission.started(1, queued)
        record.end_time = clock()
        record.generated_text = "".join(text)
        record.output_len = seen_tokens
        record.first_token_time = record.chunk_times[0] if record.chunk_times else None
        if last is not None and last.metrics.first_token_time is not None:
            record.engine_ttft, record.engine_tpot = _engine_latencies(last.metrics, seen_tokens)
        record.success = not record.error and seen_tokens > 0
        if not record.error and seen_tokens == 0:
            record.error = "the engine finished the request without generating a token"
        return record

    async def close(self) -> None:
        if self._started:
            await self.engine.shutdown(5.0)


def _engine_latencies(metrics, num_tokens: int) -> tuple[float, float | None]:
    """TTFT from the request's arrival at the engine, and TPOT, by the engine's token times."""
    ttft = metrics.first_token_time - metrics.arrival_time
    if num_tokens < 2:
        return ttft, None
    return ttft, (metrics.last_token_time - metrics.first_token_time) / (num_tokens - 1)
