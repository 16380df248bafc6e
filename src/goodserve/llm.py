"""The offline API, shaped like vLLM's: LLM(model=...).generate(prompts, params)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from goodserve.config import EngineConfig
from goodserve.engine.setup.device_memory import release_dropped_memory
from goodserve.engine.frontend.engine import Engine
from goodserve.errors import EngineDeadError, EngineStepError, InvalidRequestError
from goodserve.model_names import EMBEDDED_MODEL
from goodserve.outputs import RequestOutput
from goodserve.sampling_params import SamplingParams

Prompt = str | dict


class LLM:
    """`with LLM(...) as llm:` (or llm.shutdown()) gives the model's and the KV cache's memory back
    when done, so that a next engine in the same process finds it free."""

    def __init__(self, model: str = EMBEDDED_MODEL, **engine_options) -> None:
        self._engine: Engine | None = Engine(EngineConfig(model=model), **engine_options)
        self._ids = itertools.count()

    @classmethod
    def over(cls, engine: Engine) -> "LLM":
        """The offline API over an engine loaded already (goodserve tune gates a configuration's quality
        on it, then measures its speed, with one load)."""
        llm = cls.__new__(cls)
        llm._engine, llm._ids = engine, itertools.count()
        return llm

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise EngineDeadError("this LLM was shut down")
        return self._engine

    def shutdown(self) -> None:
        """Stop the engine's worker processes and free its model and KV cache (their device memory
        included) while this object lives on; calling it again does nothing."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        engine.executor.shutdown()
        del engine
        release_dropped_memory()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def spec(self):
        return self.engine.spec

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = _broadcast(sampling_params, len(prompts))
        request_ids = []
        try:
            for prompt, p in zip(prompts, params):
                request_id = f"offline-{next(self._ids)}"
                self.engine.add_request(request_id, _prompt_input(prompt), p)
                request_ids.append(request_id)
            finished = self._run_to_completion()
        except BaseException:
            for request_id in request_ids:  # nothing stays allocated after an error
                self.engine.abort_request(request_id)
            raise
        outputs = [finished[request_id] for request_id in request_ids]
        _raise_if_failed(outputs)
        return outputs

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """continue_final_message: the prompt ends inside the last message, which the model continues;
        chat_template_kwargs: variables the model's chat template reads (as vLLM's LLM.chat)."""
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer, so no chat template")
        self.tokenizer.check_template_kwargs(chat_template_kwargs or {})
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        render = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                  **(chat_template_kwargs or {})}
        prompts = [
            {"prompt_token_ids": self.tokenizer.encode(self.tokenizer.apply_chat_template(conv, **render),
                                                       add_special_tokens=False),
             "prompt": None}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    def _run_to_completion(self) -> dict[str, RequestOutput]:
        finished = {}
        while self.engine.has_unfinished():
            for output in self.engine.step(finished_only=True):
                finished[output.request_id] = output
        return finished


def _raise_if_failed(outputs: list[RequestOutput]) -> None:
    """As vLLM's LLM raises when its engine fails, rather than hand back outputs that only look done:
    a request the engine failed (its error was not the caller's input, which add_request refuses)."""
    failed = [output for output in outputs if output.error]
    if failed:
        raise EngineStepError(f"the engine failed {len(failed)} of {len(outputs)} requests; the first "
                              f"({failed[0].request_id}): {failed[0].error}")


def _prompt_input(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    raise InvalidRequestError("a prompt is a string or {'prompt_token_ids': [...]}")


def _broadcast(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise InvalidRequestError(f"got {len(params)} sampling params for {count} prompts")
    return list(params)
