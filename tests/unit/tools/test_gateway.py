"""The gateway's pieces that need no server: error mapping, options, field checks, route choice, Matryoshka cuts,
structured output and priority on a generation request."""

from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest

from coalesce.core.protocol import PRIORITY_PARAMETER, REFUSED_PREFIX
from coalesce.settings import ModelSettings, SettingsError
from coalesce_tools.gateway import completions
from coalesce_tools.gateway.app import Gateway
from coalesce_tools.gateway.catalog import EMBEDDINGS, GENERATE, RERANK, model_kind
from coalesce_tools.gateway.embeddings import cut
from coalesce_tools.gateway.errors import ApiError, from_triton
from coalesce_tools.gateway.fields import integer, number, refuse_unsupported, text_list
from coalesce_tools.gateway.options import GatewayOptions, GatewayOptionsError, api_keys_from_env
from coalesce_tools.gateway.triton import Triton


@pytest.mark.parametrize(("status", "message", "expected"), [
    ("StatusCode.INVALID_ARGUMENT", "input 'TEXT' is empty", 400),
    ("StatusCode.NOT_FOUND", "Request for unknown model: 'x' is not found", 404),
    ("StatusCode.UNAVAILABLE", "Stub process 'minilm_0_0' is not healthy.", 503),
    ("StatusCode.UNAVAILABLE", REFUSED_PREFIX + "queue full (4096 rows)", 429),
    ("StatusCode.INTERNAL", "onnxruntime failed", 500),
    (None, "input 'text_input' is 5000 tokens; the context holds 2048", 400),
    (None, REFUSED_PREFIX + "the KV cache is full", 429),
    (None, "Stub process 'smollm2_0_0' is not healthy.", 503),
])
def test_triton_errors_map_to_http_statuses_keeping_the_message(status, message, expected):
    error = from_triton(status, message, model="x")
    assert error.status == expected
    assert message in error.message
    body = error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}


def test_a_refusal_is_a_rate_limit_error():
    body = from_triton("StatusCode.UNAVAILABLE", REFUSED_PREFIX + "over quota", model="m").body()["error"]
    assert body["type"] == "rate_limit_error" and body["code"] == "rate_limit_exceeded"


def test_keys_come_from_the_variable_and_every_line_of_the_file(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("alpha\n\nbeta\n")
    monkeypatch.setenv("COALESCE_API_KEY", "gamma")
    monkeypatch.setenv("COALESCE_API_KEY_FILE", str(keys))
    assert api_keys_from_env() == ("gamma", "alpha", "beta")
    keys.write_text("\n")
    with pytest.raises(GatewayOptionsError, match="holds no key"):
        api_keys_from_env()


def test_options_refuse_bad_ports_and_limits(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_PORT", "nine")
    with pytest.raises(GatewayOptionsError, match="OPENAI_PORT"):
        GatewayOptions.from_env(tmp_path, triton_grpc_url="127.0.0.1:8001")
    with pytest.raises(GatewayOptionsError, match="max_body_bytes"):
        GatewayOptions(model_repository=tmp_path, max_body_bytes=10)
    assert "secret" not in repr(GatewayOptions(model_repository=tmp_path, api_keys=("secret",)))


def test_fields_name_what_is_wrong():
    with pytest.raises(ApiError, match="'max_tokens' is 0") as caught:
        integer({"max_tokens": 0}, "max_tokens", low=1)
    assert caught.value.param == "max_tokens"
    with pytest.raises(ApiError, match="must be an integer"):
        integer({"seed": True}, "seed", low=0)
    with pytest.raises(ApiError, match="above 0"):
        number({"top_p": 0}, "top_p", low=0, high=1, low_open=True)
    with pytest.raises(ApiError, match="token ids"):
        text_list([[1, 2]], "input")
    with pytest.raises(ApiError, match="empty list"):
        text_list([], "input")
    assert text_list("one", "input") == ["one"]
    refuse_unsupported({"n": 1, "echo": None}, {"n": (1, "one"), "echo": (False, "no")})
    with pytest.raises(ApiError, match="'n' = 3 is not supported"):
        refuse_unsupported({"n": 3}, {"n": (1, "one choice per request")})


def config(task: str, inputs: list[str], output: tuple[str, int] | None) -> dict:
    return {"name": "m", "backend": "coalesce", "parameters": {"task": {"string_value": task}},
            "input": [{"name": n, "data_type": "TYPE_STRING", "dims": ["1"]} for n in inputs],
            "output": [] if output is None else [{"name": output[0], "data_type": "TYPE_FP32",
                                                  "dims": [str(output[1])]}]}


@pytest.mark.parametrize(("task", "inputs", "output", "kind"), [
    ("embedding", ["TEXT"], ("EMBEDDING", 384), EMBEDDINGS),
    ("classify", ["TEXT", "TEXT_PAIR"], ("SCORES", 1), RERANK),
    ("classify", ["TEXT"], ("SCORES", 3), None),
    ("classify", ["TEXT", "TEXT_PAIR"], ("SCORES", 3), None),
    ("generate", ["text_input"], ("text_output", -1), GENERATE),
])
def test_a_models_route_follows_from_its_task_and_tensors(task, inputs, output, kind):
    settings = ModelSettings.from_parameters({"task": task})
    assert model_kind(settings, config(task, inputs, output))[0] == kind


def test_matryoshka_widths_are_parsed_and_checked():
    settings = ModelSettings.from_parameters({"matryoshka_dimensions": "256, 128,64"})
    assert settings.embedding.matryoshka_widths == (256, 128, 64)
    with pytest.raises(SettingsError, match="matryoshka_dimensions"):
        ModelSettings.from_parameters({"matryoshka_dimensions": "256,0"})


def test_a_matryoshka_cut_is_renormalised():
    vectors = np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32)
    head = cut(vectors, 4, normalize=True)
    assert head.shape == (3, 4)
    np.testing.assert_allclose(np.linalg.norm(head, axis=1), 1.0, rtol=1e-6)
    expected = vectors[:, :4] / np.linalg.norm(vectors[:, :4], axis=1, keepdims=True)
    np.testing.assert_allclose(head, expected, rtol=1e-6)
    np.testing.assert_array_equal(cut(vectors, 4, normalize=False), vectors[:, :4])


class _Tokenizer:
    """One token per character: enough for the gateway's counts, no files needed."""

    chat_template = "{{ messages }}"

    def encode(self, text: str, add_special_tokens: bool = True) -> types.SimpleNamespace:
        return types.SimpleNamespace(ids=list(range(len(text))))

    def apply_chat_template(self, messages, tokenize: bool, add_generation_prompt: bool) -> str:
        return "".join(m["content"] for m in messages)


def generate_model() -> types.SimpleNamespace:
    tokenizer = _Tokenizer()
    return types.SimpleNamespace(name="smollm2", settings=ModelSettings.from_parameters({"task": "generate"}),
                                 chat_tokenizer=tokenizer, prompt_tokenizer=tokenizer)


def chat(**fields) -> completions.Generation:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **fields}
    return completions.read(generate_model(), body, chat=True)


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize(("fields", "expected", "param"), [
    ({}, {}, None),
    ({"response_format": {"type": "text"}}, {}, None),
    ({"response_format": {"type": "json_object"}}, {"guided_json": {"type": "object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                  "strict": True}}},
     {"guided_json": PERSON}, "response_format"),
    ({"guided_json": PERSON}, {"guided_json": PERSON}, "guided_json"),
    ({"guided_json": '{"type": "string"}'}, {"guided_json": '{"type": "string"}'}, "guided_json"),
    ({"guided_regex": "[0-9]{3}"}, {"guided_regex": "[0-9]{3}"}, "guided_regex"),
    ({"guided_choice": ["yes", "no"]}, {"guided_choice": ["yes", "no"]}, "guided_choice"),
    ({"response_format": {"type": "text"}, "guided_choice": ["a"]}, {"guided_choice": ["a"]}, "guided_choice"),
])
def test_response_format_and_guided_fields_become_one_guided_sampling_parameter(fields, expected, param):
    generation = chat(**fields)
    guided = {k: v for k, v in generation.sampling.items() if k.startswith("guided_")}
    assert guided == expected
    assert generation.guide_param == param
    assert generation.sampling["max_tokens"] == 8


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"response_format": {"type": "grammar"}}, "response_format", "'grammar' is not supported"),
    ({"response_format": "json"}, "response_format", "string 'type'"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "found nothing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
     "response_format.json_schema.schema", "found str"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict", "true or false"),
    ({"guided_json": 3}, "guided_json", "JSON Schema"),
    ({"guided_regex": ""}, "guided_regex", "non-empty string"),
    ({"guided_choice": ["a", 1]}, "guided_choice", "non-empty list"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "at most one"),
    ({"guided_grammar": "root ::= 'a'"}, "guided_grammar", "not supported"),
])
def test_a_bad_guide_is_a_400_naming_its_field(fields, param, words):
    with pytest.raises(ApiError, match=words) as caught:
        chat(**fields)
    assert caught.value.status == 400 and caught.value.param == param


def test_the_backends_refusal_of_a_schema_names_the_field_it_came_from():
    refusal = from_triton(None, "'guided_json' is not a valid JSON schema: unknown type 'nonsense'", model="smollm2")
    assert refusal.status == 400  # a stream's error has no status: the backend's message decides
    named = completions._named(chat(response_format={"type": "json_object"}), refusal)
    assert named.status == 400 and named.param == "response_format"
    assert "response_format" in named.message and "nonsense" in named.message
    assert completions._named(chat(guided_json={"type": "nonsense"}), refusal).param == "guided_json"
    other = from_triton(None, "input 'text_input' is empty", model="smollm2")
    assert completions._named(chat(guided_regex="a"), other) is other
    assert from_triton("StatusCode.INVALID_ARGUMENT", "'guided_regex' is not a valid regex", model="m").status == 400


def test_request_parameters_ride_on_the_generation():
    model = generate_model()
    body = {"prompt": "Hi", "max_tokens": 4}
    generation = completions.read(model, body, chat=False, parameters={"tenant": "t", PRIORITY_PARAMETER: 2})
    assert generation.parameters == {"tenant": "t", PRIORITY_PARAMETER: 2}
    assert PRIORITY_PARAMETER not in generation.sampling
    assert completions.read(model, body, chat=False).parameters == {}


@pytest.mark.parametrize(("headers", "expected"), [
    ({}, {}),
    ({"x-coalesce-tenant": "search", "x-coalesce-priority": "2"}, {"tenant": "search", PRIORITY_PARAMETER: 2}),
    ({"x-coalesce-priority": "0"}, {PRIORITY_PARAMETER: 0}),
])
def test_headers_become_request_parameters(headers, expected):
    assert Gateway._parameters(types.SimpleNamespace(headers=headers)) == expected


@pytest.mark.parametrize("priority", ["abc", "-1", "1.5", "\u00b2", str(2**63)])
def test_a_bad_priority_header_is_a_400_naming_it(priority):
    with pytest.raises(ApiError, match="not a whole number") as caught:
        Gateway._parameters(types.SimpleNamespace(headers={"x-coalesce-priority": priority}))
    assert caught.value.status == 400 and caught.value.param == "x-coalesce-priority"


def test_the_stream_request_carries_the_request_parameters(monkeypatch):
    """What ``Triton.generate`` builds: tritonclient's request with tenant and priority as typed parameters."""
    from tritonclient.grpc import _utils

    built = {}
    real = _utils._get_inference_request

    def capture(**kwargs):
        built["request"] = real(**kwargs)
        raise RuntimeError("stop before the call")

    monkeypatch.setattr(_utils, "_get_inference_request", capture)
    triton = object.__new__(Triton)  # no channel: the request is built before any call

    async def first() -> None:
        await triton.generate("smollm2", "Hi", {"max_tokens": 1}, request_id="r",
                              parameters={"tenant": "t", PRIORITY_PARAMETER: 3}).__anext__()

    with pytest.raises(RuntimeError, match="stop before the call"):
        asyncio.run(first())
    parameters = built["request"].parameters
    assert parameters["tenant"].string_param == "t"
    assert parameters[PRIORITY_PARAMETER].int64_param == 3

