"""Errors a user can cause. Each maps to a clear CLI message and an OpenAI-style HTTP error."""


class GoodserveError(Exception):
    """Base class: the message says what went wrong and what to do."""

    http_status = 400
    error_type = "invalid_request_error"


class InvalidRequestError(GoodserveError):
    """Bad sampling values, empty prompt, unknown field values."""


class PromptTooLongError(InvalidRequestError):
    """Prompt (plus requested tokens) does not fit the context window or the KV pool."""


class ModelLoadError(GoodserveError):
    """Unknown model path, unsupported architecture, unreadable weights."""

    http_status = 404
    error_type = "model_not_found"


class QueueFullError(GoodserveError):
    """Admission control: the waiting queue is full; retry later."""

    http_status = 429
    error_type = "rate_limit_exceeded"


class EngineDeadError(GoodserveError):
    http_status = 503
    error_type = "service_unavailable"


class EngineStepError(GoodserveError):
    """The engine failed while running this request (it was aborted; the engine keeps serving)."""

    http_status = 500
    error_type = "internal_server_error"
