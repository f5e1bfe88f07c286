"""The contract of Triton's vLLM backend, in one place: its tensors, reading a request, and building a response.

Inputs: ``text_input`` (the prompt), optional ``stream``, ``sampling_parameters`` (a JSON
object), ``exclude_input_in_output`` and the five ``return_*`` flags that ask for
additional outputs. Sampling parameters come from the ``sampling_parameters`` input, else
from the request's parameters (how Triton's ``/generate`` endpoints, its OpenAI frontend
and gRPC clients send them); ``stream`` and ``exclude_input_in_output`` may be given there
too. Values may be JSON numbers or strings (``"0.1"``, ``"100"``, ``"true"``), as vLLM
clients send them. Anything wrong gets an ``InvalidInputError`` naming the field.

Outputs: ``text_output`` always; ``finish_reason`` (``"None"`` on a streamed response that
is not the last, then ``"stop"`` or ``"length"``), ``cumulative_logprob``, ``logprobs``
(JSON: per new token, ``{token id: {logprob, rank, decoded_token}}`` for the sampled token
and the ``logprobs`` most likely; ``null`` when the request set no ``logprobs``),
``num_input_tokens`` and ``num_output_tokens`` (new tokens of this response) where asked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from coalesce.core.errors import ConfigError, InvalidInputError
from coalesce.core.protocol import GUIDED_KEYS, PRIORITY_PARAMETER, TENANT_PARAMETER
from coalesce.core.tensors import TensorSpec
from coalesce.generation.events import GenerationEvent

#: Input names of the contract.
TEXT_INPUT: Final = "text_input"
STREAM_INPUT: Final = "stream"
SAMPLING_INPUT: Final = "sampling_parameters"
EXCLUDE_INPUT: Final = "exclude_input_in_output"
#: Output names of the contract.
TEXT_OUTPUT: Final = "text_output"
FINISH_REASON_OUTPUT: Final = "finish_reason"
CUMULATIVE_LOGPROB_OUTPUT: Final = "cumulative_logprob"
LOGPROBS_OUTPUT: Final = "logprobs"
NUM_INPUT_TOKENS_OUTPUT: Final = "num_input_tokens"
NUM_OUTPUT_TOKENS_OUTPUT: Final = "num_output_tokens"
#: Each additional output and the BOOL input that asks for it (``return_<output>``).
ADDITIONAL_OUTPUTS: Final = (FINISH_REASON_OUTPUT, CUMULATIVE_LOGPROB_OUTPUT, LOGPROBS_OUTPUT,
                             NUM_INPUT_TOKENS_OUTPUT, NUM_OUTPUT_TOKENS_OUTPUT)
RETURN_INPUTS: Final = tuple(f"return_{name}" for name in ADDITIONAL_OUTPUTS)

#: The decoupled contract: (name, type, dims, optional) of each input and (name, type, dims) of each output.
INPUTS: Final[tuple[tuple[str, str, tuple[int, ...], bool], ...]] = (
    (TEXT_INPUT, "TYPE_STRING", (1,), False), (STREAM_INPUT, "TYPE_BOOL", (1,), True),
    (SAMPLING_INPUT, "TYPE_STRING", (1,), True), (EXCLUDE_INPUT, "TYPE_BOOL", (1,), True),
    *((name, "TYPE_BOOL", (1,), True) for name in RETURN_INPUTS))
OUTPUTS: Final[tuple[tuple[str, str, tuple[int, ...]], ...]] = (
    (TEXT_OUTPUT, "TYPE_STRING", (-1,)), (FINISH_REASON_OUTPUT, "TYPE_STRING", (-1,)),
    (CUMULATIVE_LOGPROB_OUTPUT, "TYPE_FP32", (-1,)), (LOGPROBS_OUTPUT, "TYPE_STRING", (-1,)),
    (NUM_INPUT_TOKENS_OUTPUT, "TYPE_UINT32", (1,)), (NUM_OUTPUT_TOKENS_OUTPUT, "TYPE_UINT32", (-1,)))
#: The input names a request may carry.
INPUT_NAMES: Final = tuple(name for name, _, _, _ in INPUTS)

#: Sampling keys a request may set (vLLM's names; ``priority_level`` is the scheduler's, see ``core.protocol``).
SAMPLING_KEYS: Final = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                        "stop_token_ids", "ignore_eos", "repetition_penalty", "presence_penalty",
                        "frequency_penalty", "logprobs", *GUIDED_KEYS, PRIORITY_PARAMETER)
#: Request parameters that are flags of the contract, or the request's own (tenant), not sampling.
FLAG_PARAMETERS: Final = (STREAM_INPUT, EXCLUDE_INPUT, *RETURN_INPUTS)
OWN_PARAMETERS: Final = (TENANT_PARAMETER,)
#: Most top tokens ``logprobs`` may ask for per token (vLLM's default limit).
MAX_LOGPROBS: Final = 20
#: Most token ids ``stop_token_ids`` may list.
MAX_STOP_TOKEN_IDS: Final = 64


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples (vLLM's meanings).

    ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 keep every token. Penalties:
    ``repetition_penalty`` (> 1 discourages every token of the prompt and the output),
    ``presence_penalty`` and ``frequency_penalty`` (subtracted once, and per occurrence,
    for tokens of the output). ``min_tokens``: end of sequence and ``stop_token_ids`` are
    masked, and stop strings not looked for, until that many tokens are generated.
    ``logprobs``: how many top tokens to report per token (None: none). ``guide``: the
    structured-output constraint (``coalesce.generation.constraints.Guide``), or None.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    guide: Any = None

    @property
    def penalised(self) -> bool:
        """Whether any penalty changes the logits."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """A checked request: its prompt, how to sample, how to answer, and its admission priority.

    ``returns``: the additional outputs asked for. ``priority_level``: lower is admitted
    first when the running set or the KV cache is full (0: the model's default level).
    """

    prompt: str
    sampling: SamplingParams
    stream: bool = False
    prepend_prompt: bool = True
    returns: frozenset[str] = frozenset()
    priority_level: int = 0

    @property
    def wants_logprobs(self) -> bool:
        """Whether each sampled token's log probability must be computed."""
        return CUMULATIVE_LOGPROB_OUTPUT in self.returns or (
            LOGPROBS_OUTPUT in self.returns and self.sampling.logprobs is not None)


# --- the model config -------------------------------------------------------------------------------------------


def contract_completion(config: Mapping[str, Any]) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The contract's inputs and outputs that the config does not declare (auto-complete adds them)."""
    declared_inputs = {t.get("name") for t in config.get("input", [])}
    declared_outputs = {t.get("name") for t in config.get("output", [])}
    inputs = [TensorSpec(n, t, d, optional=o) for n, t, d, o in INPUTS if n not in declared_inputs]
    outputs = [TensorSpec(n, t, d) for n, t, d in OUTPUTS if n not in declared_outputs]
    return inputs, outputs


def check_contract(model_name: str, config: Mapping[str, Any]) -> frozenset[str]:
    """Check the config is decoupled and declares the contract's tensors; the additional outputs it declares.

    Raises:
        ConfigError: Naming the model and what to change.
    """
    policy = config.get("model_transaction_policy") or {}
    if not policy.get("decoupled"):
        raise ConfigError(f"model '{model_name}': task 'generate' streams its responses; set "
                          "model_transaction_policy { decoupled: true }")
    declared = {t.get("name"): t for t in config.get("input", [])}
    for tensor, data_type, _, optional in INPUTS:
        entry = declared.get(tensor)
        if entry is None:
            if not optional:
                raise ConfigError(f"model '{model_name}': task 'generate' needs input '{tensor}' ({data_type}, "
                                  "dims [1])")
            continue
        if entry.get("data_type") != data_type:
            raise ConfigError(f"model '{model_name}': input '{tensor}' is {entry.get('data_type')}; task "
                              f"'generate' needs {data_type}")
    outputs = {t.get("name"): t for t in config.get("output", [])}
    for tensor, data_type, dims in OUTPUTS:
        entry = outputs.get(tensor)
        if entry is None and tensor != TEXT_OUTPUT:
            continue
        if entry is None or entry.get("data_type") != data_type:
            raise ConfigError(f"model '{model_name}': task 'generate' needs output '{tensor}' as {data_type}, dims "
                              f"{list(dims)}")
    extra = sorted(set(declared) - set(INPUT_NAMES))
    if extra:
        raise ConfigError(f"model '{model_name}': task 'generate' reads no input {extra}; its inputs are "
                          f"{', '.join(INPUT_NAMES)}")
    return frozenset(name for name in ADDITIONAL_OUTPUTS if name in outputs)


# --- requests ---------------------------------------------------------------------------------------------------


def read_request(tensors: Mapping[str, np.ndarray], parameters: str | Mapping[str, Any] | None,
                 options: Any, *, declared_outputs: frozenset[str] = frozenset(ADDITIONAL_OUTPUTS)
                 ) -> GenerationRequest:
    """Read one request's tensors and parameters (a JSON object, as ``request.parameters()`` gives).

    ``options``: the model's ``GenerateOptions``. ``declared_outputs``: the additional
    outputs the model's config declares (asking for another is an error).

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
        # vLLM's words, which its backend's clients match.
        raise InvalidInputError("Error generating stream: When streaming, `exclude_input_in_output` = False is not "
                                "allowed.")
    returns = set()
    for output, flag in zip(ADDITIONAL_OUTPUTS, RETURN_INPUTS, strict=True):
        if _flag(tensors, request_parameters, flag, default=False):
            if output not in declared_outputs:
                raise InvalidInputError(f"'{flag}' is true but the model's config declares no output '{output}'")
            returns.add(output)
    priority = request_parameters.get(PRIORITY_PARAMETER, sampling_source.get(PRIORITY_PARAMETER, 0))
    priority_level = _integer({PRIORITY_PARAMETER: priority}, PRIORITY_PARAMETER, where, default=0)
    if priority_level < 0:
        raise InvalidInputError(f"{where}: '{PRIORITY_PARAMETER}' is {priority_level}; it must be >= 0 (1 is the "
                                "highest level, 0: the model's default)")
    return GenerationRequest(prompt=prompt, sampling=read_sampling(sampling_source, options, where=where),
                             stream=stream, prepend_prompt=not exclude, returns=frozenset(returns),
                             priority_level=priority_level)


def read_sampling(raw: Mapping[str, Any], options: Any, *, where: str) -> SamplingParams:
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
    min_tokens = _integer(raw, "min_tokens", where, default=0)
    if not 0 <= min_tokens <= max_tokens:
        raise InvalidInputError(f"{where}: 'min_tokens' is {min_tokens}; it must be between 0 and max_tokens "
                                f"({max_tokens})")
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
    stop = _list(raw, "stop", where)
    if not all(isinstance(s, str) and s for s in stop):
        raise InvalidInputError(f"{where}: 'stop' must be a non-empty string or a list of them")
    if len(stop) > options.max_stop_strings:
        raise InvalidInputError(f"{where}: 'stop' has {len(stop)} strings; at most {options.max_stop_strings} "
                                "(parameter max_stop_strings)")
    stop_token_ids = _list(raw, "stop_token_ids", where)
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_token_ids):
        raise InvalidInputError(f"{where}: 'stop_token_ids' must be a list of token ids (integers >= 0)")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidInputError(f"{where}: 'stop_token_ids' has {len(stop_token_ids)} ids; at most "
                                f"{MAX_STOP_TOKEN_IDS}")
    repetition_penalty = _number(raw, "repetition_penalty", where, default=1.0)
    if not 0 < repetition_penalty <= 10:
        raise InvalidInputError(f"{where}: 'repetition_penalty' is {repetition_penalty}; it must be in (0, 10] "
                                "(1: none)")
    penalties = {}
    for key in ("presence_penalty", "frequency_penalty"):
        penalties[key] = _number(raw, key, where, default=0.0)
        if not -2 <= penalties[key] <= 2:
            raise InvalidInputError(f"{where}: '{key}' is {penalties[key]}; it must be between -2 and 2")
    logprobs = raw.get("logprobs")
    if logprobs is not None:
        logprobs = _integer(raw, "logprobs", where, default=0)
        if not 0 <= logprobs <= MAX_LOGPROBS:
            raise InvalidInputError(f"{where}: 'logprobs' is {logprobs}; it must be between 0 and {MAX_LOGPROBS} "
                                    "(top tokens reported per token)")
    guide = None
    if any(key in raw for key in GUIDED_KEYS):
        from coalesce.generation.constraints import read_guide

        guide = read_guide(raw, where)
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=max(top_k, 0),
                          seed=seed, stop=tuple(stop), ignore_eos=_bool(raw, "ignore_eos", where),
                          min_tokens=min_tokens, stop_token_ids=tuple(stop_token_ids),
                          repetition_penalty=repetition_penalty, logprobs=logprobs, guide=guide, **penalties)


# --- responses --------------------------------------------------------------------------------------------------


def response_outputs(request: GenerationRequest, event: GenerationEvent, *, batched: bool) -> dict[str, np.ndarray]:
    """The output tensors of one response (``batched``: the model's config has ``max_batch_size`` > 0)."""
    shape = (1, 1) if batched else (1,)

    def one(value: Any, dtype: Any) -> np.ndarray:
        return np.array([value], dtype=dtype).reshape(shape)

    outputs = {TEXT_OUTPUT: one(event.text.encode("utf-8"), np.object_)}
    returns = request.returns
    if FINISH_REASON_OUTPUT in returns:
        outputs[FINISH_REASON_OUTPUT] = one(str(event.finish_reason).encode(), np.object_)
    if CUMULATIVE_LOGPROB_OUTPUT in returns:
        outputs[CUMULATIVE_LOGPROB_OUTPUT] = one(event.cumulative_logprob, np.float32)
    if LOGPROBS_OUTPUT in returns:
        entries = None if request.sampling.logprobs is None else list(event.logprobs)
        outputs[LOGPROBS_OUTPUT] = one(json.dumps(entries).encode(), np.object_)
    if NUM_INPUT_TOKENS_OUTPUT in returns:
        outputs[NUM_INPUT_TOKENS_OUTPUT] = one(event.prompt_tokens, np.uint32)
    if NUM_OUTPUT_TOKENS_OUTPUT in returns:
        outputs[NUM_OUTPUT_TOKENS_OUTPUT] = one(event.new_tokens, np.uint32)
    return outputs


# --- reading values ---------------------------------------------------------------------------------------------


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
        return _bool(parameters, name, "request parameter", quote=True)
    return default


def _bool(raw: Mapping[str, Any], key: str, where: str, *, quote: bool = False) -> bool:
    """``raw[key]`` as a boolean: JSON true/false, or the strings "true"/"false" (default False)."""
    value = raw.get(key, False)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if not isinstance(value, bool):
        name = f"{where} '{key}'" if quote else f"{where}: '{key}'"
        raise InvalidInputError(f"{name} must be true or false, not {value!r}")
    return value


def _list(raw: Mapping[str, Any], key: str, where: str) -> Sequence[Any]:
    """``raw[key]`` as a list: a JSON list, a JSON list in a string (``"[1, 2]"``), or one bare value."""
    value = raw.get(key, [])
    if isinstance(value, str) and value.lstrip().startswith("["):
        with contextlib.suppress(ValueError):
            value = json.loads(value)
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list):
        raise InvalidInputError(f"{where}: '{key}' must be a list, not {value!r}")
    return value


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
