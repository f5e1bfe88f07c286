"""The gateway's pieces that need no server: error mapping, options, field checks, route choice, Matryoshka cuts."""

from __future__ import annotations

import numpy as np
import pytest

from coalesce.core.protocol import REFUSED_PREFIX
from coalesce.settings import ModelSettings, SettingsError
from coalesce_tools.gateway.catalog import EMBEDDINGS, GENERATE, RERANK, model_kind
from coalesce_tools.gateway.embeddings import cut
from coalesce_tools.gateway.errors import ApiError, from_triton
from coalesce_tools.gateway.fields import integer, number, refuse_unsupported, text_list
from coalesce_tools.gateway.options import GatewayOptions, GatewayOptionsError, api_keys_from_env


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
