"""A generation request under the contract of Triton's vLLM backend, read and checked before it queues.

Inputs: ``text_input`` (the prompt), optional ``stream``, ``sampling_parameters`` (a JSON
object) and ``exclude_input_in_output``. Sampling parameters come from the
``sampling_parameters`` input, else from the request's parameters (how Triton's
``/generate`` endpoints and gRPC clients send them); ``stream`` and
``exclude_input_in_output`` may be given there too. Anything wrong gets an
``InvalidInputError`` naming the field.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any, Final

import numpy as np

from coalesce.core.errors import InvalidInputError
from coalesce.settings import GenerateOptions

#: Sampling keys a request may set (vLLM's names).
SAMPLING_KEYS: Final = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")
#: Input names of the contract (vLLM backend).
TEXT_INPUT: Final = "text_input"
STREAM_INPUT: Final = "stream"
SAMPLING_INPUT: Final = "sampling_parameters"
EXCLUDE_INPUT: Final = "exclude_input_in_output"
TEXT_OUTPUT: Final = "text_output"
#: Request parameters that are the request's own, not sampling (our scheduler's, and flags given as parameters).
FLAG_PARAMETERS: Final = (STREAM_INPUT, EXCLUDE_INPUT)
OWN_PARAMETERS: Final = ("tenant", "priority")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples: ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 keep every token."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """A checked request: its prompt, how to sample, and how to answer (streamed or whole, prompt prepended or not)."""

    prompt: str
    sampling: SamplingParams
    stream: bool = False
    prepend_prompt: bool = True


def read_request(tensors: Mapping[str, np.ndarray], parameters: str | Mapping[str, Any] | None,
                 options: GenerateOptions) -> GenerationRequest:
    """Read one request's tensors and parameters (a JSON object, as ``request.parameters()`` gives).

    Raises:
        InvalidInputError: Naming the input or field that is missing or wrong.
    """
    prompt = _text(tensors, TEXT_INPUT, required=True)
    if not prompt:
        raise InvalidInputError(f"input '{TEXT_INPUT}' is empty: give a prompt of at least one character")
    request_parameters = _json_object(parameters, "request parameters")
    if SAMPLING_INPUT in tensors:
        sampling_source = _json_object(_text(tensors, SAMPLING_INPUT, required=True), f"input '{SAMPLING_INPUT}'")
        where = f"input '{SAMPLING_INPUT}'"
    else:
        sampling_source = {key: value for key, value in request_parameters.items()
                           if key not in FLAG_PARAMETERS and key not in OWN_PARAMETERS
                           and not key.startswith("triton_")}
        where = "request parameters"
    stream = bool(_flag(tensors, request_parameters, STREAM_INPUT, default=False))
    exclude = _flag(tensors, request_parameters, EXCLUDE_INPUT, default=None)
    if exclude is None:
        exclude = stream
    if stream and not exclude:
        raise InvalidInputError(f"'{EXCLUDE_INPUT}' is false while 'stream' is true: a stream carries only new "
                                "text (set it true or leave it out)")
    return GenerationRequest(prompt=prompt, sampling=read_sampling(sampling_source, options, where=where),
                             stream=stream, prepend_prompt=not exclude)


def read_sampling(raw: Mapping[str, Any], options: GenerateOptions, *, where: str) -> SamplingParams:
    """Sampling parameters from a JSON object, each checked; defaults where absent.

    Raises:
        InvalidInputError: On an unknown key or a value of the wrong type or range, naming it.
    """
    unknown = sorted(set(raw) - set(SAMPLING_KEYS))
    if unknown:
        raise InvalidInputError(f"{where}: unknown sampling parameter '{unknown[0]}'; known: "
                                f"{', '.join(SAMPLING_KEYS)}")
    max_tokens = _integer(raw, "max_tokens", where, default=options.default_max_tokens)
    if not 1 <= max_tokens <= options.max_tokens_limit:
        raise InvalidInputError(f"{where}: 'max_tokens' is {max_tokens}; it must be between 1 and "
                                f"{options.max_tokens_limit} (parameter max_tokens_limit)")
    temperature = _number(raw, "temperature", where, default=1.0)
    if temperature < 0:
        raise InvalidInputError(f"{where}: 'temperature' is {temperature}; it must be >= 0 (0: greedy)")
    top_p = _number(raw, "top_p", where, default=1.0)
    if not 0 < top_p <= 1:
        raise InvalidInputError(f"{where}: 'top_p' is {top_p}; it must be in (0, 1]")
    top_k = _integer(raw, "top_k", where, default=0)
    if top_k < -1:
        raise InvalidInputError(f"{where}: 'top_k' is {top_k}; it must be >= 0 (0 or -1: every token)")
    seed = raw.get("seed")
    if seed is not None:
        seed = _integer(raw, "seed", where, default=0)
        if not 0 <= seed < 2 ** 63:
            raise InvalidInputError(f"{where}: 'seed' is {seed}; it must be between 0 and 2**63 - 1")
    stop = raw.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidInputError(f"{where}: 'stop' must be a non-empty string or a list of them")
    if len(stop) > options.max_stop_strings:
        raise InvalidInputError(f"{where}: 'stop' has {len(stop)} strings; at most {options.max_stop_strings} "
                                "(parameter max_stop_strings)")
    ignore_eos = raw.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise InvalidInputError(f"{where}: 'ignore_eos' must be true or false")
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=max(top_k, 0),
                          seed=seed, stop=tuple(stop), ignore_eos=ignore_eos)


def _text(tensors: Mapping[str, np.ndarray], name: str, *, required: bool) -> str:
    array = tensors.get(name)
    if array is None:
        if required:
            raise InvalidInputError(f"input '{name}' is missing")
        return ""
    if array.size != 1:
        raise InvalidInputError(f"input '{name}' has {array.size} elements; it takes one string")
    value = array.reshape(-1)[0]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInputError(f"input '{name}' is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    if isinstance(value, str):
        return value
    raise InvalidInputError(f"input '{name}' must be a string (TYPE_STRING), not {array.dtype}")


def _json_object(text: str | Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    if text is None or text == "":
        return {}
    if isinstance(text, Mapping):
        return dict(text)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"{what} are not valid JSON: {exc.msg} at character {exc.pos}") from None
    if not isinstance(value, dict):
        raise InvalidInputError(f"{what} must be a JSON object, not {type(value).__name__}")
    return value


def _flag(tensors: Mapping[str, np.ndarray], parameters: Mapping[str, Any], name: str,
          default: bool | None) -> bool | None:
    array = tensors.get(name)
    if array is not None:
        if array.size != 1:
            raise InvalidInputError(f"input '{name}' has {array.size} elements; it takes one boolean")
        return bool(array.reshape(-1)[0])
    if name in parameters:
        value = parameters[name]
        if not isinstance(value, bool):
            raise InvalidInputError(f"request parameter '{name}' must be true or false, not {value!r}")
        return value
    return default


def _integer(raw: Mapping[str, Any], key: str, where: str, *, default: int) -> int:
    number = _number(raw, key, where, default=default, what="an integer")
    if number != int(number):
        raise InvalidInputError(f"{where}: '{key}' must be an integer, not {raw.get(key)!r}")
    return int(number)


def _number(raw: Mapping[str, Any], key: str, where: str, *, default: float, what: str = "a number") -> float:
    """``raw[key]`` as a finite number (JSON numbers, or strings as request parameters may carry them)."""
    value = raw.get(key, default)
    number = math.nan
    if not isinstance(value, bool) and isinstance(value, (int, float, str)):
        with contextlib.suppress(ValueError):
            number = float(value)
    if not math.isfinite(number):
        raise InvalidInputError(f"{where}: '{key}' must be {what}, not {value!r}")
    return number
