"""Errors in OpenAI's JSON (``{"error": {"message", "type", "param", "code"}}``), and Triton's mapped onto them."""

from __future__ import annotations

from typing import Any, Final

from coalesce.core.protocol import REFUSED_PREFIX

#: OpenAI's ``type`` for each status the gateway answers with.
ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "invalid_request_error",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}
#: Triton's gRPC status (``str(grpc.StatusCode.X)``) to the HTTP status the gateway answers with.
GRPC_STATUS: Final = {
    "StatusCode.INVALID_ARGUMENT": 400,
    "StatusCode.NOT_FOUND": 404,
    "StatusCode.UNAVAILABLE": 503,
    "StatusCode.RESOURCE_EXHAUSTED": 429,
    "StatusCode.DEADLINE_EXCEEDED": 504,
    "StatusCode.CANCELLED": 499,
    "StatusCode.UNAUTHENTICATED": 401,
    "StatusCode.PERMISSION_DENIED": 401,
    "StatusCode.UNIMPLEMENTED": 400,
}


class ApiError(Exception):
    """A request's failure as the client sees it: HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 error_type: str | None = None) -> None:
        """An error answered with ``status``; ``param`` names the request field at fault, if one is."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or ERROR_TYPES.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        """OpenAI's error JSON."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> ApiError:
    """A 400 naming the field at fault."""
    return ApiError(400, message, param=param)


def from_triton(status: str | None, message: str, *, model: str) -> ApiError:
    """Triton's error (its gRPC status, or None where a stream carries only the message) as an ``ApiError``.

    The backend's own message is kept. A refusal under load (``REFUSED_PREFIX``) is a 429 whatever the
    status; a stream's error has no status, so its message decides (Triton's gRPC stream responses carry
    ``error_message`` alone).
    """
    text = message.strip() or "the inference server gave no reason"
    if REFUSED_PREFIX in text:
        return ApiError(429, text, code="rate_limit_exceeded")
    if status is None:
        lowered = text.lower()
        if "unknown model" in lowered or "is not found" in lowered or "not ready" in lowered:
            http = 404
        elif "not healthy" in lowered or "unavailable" in lowered:
            http = 503
        elif "cancelled" in lowered:
            http = 499
        else:
            # The backend refuses a bad generation request before its first token; by then a
            # stream's status is gone, and what it says is about the request.
            http = 400
    else:
        http = GRPC_STATUS.get(status, 500)
    code = "model_not_found" if http == 404 else None
    if http == 404 and model not in text:
        text = f"model '{model}': {text}"
    return ApiError(http, text, code=code)
