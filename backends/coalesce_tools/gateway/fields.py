"""Reading request bodies: size-bounded JSON, and fields checked with errors that name them."""

from __future__ import annotations

import math
from typing import Any

import orjson
from starlette.requests import Request

from coalesce_tools.gateway.errors import ApiError, invalid


async def read_json(request: Request, limit_bytes: int) -> dict[str, Any]:
    """The body as a JSON object, refused past ``limit_bytes`` before it is all read.

    Raises:
        ApiError: 413 over the limit, 400 if it is not a JSON object.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit_bytes:
        raise ApiError(413, f"the request body is {int(declared)} bytes; this gateway takes at most {limit_bytes} "
                            "(OPENAI_MAX_BODY_BYTES): send fewer or shorter inputs per request")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit_bytes:
            raise ApiError(413, f"the request body is over {limit_bytes} bytes, the most this gateway takes "
                                "(OPENAI_MAX_BODY_BYTES): send fewer or shorter inputs per request")
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise invalid(f"the body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise invalid(f"the body must be a JSON object, found {type(value).__name__}")
    return value


def text_list(value: Any, param: str, *, allow_single: bool = True) -> list[str]:
    """A string or a non-empty list of strings, as a list.

    Raises:
        ApiError: 400 naming ``param`` otherwise (token arrays included: this gateway takes text).
    """
    if isinstance(value, str) and allow_single:
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    if isinstance(value, list) and value and all(isinstance(v, int | list) for v in value):
        raise invalid(f"'{param}' holds token ids; this gateway takes text (a string or a list of strings)", param)
    if isinstance(value, list) and not value:
        raise invalid(f"'{param}' is an empty list: give at least one text", param)
    raise invalid(f"'{param}' must be a string or a list of strings, found {type(value).__name__}", param)


def integer(body: dict[str, Any], key: str, *, low: int, high: int | None = None,
            default: int | None = None) -> int | None:
    """``body[key]`` as an integer in ``[low, high]``, or ``default`` when absent or null.

    Raises:
        ApiError: 400 naming ``key`` if it is not an integer in range.
    """
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"'{key}' must be an integer, found {value!r}", key)
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise invalid(f"'{key}' is {value}; it must be {bound}", key)
    return value


def number(body: dict[str, Any], key: str, *, low: float, high: float, default: float | None = None,
           low_open: bool = False) -> float | None:
    """``body[key]`` as a finite number in ``[low, high]`` (``(low, high]`` if ``low_open``), or ``default``.

    Raises:
        ApiError: 400 naming ``key`` if it is not such a number.
    """
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(f"'{key}' must be a number, found {value!r}", key)
    if value > high or value < low or (low_open and value == low):
        raise invalid(f"'{key}' is {value}; it must be {'above' if low_open else 'at least'} {low} and at most "
                      f"{high}", key)
    return float(value)


def boolean(body: dict[str, Any], key: str, *, default: bool) -> bool:
    """``body[key]`` as a bool, or ``default`` when absent or null.

    Raises:
        ApiError: 400 naming ``key`` if it is not a bool.
    """
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"'{key}' must be true or false, found {value!r}", key)
    return value


def refuse_unsupported(body: dict[str, Any], checks: dict[str, tuple[Any, str]]) -> None:
    """Refuse fields set to something this gateway cannot honour: ``checks`` maps a key to (allowed value, why).

    A field absent, null, or equal to its allowed value passes; anything else is a 400 naming it,
    rather than an answer that silently ignores what was asked.

    Raises:
        ApiError: 400 naming the first such field.
    """
    for key, (allowed, why) in checks.items():
        value = body.get(key)
        if value is not None and value != allowed:
            raise invalid(f"'{key}' = {value!r} is not supported: {why}", key)
