"""A bench target that drives goodserve's AsyncEngine directly, with no HTTP in between.

Run the same workload here and against `goodserve serve` and the difference is the server's cost
(HTTP, JSON, SSE, detokenization on the response path). Token counts are exact: the engine
reports its token ids.
"""

from __future__ import annotations

import itertools

from goodserve.bench.client import Clock
from goodserve.bench.records import RequestRecord
from goodserve.bench.workloads import BenchRequest
from goodserve.config import EngineConfig
from goodserve.errors import GoodserveError
from goodserve.sampling_params import SamplingParams


class InProcessTarget:
    def __init__(self, config: EngineConfig, ignore_eos: bool = False, temperature: float = 0.0,
                 use_chat_template: bool = False):
        from goodserve.engine.async_engine import AsyncEngine  # pulls in torch and the model

        self.engine = AsyncEngine(config)
        self.ignore_eos = ignore_eos
        self.temperature = temperature
        self.use_chat_template = use_chat_template
        self.description = f"in-process engine ({config.model})"
        self._ids = itertools.count()
        self._started = False

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def start(self) -> None:
        if not self._started:
            await self.engine.start()
            self._started = True

    def prompt_for(self, request: BenchRequest) -> str:
        if self.use_chat_template and self.engine.tokenizer is not None:
            return self.engine.tokenizer.apply_chat_template(request.chat_messages())
        return request.completion_prompt()

    async def send(self, request: BenchRequest, index: int, clock: Clock) -> RequestRecord:
        await self.start()
        record = RequestRecord(index=index, prompt_len=request.prompt_len,
                               expected_output_len=request.output_len, send_time=clock(),
                               conversation_id=request.conversation_id, output_len_source="engine")
        params = SamplingParams(max_tokens=request.output_len, temperature=self.temperature,
                                ignore_eos=self.ignore_eos)
        seen_tokens = 0
        try:
            async for out in self.engine.generate(f"bench-{next(self._ids)}", self.prompt_for(request), params):
                completion = out.outputs[0]
                now = clock()
                if len(completion.token_ids) > seen_tokens:
                    record.chunk_times.append(now)
                    seen_tokens = len(completion.token_ids)
                record.prompt_len = len(out.prompt_token_ids)
                record.cached_tokens = out.num_cached_tokens
                record.generated_text = completion.text
        except GoodserveError as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        record.end_time = clock()
        record.output_len = seen_tokens
        record.first_token_time = record.chunk_times[0] if record.chunk_times else None
        record.success = not record.error and seen_tokens > 0
        if not record.error and seen_tokens == 0:
            record.error = "the engine finished the request without generating a token"
        return record

    async def close(self) -> None:
        if self._started:
            await self.engine.shutdown(5.0)
