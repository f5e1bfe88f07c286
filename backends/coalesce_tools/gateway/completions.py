"""``POST /v1/completions`` and ``/v1/chat/completions`` over a model of task ``generate``.

Chat messages go through the model's own chat template (its ``tokenizer_config.json``,
through transformers). The sampling fields map onto the backend's sampling parameters
(vLLM's names; vLLM's own extensions ``top_k`` and ``ignore_eos`` are taken too). Structured
output: OpenAI's ``response_format`` (``json_schema``, ``json_object``) becomes the backend's
``guided_json``, and vLLM's ``guided_json``, ``guided_regex`` and ``guided_choice`` (what its
clients send in ``extra_body``) pass through; the backend compiles and checks them. Prompt
tokens are counted with the tokenizer the engine uses; completion tokens by re-encoding
the generated text with it (the backend's stream carries text only).
A streamed answer is OpenAI's server-sent events, ending in ``data: [DONE]``; a client that
goes away cancels its generation in Triton.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any, Final

import orjson
from starlette.requests import Request

from coalesce.core.protocol import GUIDED_KEYS
from coalesce_tools.gateway.catalog import GENERATE, ModelEntry
from coalesce_tools.gateway.errors import ApiError, invalid
from coalesce_tools.gateway.fields import boolean, integer, number, refuse_unsupported

if TYPE_CHECKING:
    from coalesce_tools.gateway.app import Gateway

#: OpenAI fields this gateway cannot honour yet, each with the value that means "not used".
UNSUPPORTED = {
    "n": (1, "one choice per request; send n requests"),
    "best_of": (1, "one choice per request"),
    "echo": (False, "the prompt is not echoed"),
    "suffix": ("", "no insertion"),
    "logprobs": (False, "log probabilities are not returned"),
    "top_logprobs": (0, "log probabilities are not returned"),
    "presence_penalty": (0, "penalties are not applied"),
    "frequency_penalty": (0, "penalties are not applied"),
    "logit_bias": ({}, "no logit bias"),
    "tools": ([], "no tool calling"),
    "tool_choice": ("none", "no tool calling"),
    "functions": ([], "no function calling"),
    "guided_grammar": (None, "no grammar guides; use guided_json, guided_regex or guided_choice"),
}
#: The schema OpenAI's ``{"type": "json_object"}`` asks for: any JSON object.
ANY_JSON_OBJECT: Final = {"type": "object"}


@dataclasses.dataclass(frozen=True)
class Generation:
    """A checked generation call: the prompt as the engine sees it, its token count, and how to sample."""

    model: ModelEntry
    prompt: str
    prompt_tokens: int
    sampling: dict[str, Any]
    stream: bool
    include_usage: bool
    chat: bool
    #: Request parameters for Triton (tenant, ``priority_level``), from the caller's headers.
    parameters: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: The body field a guide came from (``response_format`` or a ``guided_*`` key), to name it in the backend's
    #: refusal; None without a guide.
    guide_param: str | None = None


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise invalid("'messages' must be a non-empty list of {role, content}", "messages")
    out = []
    for index, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(f"'messages[{index}]' must be an object with a string 'role'", "messages")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid(f"'messages[{index}].content' may hold only text parts ({{type: text, text}})",
                                  "messages")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise invalid(f"'messages[{index}].content' must be a string or a list of text parts", "messages")
        out.append({"role": message["role"], "content": content})
    return out


def _stop(value: Any, limit: int) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > limit:
        raise invalid(f"'stop' has {len(stops)} strings; this model takes at most {limit}", "stop")
    return stops


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as the backend's ``guided_json`` schema, or None for plain text.

    The schema is passed as given: ``strict`` is accepted either way, since the backend always
    holds the output to the schema.

    Raises:
        ApiError: 400 naming the part of ``response_format`` that is wrong.
    """
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid("'response_format' must be an object with a string 'type' (text, json_object or json_schema)",
                      "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return dict(ANY_JSON_OBJECT)
    if kind != "json_schema":
        raise invalid(f"'response_format.type' {kind!r} is not supported: use text, json_object or json_schema",
                      "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid("'response_format.json_schema' must be an object {name, schema, strict}",
                      "response_format.json_schema")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        found = "nothing" if schema is None else type(schema).__name__
        raise invalid(f"'response_format.json_schema.schema' must be a JSON Schema object, found {found}",
                      "response_format.json_schema.schema")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise invalid("'response_format.json_schema.strict' must be true or false",
                      "response_format.json_schema.strict")
    return schema


def _guide(body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The guided sampling parameter of ``body`` (empty without one) and the field it came from.

    Only types are checked here; the backend checks the schema or regex itself, and its
    refusal comes back as a 400.

    Raises:
        ApiError: 400 naming the field: a wrong type, or more than one guide.
    """
    found: list[tuple[str, dict[str, Any]]] = []
    schema = _response_format(body.get("response_format"))
    if schema is not None:
        found.append(("response_format", {"guided_json": schema}))
    for key in GUIDED_KEYS:
        value = body.get(key)
        if value is None:
            continue
        if key == "guided_json" and not (isinstance(value, dict) or (isinstance(value, str) and value)):
            raise invalid("'guided_json' must be a JSON Schema, as an object or a string holding one", key)
        if key == "guided_regex" and not (isinstance(value, str) and value):
            raise invalid("'guided_regex' must be a non-empty string (a regular expression)", key)
        if key == "guided_choice" and not (isinstance(value, list) and value
                                           and all(isinstance(c, str) and c for c in value)):
            raise invalid("'guided_choice' must be a non-empty list of non-empty strings", key)
        found.append((key, {key: value}))
    if len(found) > 1:
        raise invalid(f"give at most one of response_format (json_object, json_schema), {', '.join(GUIDED_KEYS)}; "
                      f"got {' and '.join(name for name, _ in found)}", found[1][0])
    return (found[0][1], found[0][0]) if found else ({}, None)


def read(model: ModelEntry, body: dict[str, Any], *, chat: bool,
         parameters: Mapping[str, Any] | None = None) -> Generation:
    """Check a completions or chat body against ``model`` and build the backend's request.

    ``parameters`` are Triton request parameters (tenant, ``priority_level``) sent with it.

    Raises:
        ApiError: 400 naming the field that is wrong or not supported.
    """
    refuse_unsupported(body, UNSUPPORTED)
    guide, guide_param = _guide(body)
    if chat:
        tokenizer = model.chat_tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise invalid(f"model '{model.name}' has no chat template (tokenizer_config.json): use /v1/completions",
                          "messages")
        prompt = tokenizer.apply_chat_template(_messages(body.get("messages")), tokenize=False,
                                               add_generation_prompt=True)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise invalid("'prompt' must be a non-empty string (one prompt per request)", "prompt")
    prompt_tokens = len(model.prompt_tokenizer.encode(prompt).ids)
    options = model.settings.generate
    context = model.settings.task.max_sequence_length
    room = context - prompt_tokens
    if room < 1:
        raise invalid(f"the prompt is {prompt_tokens} tokens; model '{model.name}' holds {context} (prompt and "
                      "completion together)", "messages" if chat else "prompt")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    default = min(options.max_tokens_limit, room) if chat else min(options.default_max_tokens, room)
    max_tokens = integer(body, key, low=1, high=options.max_tokens_limit, default=default)
    assert max_tokens is not None
    if max_tokens > room:
        raise invalid(f"this model's context holds {context} tokens; the prompt takes {prompt_tokens} and {key} "
                      f"asks {max_tokens} more: ask at most {room}", key)
    sampling: dict[str, Any] = {"max_tokens": max_tokens,
                                "temperature": number(body, "temperature", low=0.0, high=2.0, default=1.0),
                                "top_p": number(body, "top_p", low=0.0, high=1.0, default=1.0, low_open=True)}
    # vLLM's extensions of OpenAI's fields, which its clients (and benchmarks) send.
    top_k = integer(body, "top_k", low=-1)
    if top_k is not None and top_k > 0:
        sampling["top_k"] = top_k
    if boolean(body, "ignore_eos", default=False):
        sampling["ignore_eos"] = True
    seed = integer(body, "seed", low=0, high=2**63 - 1)
    if seed is not None:
        sampling["seed"] = seed
    stops = _stop(body.get("stop"), options.max_stop_strings)
    if stops:
        sampling["stop"] = stops
    sampling.update(guide)
    stream = boolean(body, "stream", default=False)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise invalid("'stream_options' must be an object", "stream_options")
    include_usage = boolean(stream_options, "include_usage", default=False)
    return Generation(model=model, prompt=prompt, prompt_tokens=prompt_tokens, sampling=sampling, stream=stream,
                      include_usage=include_usage, chat=chat, parameters=dict(parameters or {}),
                      guide_param=guide_param)


def _named(generation: Generation, error: ApiError) -> ApiError:
    """The backend's refusal of a guide (a bad schema or regex), naming the body field it came from."""
    if error.status != 400 or error.param is not None or generation.guide_param is None:
        return error
    if not any(f"'{key}'" in error.message for key in GUIDED_KEYS):
        return error
    message = error.message
    if generation.guide_param == "response_format":
        message = f"'response_format' (sent to the model as 'guided_json'): {message}"
    return ApiError(error.status, message, param=generation.guide_param, code=error.code,
                    error_type=error.error_type)


def _usage(generation: Generation, text: str) -> dict[str, int]:
    completion = len(generation.model.prompt_tokenizer.encode(text, add_special_tokens=False).ids)
    return {"prompt_tokens": generation.prompt_tokens, "completion_tokens": completion,
            "total_tokens": generation.prompt_tokens + completion}


def _finish_reason(generation: Generation, usage: dict[str, int]) -> str:
    return "length" if usage["completion_tokens"] >= generation.sampling["max_tokens"] else "stop"


def _choice(generation: Generation, text: str | None, finish: str | None, *, delta: bool) -> dict[str, Any]:
    if not generation.chat:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    if delta:
        return {"index": 0, "delta": {} if text is None else {"content": text}, "logprobs": None,
                "finish_reason": finish}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}


def _envelope(generation: Generation, request_id: str, created: int, *, chunk: bool) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if generation.chat else "text_completion"
    prefix = "chatcmpl-" if generation.chat else "cmpl-"
    return {"id": prefix + request_id, "object": kind, "created": created, "model": generation.model.name}


def _count(gateway: Gateway, generation: Generation, usage: dict[str, int]) -> None:
    tokens = gateway.metrics.tokens
    tokens.labels(generation.model.name, "prompt").inc(usage["prompt_tokens"])
    tokens.labels(generation.model.name, "completion").inc(usage["completion_tokens"])


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def complete(gateway: Gateway, request: Request, generation: Generation,
                   request_id: str) -> dict[str, Any] | None:
    """The whole answer, or None if the client went away first (its generation is cancelled then)."""
    async def collect() -> str:
        parts = []
        try:
            async for piece in gateway.triton.generate(generation.model.name, generation.prompt,
                                                       generation.sampling, request_id=request_id,
                                                       parameters=generation.parameters):
                parts.append(piece.text)
        except ApiError as exc:
            raise _named(generation, exc) from None
        return "".join(parts)

    created = int(time.time())
    work = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()  # the generation, cancelled in Triton (and counted) as it unwinds
    if not work.done() or work.cancelled():
        return None
    text = work.result()
    usage = _usage(generation, text)
    _count(gateway, generation, usage)
    return {**_envelope(generation, request_id, created, chunk=False),
            "choices": [_choice(generation, text, _finish_reason(generation, usage), delta=False)], "usage": usage}


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def start(gateway: Gateway, generation: Generation, request_id: str) -> tuple[AsyncIterator[Any], Any, float]:
    """Start a streamed generation and wait for its first piece, so that a refusal still gets its own status.

    Raises:
        ApiError: Triton's refusal (a bad request, an unknown model, a full queue).
    """
    arrived = time.perf_counter()
    stream = gateway.triton.generate(generation.model.name, generation.prompt, generation.sampling,
                                     request_id=request_id, parameters=generation.parameters)
    try:
        first = await stream.__anext__()
    except ApiError as exc:
        raise _named(generation, exc) from None
    gateway.metrics.first_token.labels(generation.model.name).observe(time.perf_counter() - arrived)
    return stream, first, arrived


async def events(gateway: Gateway, generation: Generation, request_id: str, stream: AsyncIterator[Any],
                 first: Any) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed answer (``first`` is its first piece, already received).

    An error after the first event goes out as an error event, then ``[DONE]``. Starlette
    cancels this iterator when the client disconnects; closing ``stream`` early cancels the
    request in Triton.
    """
    head = _envelope(generation, request_id, int(time.time()), chunk=True)
    parts: list[str] = []
    try:
        if generation.chat:
            yield _event({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]})
        piece = first
        while True:
            if piece.text:
                parts.append(piece.text)
                yield _event({**head, "choices": [_choice(generation, piece.text, None, delta=True)]})
            if piece.final:
                break
            piece = await stream.__anext__()
        usage = _usage(generation, "".join(parts))
        _count(gateway, generation, usage)
        yield _event({**head, "choices": [_choice(generation, None if generation.chat else "",
                                                  _finish_reason(generation, usage), delta=True)]})
        if generation.include_usage:
            yield _event({**head, "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"
    except ApiError as exc:
        yield _event(exc.body())
        yield b"data: [DONE]\n\n"
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


async def prepare(gateway: Gateway, body: dict[str, Any], *, chat: bool,
                  parameters: Mapping[str, Any] | None = None) -> Generation:
    """The checked generation call (the model looked up, its tokenizer loaded off the event loop).

    ``parameters``: Triton request parameters (tenant, ``priority_level``) to send with it.
    """
    model = await gateway.catalog.get(body.get("model"), GENERATE)
    return await asyncio.to_thread(read, model, body, chat=chat, parameters=parameters)
