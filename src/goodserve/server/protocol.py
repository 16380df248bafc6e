"""Request and response schemas of the OpenAI API, with vLLM's extension fields.

Pydantic checks types (a wrong type is a 422); SamplingParams checks values (a bad value is a 400),
so each rule lives in one place. A request keeps the fields it does not declare; contract.py refuses
them by name.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from goodserve.errors import InvalidRequestError
from goodserve.model.spec import SamplingDefaults
from goodserve.sampling_params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams
from goodserve.server.contract import refuse_other_types
from goodserve.server.limits import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPLATE_KWARGS,
    Name,
    StopString,
    check_body,
)
from goodserve.server.structured import request_grammar
from goodserve.server.tool_calls import tool_grammar
from goodserve.structured_outputs import StructuredOutputsParams

_INT64 = 2**63
Seed = Annotated[int, Field(ge=-_INT64, lt=_INT64)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class _Schema(BaseModel):
    # Objects keep the fields they do not declare, for contract.check_fields to refuse by name (or, with
    # --allow-unknown-fields, drop); NaN/inf never reach the sampler.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class _Request(_Schema):
    """A request body: every string in it, at any depth, must be encodable text. Fields it does not
    declare are kept, for contract.check_fields to refuse by name."""

    model_config = ConfigDict(extra="allow")
    # OpenAI fields of this request that goodserve does not implement: refused by name
    unsupported: ClassVar[frozenset[str]] = frozenset()

    _checked_body = model_validator(mode="before")(check_body)


def _refuse_store(store: bool | None) -> None:
    if store:
        raise InvalidRequestError("'store' must be false or absent: this server stores no responses")


class StreamOptions(_Schema):
    # A key it does not know is a 400 naming it (errors.py), not ignored.
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far, not only the last
    continuous_usage_stats: bool = False


# OpenAI's request metadata: up to 16 string pairs, keys up to 64 characters, values up to 512.
# Accepted and checked; kept nowhere, as this server stores no completions (store is false).
RequestMetadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                            Field(max_length=16)]


class JsonSchemaFormat(_Schema):
    name: str = "response"
    description: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Schema):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Schema):
    """vLLM's `structured_outputs` request field: one grammar."""

    json_: dict | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


_API_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # vLLM's knobs of its own grammar backends: goodserve has one (xgrammar, its default whitespace)
    unsupported: ClassVar[frozenset[str]] = frozenset({"guided_decoding_backend", "guided_whitespace_pattern"})

    model: Name | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Seed | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    user: Name | None = None  # accepted; recorded nowhere
    metadata: RequestMetadata | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extensions
    top_k: int = -1
    min_p: float = 0.0
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    priority: int = 0
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # goodserve extension: give up (408) if the request has not finished within this many seconds
    request_timeout_s: float | None = Field(default=None, gt=0)
    # goodserve extensions (docs/serving.md): this request's latency targets (default: --slo-ttft-ms,
    # --slo-tpot-ms), which the "slo" scheduler policy serves by; with slo_best_effort a request whose
    # TTFT the queue makes impossible waits at a low priority instead of a 429
    slo_ttft_ms: float | None = Field(default=None, gt=0, le=86_400_000)
    slo_tpot_ms: float | None = Field(default=None, gt=0, le=86_400_000)
    slo_best_effort: bool = False
    # Structured outputs (server/structured.py): OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def usage_in_every_chunk(self) -> bool:
        return self.include_usage_in_stream and self.stream_options.continuous_usage_stats

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         defaults: SamplingDefaults) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            **self._sampling_knobs(defaults),
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            priority=self.priority,
            slo_ttft_ms=self.slo_ttft_ms,
            slo_tpot_ms=self.slo_tpot_ms,
            structured_outputs=self._structured_outputs(),
            logit_bias=_token_id_keys(self.logit_bias),
        )

    def _sampling_knobs(self, defaults: SamplingDefaults) -> dict[str, float]:
        """temperature, top_p, top_k, min_p and repetition_penalty: the request's where it sets them,
        else the model's recommended ones (defaults), else the API's (OpenAI's, vLLM's)."""
        model = defaults.as_dict()
        return {name: getattr(self, name) if name in self.model_fields_set and getattr(self, name) is not None
                else model.get(name, api_default) for name, api_default in _API_SAMPLING_DEFAULTS.items()}

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        return request_grammar(self)


def _token_id_keys(logit_bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys, so as strings."""
    try:
        return {int(token): value for token, value in (logit_bias or {}).items()}
    except ValueError:
        raise InvalidRequestError("logit_bias keys must be token ids (integers as strings)") from None


Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(_SamplingRequest):
    unsupported: ClassVar[frozenset[str]] = _SamplingRequest.unsupported | {"best_of", "suffix"}

    prompt: Prompt
    max_tokens: int | None = 16  # OpenAI's default for completions; 0 only with echo (scores the prompt)
    logprobs: int | None = None
    echo: bool = False

    def sampling_params(self, defaults: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
        """defaults: the model's recommended sampling, for the knobs the request leaves unset."""
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens=0 needs echo=true (it scores the prompt and generates nothing)")
        params = self._sampling_params(self.max_tokens, self.logprobs, defaults)
        if self.echo and self.logprobs is not None:  # the echoed prompt's logprobs come first
            params.prompt_logprobs = self.logprobs
        return params


_TEXT_ONLY = "the models this server serves read text only"


class TextContent(_Schema):
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, part: object) -> object:
        return refuse_other_types(part, ("text",), "content part", _TEXT_ONLY)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Schema):
    name: Name
    description: str | None = None
    parameters: dict | None = None  # a JSON schema
    strict: bool | None = None


class ChatTool(_Schema):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(_Schema):
    name: Name


class NamedToolChoice(_Schema):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class ChatMessage(_Schema):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextContent], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: Name | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    refusal: str | None = None  # an earlier response's assistant message sent back as it came: unused

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


Messages = Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)]


class ChatTemplateFields(_Request):
    """How a request's messages become its prompt (vLLM's fields of these names)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the prompt ends inside the last message: the model continues it
    # the chat template's own variables (e.g. a reasoning model's enable_thinking), each one it reads
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=MAX_TEMPLATE_KWARGS)] | None = None

    def render_kwargs(self) -> dict[str, Any]:
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, **(self.chat_template_kwargs or {})}


class ChatCompletionRequest(_SamplingRequest, ChatTemplateFields):
    unsupported: ClassVar[frozenset[str]] = _SamplingRequest.unsupported | frozenset({
        "audio", "function_call", "functions", "modalities", "moderation", "prediction",
        "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "reasoning_effort",
        "safety_identifier", "service_tier", "verbosity", "web_search_options"})

    messages: Messages
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    store: bool | None = None
    # Tools (server/tool_calls.py)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        forced = tool_grammar(self)
        if forced is not None and request_grammar(self) is not None:
            raise InvalidRequestError("tool_choice required or a named function already sets the output's "
                                      "grammar: drop response_format / guided_* / structured_outputs")
        return forced or request_grammar(self)

    def sampling_params(self, defaults: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
        """defaults: the model's recommended sampling, for the knobs the request leaves unset."""
        _refuse_store(self.store)
        if 0 in (self.max_tokens, self.max_completion_tokens):
            raise InvalidRequestError("max_completion_tokens (max_tokens) must be at least 1")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, defaults)


class EmbeddingRequest(_Request):
    model: Name | None = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # only the model's hidden size: embeddings are not truncated
    user: Name | None = None  # accepted; recorded nowhere
    priority: int = 0  # vLLM extension: lower is served first


class InputText(_Schema):
    type: Literal["input_text", "output_text"]
    text: str
    # (an output_text part sent back as it came; unused)
    annotations: list | None = None
    logprobs: list | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, part: object) -> object:
        return refuse_other_types(part, ("input_text", "output_text"), "content part", _TEXT_ONLY)


class ResponseInputMessage(_Schema):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[InputText], Field(max_length=MAX_CONTENT_PARTS)]
    id: str | None = None  # an earlier output item's, sent back as it came: unused
    status: str | None = None

    def chat_message(self) -> ChatMessage:
        parts = self.content if isinstance(self.content, str) else [TextContent(type="text", text=p.text)
                                                                     for p in self.content]
        return ChatMessage(role=self.role, content=parts)


class ResponseFunctionCall(_Schema):
    """An earlier turn's function call, sent back as input (the output item of that name)."""

    type: Literal["function_call"]
    call_id: Name
    name: Name
    arguments: str  # JSON text
    id: str | None = None  # the output item's, sent back as it came: unused
    status: str | None = None


class ResponseFunctionCallOutput(_Schema):
    """What the caller's function returned for call_id."""

    type: Literal["function_call_output"]
    call_id: Name
    output: str


class ResponseTool(_Schema):
    """A function tool, as the Responses API spells it: flat, not nested under `function`."""

    type: Literal["function"]
    name: Name
    description: str | None = None
    parameters: dict | None = None  # a JSON schema
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, tool: object) -> object:
        return refuse_other_types(tool, ("function",), "tool", "this server runs function tools only")

    def chat_tool(self) -> ChatTool:
        return ChatTool(function=FunctionDefinition(name=self.name, description=self.description,
                                                    parameters=self.parameters, strict=self.strict))


class ResponseToolChoice(_Schema):
    type: Literal["function"]
    name: Name


ResponseInputItem = ResponseInputMessage | ResponseFunctionCall | ResponseFunctionCallOutput


class ResponseTextFormat(_Schema):
    """The Responses API's output format: flat, where chat's response_format nests json_schema."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def chat_format(self) -> ResponseFormat | None:
        if self.type != "json_schema":
            return None if self.type == "text" else ResponseFormat(type=self.type)
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=self.name or "response", description=self.description, schema=self.json_schema, strict=self.strict))


class ResponseText(_Schema):
    format: ResponseTextFormat = ResponseTextFormat()


class ResponsesRequest(_Request):
    """OpenAI's Responses API, its text and function-tool cases: one turn, no state kept between
    responses (a function's output comes back in `input`, with the call it answers)."""

    unsupported: ClassVar[frozenset[str]] = frozenset({
        "access_programs", "background", "background_options", "context_management", "conversation", "image",
        "include", "max_tool_calls", "metadata", "moderation", "previous_response_id",
        "prompt", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "reasoning",
        "safety_identifier", "service_tier", "stream_options", "top_logprobs", "truncation"})

    model: Name | None = None
    input: str | Annotated[list[ResponseInputItem], Field(max_length=MAX_MESSAGES)]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None  # OpenAI's default is true; nothing is stored here, so true is refused
    text: ResponseText | None = None  # the output's format: text, or JSON (a schema, or any object)
    user: Name | None = None  # accepted; recorded nowhere
    # Function tools (server/tool_calls.py, as chat completions run them); other tool types are a 422
    tools: list[ResponseTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, items: object) -> object:
        for item in items if isinstance(items, list) else ():
            refuse_other_types(item, ("message", "function_call", "function_call_output"), "input item",
                               "this server takes messages, function calls and their outputs")
        return items

    def chat_request(self) -> ChatCompletionRequest:
        """The same turn as a chat completion: one path from messages to tokens, sampling and tools."""
        _refuse_store(self.store)
        turns = [ChatMessage(role="user", content=self.input)] if isinstance(self.input, str) \
            else _chat_turns(self.input)
        system = [ChatMessage(role="system", content=self.instructions)] if self.instructions is not None else []
        choice = self.tool_choice
        if isinstance(choice, ResponseToolChoice):
            choice = NamedToolChoice(function=ToolChoiceFunction(name=choice.name))
        return ChatCompletionRequest(model=self.model, messages=system + turns, temperature=self.temperature,
                                     top_p=self.top_p, max_completion_tokens=self.max_output_tokens,
                                     tools=[t.chat_tool() for t in self.tools] if self.tools else None,
                                     tool_choice=choice, parallel_tool_calls=self.parallel_tool_calls,
                                     response_format=self.text.format.chat_format() if self.text else None)


def _chat_turns(items: list[ResponseInputItem]) -> list[ChatMessage]:
    """Input items as chat messages: consecutive function calls are one assistant turn's tool_calls
    (after its text, where the assistant's message came just before), a call's output a tool message."""
    turns: list[ChatMessage] = []
    for item in items:
        if isinstance(item, ResponseFunctionCall):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            last = turns[-1] if turns else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                turns.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif isinstance(item, ResponseFunctionCallOutput):
            turns.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
        else:
            turns.append(item.chat_message())
    return turns


class CreateBatchRequest(_Request):
    """POST /v1/batches (server/batch_routes.py)."""

    unsupported: ClassVar[frozenset[str]] = frozenset({"output_expires_after"})

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None  # OpenAI's bounds


class TokenizeRequest(ChatTemplateFields):
    model: Name | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Request):
    model: Name | None = None
    tokens: list[TokenId]


# ---- responses ----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, top alternatives keyed by token text (None for
    an echoed prompt's first token, which nothing predicts)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]
    refusal: None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str = ""


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "goodserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32, as OpenAI sends it


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class VersionResponse(BaseModel):
    version: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
