"""Turns what a caller sends into what the engine schedules: tokenizes, validates (a request that can
never run is the caller's error, raised at once), compiles grammars, and makes the request's n
sequences."""

from __future__ import annotations

import threading
import time

from goodserve.config import EngineConfig
from goodserve.engine.frontend.grammar import GrammarCompiler
from goodserve.engine.frontend.request import Request, SampleOutput
from goodserve.engine.core.sequence import Sequence
from goodserve.errors import InvalidRequestError, PromptTooLongError
from goodserve.model.detokenizer import IncrementalDetokenizer
from goodserve.model.spec import ModelSpec
from goodserve.sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, config: EngineConfig, spec: ModelSpec, tokenizer) -> None:
        self.config = config
        self.vocab_size = spec.vocab_size
        self.tokenizer = tokenizer
        self._grammars: GrammarCompiler | None = None  # built on the first request with a grammar
        self._grammars_lock = threading.Lock()  # the server validates (compiles) on its tokenizer pool

    @property
    def grammars(self) -> GrammarCompiler:
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise InvalidRequestError("structured outputs need a tokenizer, and this model has none")
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        return self._grammars

    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass prompt token ids instead")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Raise a typed error for a request that can never run; return its maximum length."""
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)  # an invalid grammar is the caller's error
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        vocab_size, max_model_len = self.vocab_size, self.config.max_model_len
        if any(not 0 <= t < vocab_size for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})")
        if any(t >= vocab_size for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab_size})")
        if any(t >= vocab_size for t in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab_size})")
        if params.n > self.config.max_n_per_request:
            raise InvalidRequestError(f"n must be at most {self.config.max_n_per_request}, got {params.n}")
        prompt_len = len(prompt_token_ids)
        if prompt_len >= max_model_len:
            raise PromptTooLongError(
                f"the prompt has {prompt_len} tokens, but this model's context is {max_model_len} "
                "tokens (room for at least one new token is needed): shorten the prompt"
            )
        if params.max_tokens is None:
            return max_model_len
        if prompt_len + params.max_tokens > max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {max_model_len} tokens, but "
                f"{prompt_len + params.max_tokens} were requested ({prompt_len} in the prompt, "
                f"{params.max_tokens} max_tokens): lower max_tokens or shorten the prompt"
            )
        return prompt_len + params.max_tokens

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     arrival_time: float | None) -> Request:
        prompt_text, prompt_ids = self.tokenize_prompt(prompt)
        max_len = self.validate_request(prompt_ids, params)
        arrival_time = arrival_time or time.time()
        seqs = [self._new_sequence(request_id, i, prompt_ids, params, max_len, arrival_time)
                for i in range(params.n)]
        samples = [SampleOutput(IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
                                if self.tokenizer else None) for _ in seqs]
        if seqs[0].wants_prompt_logprobs:
            samples[0].prompt_logprobs.append(None)  # the first token has no context to be predicted from
        return Request(request_id, prompt_text, prompt_ids, seqs, samples,
                       holdback=max((len(s) for s in params.stop), default=1) - 1)

    def _new_sequence(self, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams,
                      max_len: int, arrival_time: float) -> Sequence:
        seq = Sequence(
            seq_id=sequence_id(request_id, index), request_id=request_id, index=index,
            token_ids=list(prompt_ids), num_prompt_tokens=len(prompt_ids), params=params,
            max_len=max_len, arrival_time=arrival_time,
        )
        if params.structured_outputs is not None:  # compiled by validate_request: a cache hit
            seq.grammar = self.grammars.new_state(self.grammars.compile(params.structured_outputs))
        return seq


def sequence_id(request_id: str, index: int) -> str:
    """The id of a request's index-th sequence (of its n)."""
    return f"{request_id}#{index}"
