"""OpenAI error responses, and the failures a pod can be told to inject.

Every error a pod returns has the OpenAI body ``{"error": {"message", "type", "param", "code"}}``.
Injected failures (``FailureConfig``) come from :data:`INJECTED`, one constructor per type, with
the status the spec gives: rate_limit 429, invalid_api_key 401, context_length 400, server_error
503, invalid_request 400, model_not_found 404. Their responses also carry the header
``X-Simulated-Failure: <type>`` so a benchmark can tell them from real refusals.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any, Final

from simulator.config import FailureConfig

__all__ = [
    "INJECTED",
    "OpenAIError",
    "bad_request",
    "context_length_exceeded",
    "inject_failure",
    "model_not_found",
    "queue_full",
]


class OpenAIError(Exception):
    """An HTTP error in OpenAI's shape. ``injected`` names the failure type when it was injected."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        param: str | None = None,
        code: str | int | None = None,
        injected: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.injected = injected

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, type="invalid_request_error", param=param, code="invalid_request")


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model `{model}` does not exist.",
        type="invalid_request_error",
        param="model",
        code="model_not_found",
    )


def context_length_exceeded(
    *, max_model_len: int, prompt_tokens: int, max_tokens: int | None, param: str
) -> OpenAIError:
    """vLLM's message for a request longer than the context window."""
    if max_tokens is None:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_tokens} input tokens. Please reduce the length of the input messages."
        )
    else:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion."
        )
    return OpenAIError(
        400, message, type="invalid_request_error", param=param, code="context_length_exceeded"
    )


def queue_full(message: str) -> OpenAIError:
    return OpenAIError(429, message, type="rate_limit_error", code="rate_limit_exceeded")


INJECTED: Final[Mapping[str, Callable[[str], OpenAIError]]] = {
    "rate_limit": lambda model: OpenAIError(
        429,
        f"Rate limit reached for {model} (simulated).",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        injected="rate_limit",
    ),
    "invalid_api_key": lambda model: OpenAIError(
        401,
        "Incorrect API key provided (simulated).",
        type="authentication_error",
        code="invalid_api_key",
        injected="invalid_api_key",
    ),
    "context_length": lambda model: OpenAIError(
        400,
        "This model's maximum context length was exceeded (simulated).",
        type="invalid_request_error",
        param="messages",
        code="context_length_exceeded",
        injected="context_length",
    ),
    "server_error": lambda model: OpenAIError(
        503,
        "The server is overloaded or not ready yet (simulated).",
        type="server_error",
        code="service_unavailable",
        injected="server_error",
    ),
    "invalid_request": lambda model: OpenAIError(
        400,
        "Invalid request (simulated).",
        type="invalid_request_error",
        code="invalid_request",
        injected="invalid_request",
    ),
    "model_not_found": lambda model: OpenAIError(
        404,
        f"The model `{model}` does not exist (simulated).",
        type="invalid_request_error",
        param="model",
        code="model_not_found",
        injected="model_not_found",
    ),
}


def inject_failure(config: FailureConfig, rng: random.Random, model: str) -> OpenAIError | None:
    """A failure for this request, or ``None``: ``config.rate`` percent of calls fail, with a type
    drawn uniformly from ``config.types``. Draws nothing when the rate is 0."""
    if config.rate <= 0:
        return None
    if config.rate < 100 and rng.random() * 100 >= config.rate:
        return None
    return INJECTED[rng.choice(config.types)](model)
