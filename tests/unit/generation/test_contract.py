"""Reading requests under the vLLM backend's contract: every bad field gets INVALID_ARG naming it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from coalesce.core.errors import InvalidInputError
from coalesce.generation.contract import read_request
from coalesce.settings import GenerateOptions

OPTIONS = GenerateOptions(max_tokens_limit=100, default_max_tokens=16)


def tensors(prompt: str | bytes = "hello", **extra) -> dict[str, np.ndarray]:
    text = prompt.encode() if isinstance(prompt, str) else prompt
    out = {"text_input": np.array([text], dtype=object)}
    for name, value in extra.items():
        if isinstance(value, bool):
            out[name] = np.array([value])
        else:
            out[name] = np.array([json.dumps(value).encode()], dtype=object)
    return out


def test_defaults_follow_the_vllm_backend():
    request = read_request(tensors(), None, OPTIONS)
    assert request.prompt == "hello" and not request.stream and request.prepend_prompt
    assert request.sampling.max_tokens == 16 and request.sampling.temperature == 1.0


def test_sampling_from_the_input_tensor_or_the_request_parameters():
    from_tensor = read_request(tensors(sampling_parameters={"max_tokens": 5, "temperature": 0, "stop": "x"}),
                               json.dumps({"max_tokens": 9}), OPTIONS)
    assert from_tensor.sampling.max_tokens == 5 and from_tensor.sampling.stop == ("x",)
    from_parameters = read_request(tensors(), json.dumps({"max_tokens": 9, "top_k": 3, "top_p": 0.5, "seed": 7,
                                                          "stream": True, "tenant": "a"}), OPTIONS)
    assert from_parameters.sampling.max_tokens == 9 and from_parameters.sampling.seed == 7
    assert from_parameters.stream and not from_parameters.prepend_prompt


def test_streaming_excludes_the_prompt_and_refuses_to_include_it():
    assert not read_request(tensors(stream=True), None, OPTIONS).prepend_prompt
    assert not read_request(tensors(exclude_input_in_output=True), None, OPTIONS).prepend_prompt
    with pytest.raises(InvalidInputError, match="exclude_input_in_output"):
        read_request(tensors(stream=True, exclude_input_in_output=False), None, OPTIONS)


@pytest.mark.parametrize(("parameters", "field"), [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 101}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokenz": 3}, "max_tokenz"), ({"temperature": -1}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"), ({"seed": -1}, "seed"), ({"stop": [1]}, "stop"),
    ({"stop": [""]}, "stop"), ({"ignore_eos": "yes"}, "ignore_eos"), ({"temperature": True}, "temperature"),
])
def test_bad_sampling_parameters_name_the_field(parameters, field):
    with pytest.raises(InvalidInputError, match=f"'{field}'"):
        read_request(tensors(sampling_parameters=parameters), None, OPTIONS)
    with pytest.raises(InvalidInputError, match=f"'{field}'"):
        read_request(tensors(), json.dumps(parameters), OPTIONS)


def test_bad_prompts_and_json_are_refused():
    with pytest.raises(InvalidInputError, match=r"text_input.*empty"):
        read_request(tensors(""), None, OPTIONS)
    with pytest.raises(InvalidInputError, match="UTF-8"):
        read_request(tensors(b"\xff\xfe"), None, OPTIONS)
    with pytest.raises(InvalidInputError, match=r"text_input.*missing"):
        read_request({}, None, OPTIONS)
    bad = tensors()
    bad["sampling_parameters"] = np.array([b"{not json"], dtype=object)
    with pytest.raises(InvalidInputError, match=r"sampling_parameters.*not valid JSON"):
        read_request(bad, None, OPTIONS)
    bad["sampling_parameters"] = np.array([b"[1, 2]"], dtype=object)
    with pytest.raises(InvalidInputError, match="JSON object"):
        read_request(bad, None, OPTIONS)
    with pytest.raises(InvalidInputError, match="request parameter 'stream'"):
        read_request(tensors(), json.dumps({"stream": "yes"}), OPTIONS)
