"""Text generation through a real tritonserver: the vLLM backend's contract over HTTP generate and gRPC streams.

Every output is checked against transformers' own ``generate`` on the same weights, run
alone in this process: continuous batching must not change a single token. The model is
``tinylm`` of ``tests/models/`` (untrained, 3.9 M parameters: many long generations in
seconds); the shipped ``smollm2`` is served in ``test_smollm2.py``.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.conftest import model_dir
from tests.integration.conftest import TIGHT_MODEL

torch = pytest.importorskip("torch")

MODEL = "tinylm"
HF_DIR = model_dir(MODEL) / "1" / "hf"
WORDS = ["def", "class", "return", "import", "self", "value", "name", "data", "for", "while", "if", "else", "with",
         "try", "except", "raise", "yield", "lambda", "the", "a", "of", "to", "in", "is", "it", "that", "on"]


@pytest.fixture(scope="module")
def reference():
    """``reference(prompt, max_tokens)``: the text transformers' greedy ``generate`` adds to ``prompt``, alone."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(HF_DIR)).eval()
    tokenizer = Tokenizer.from_file(str(HF_DIR / "tokenizer.json"))

    def generate(prompt: str, max_tokens: int) -> str:
        ids = tokenizer.encode(prompt).ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_tokens, do_sample=False)
        return tokenizer.decode(out[0, len(ids):].tolist())

    return generate


def post(server, path: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/{path}", json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def events(body: str) -> list[dict]:
    """The JSON of each server-sent event of a ``generate_stream`` answer."""
    return [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]


def stream(server, model: str, prompt: str, *, parameters: dict | None = None, timeout_s: float = 120,
           cancel_after: int = 0, as_request_parameters: bool = False) -> tuple[list[str], list[str]]:
    """One gRPC streaming request (``tritonclient.grpc`` ``start_stream``): the texts streamed and any errors.

    ``parameters`` go in the ``sampling_parameters`` input, or with ``as_request_parameters``
    as the request's own parameters (as vLLM-backend clients may send them).
    """
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    texts: list[str] = []
    errors: list[str] = []
    done = threading.Event()

    def callback(result, error):
        if error is not None:
            errors.append(f"{error.status()}: {error.message()}")
            done.set()
            return
        output = result.as_numpy("text_output")
        if output is not None and output.size:
            texts.append(output.reshape(-1)[0].decode())
        if result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    inputs = []
    tensors = [("text_input", prompt.encode(), "BYTES"), ("stream", True, "BOOL")]
    if not as_request_parameters:
        tensors.append(("sampling_parameters", json.dumps(parameters or {}).encode(), "BYTES"))
    for name, value, datatype in tensors:
        tensor = grpcclient.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(np.array([value], dtype=object if datatype == "BYTES" else bool))
        inputs.append(tensor)
    client.start_stream(callback=callback)
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True,
                                  parameters=parameters if as_request_parameters else None)
        if cancel_after:
            deadline = time.monotonic() + timeout_s
            while len(texts) < cancel_after and not done.is_set() and time.monotonic() < deadline:
                time.sleep(0.005)
            # Cancel only a request still running: a cancel meeting the final response can lose the
            # request in Triton 2.51's gRPC frontend, and the model then never unloads.
            client.stop_stream(cancel_requests=not done.is_set())
            return texts, errors
        assert done.wait(timeout_s), f"no final response within {timeout_s} s"
    finally:
        client.stop_stream()
        client.close()
    return texts, errors


def metric(server, name: str, model: str, **labels: str) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    wanted = {"model": model, **labels}
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(found.get(k) == v for k, v in wanted.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for_metric(server, name: str, model: str, at_least: float, timeout_s: float = 10, **labels: str) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        value = metric(server, name, model, **labels)
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def test_http_generate_returns_prompt_and_output_as_transformers_does(server, reference):
    prompt = "def main(args):"
    status, body = post(server, f"{MODEL}/generate",
                        {"text_input": prompt, "parameters": {"max_tokens": 12, "temperature": 0}})
    assert status == 200, body
    assert json.loads(body)["text_output"] == prompt + reference(prompt, 12)
    status, body = post(server, f"{MODEL}/generate", {"text_input": prompt, "exclude_input_in_output": True,
                                                      "parameters": {"max_tokens": 12, "temperature": 0}})
    assert status == 200 and json.loads(body)["text_output"] == reference(prompt, 12)


def test_http_generate_stream_sends_the_new_text_of_each_step(server, reference):
    prompt = "import os, sys"
    status, body = post(server, f"{MODEL}/generate_stream",
                        {"text_input": prompt, "stream": True, "parameters": {"max_tokens": 20, "temperature": 0}})
    assert status == 200, body
    pieces = [e["text_output"] for e in events(body)]
    assert len(pieces) > 5
    assert "".join(pieces) == reference(prompt, 20)


def test_16_concurrent_grpc_streams_each_equal_generate_alone(server, reference):
    rng = random.Random(18)
    cases = [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120))), rng.randint(4, 64))
             for _ in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda case: stream(server, MODEL, case[0], parameters={
            "max_tokens": case[1], "temperature": 0}), cases))
    for (prompt, max_tokens), (texts, errors) in zip(cases, results, strict=True):
        assert not errors
        assert "".join(texts) == reference(prompt, max_tokens), (prompt, max_tokens)


def test_grpc_request_parameters_carry_sampling_as_the_input_does(server, reference):
    prompt = "for item in data:"
    texts, errors = stream(server, MODEL, prompt, parameters={"max_tokens": 10, "temperature": 0.0},
                           as_request_parameters=True)
    assert not errors and "".join(texts) == reference(prompt, 10)
    _, errors = stream(server, MODEL, prompt, parameters={"max_tokens": 10, "temprature": 0.5},
                       as_request_parameters=True)
    assert errors and "temprature" in errors[0]


def test_seeded_sampling_gives_the_same_text_alone_and_among_neighbours(server):
    parameters = {"max_tokens": 24, "temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 1234}
    alone, errors = stream(server, MODEL, "class Engine:", parameters=parameters)
    assert not errors
    with ThreadPoolExecutor(9) as pool:
        neighbours = [pool.submit(stream, server, MODEL, f"{word} " * 8, parameters={"max_tokens": 40,
                                                                                   "temperature": 1.0})
                      for word in WORDS[:8]]
        batched = pool.submit(stream, server, MODEL, "class Engine:", parameters=parameters).result()
        assert all(not f.result()[1] for f in neighbours)
    assert "".join(batched[0]) == "".join(alone)
    other, _ = stream(server, MODEL, "class Engine:", parameters={**parameters, "seed": 4321})
    assert "".join(other) != "".join(alone)


@pytest.mark.parametrize(("body", "field"), [
    ({"text_input": "", "parameters": {"max_tokens": 4}}, "text_input"),
    ({"text_input": "x", "sampling_parameters": "{not json"}, "not valid JSON"),
    ({"text_input": "x", "parameters": {"max_tokenz": 4}}, "max_tokenz"),
    ({"text_input": "x", "parameters": {"max_tokens": 0}}, "max_tokens"),
    ({"text_input": "x", "parameters": {"max_tokens": 100000}}, "max_tokens"),
    ({"text_input": "x", "parameters": {"temperature": -2}}, "temperature"),
    ({"text_input": "def " * 2000, "parameters": {"max_tokens": 4}}, "text_input"),
])
def test_bad_input_is_invalid_arg_naming_the_field_and_neighbours_are_unaffected(server, reference, body, field):
    prompt = "while True:"
    with ThreadPoolExecutor(1) as pool:
        neighbour = pool.submit(stream, server, MODEL, prompt, parameters={"max_tokens": 48, "temperature": 0})
        status, answer = post(server, f"{MODEL}/generate", body)
        texts, errors = neighbour.result()
    assert status == 400, answer
    assert field in json.loads(answer)["error"]
    assert not errors and "".join(texts) == reference(prompt, 48)


def test_a_cancelled_stream_frees_its_sequence(server):
    before = metric(server, "coalesce_generate_cancelled_total", MODEL)
    texts, _ = stream(server, MODEL, "def cancelled():", parameters={"max_tokens": 500, "temperature": 0,
                                                                     "ignore_eos": True}, cancel_after=3)
    assert 3 <= len(texts) < 500
    assert wait_for_metric(server, "coalesce_generate_cancelled_total", MODEL, before + 1) == before + 1
    deadline = time.monotonic() + 10
    while metric(server, "coalesce_generate_active_sequences", MODEL) > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(server, "coalesce_generate_active_sequences", MODEL) == 0


def test_a_full_kv_cache_refuses_with_unavailable_after_the_wait(server):
    """tinylm_tight holds 16 blocks: one 200-token request takes 13, the others wait 300 ms, then are refused."""
    parameters = {"max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: post(server, f"{TIGHT_MODEL}/generate", {
            "text_input": f"def f{i}():", "parameters": parameters}), range(4)))
    served = [body for status, body in results if status == 200]
    refused = [(status, json.loads(body)["error"]) for status, body in results if status != 200]
    assert served and refused, results
    # The backend answers UNAVAILABLE (tests/unit/generation); Triton 2.51's generate endpoint answers every error
    # of a decoupled model with 400, and its gRPC streams carry only the message.
    assert all(status in (400, 503) and "KV cache" in error and "retry later" in error for status, error in refused)
    assert wait_for_metric(server, "coalesce_generate_refusals_total", TIGHT_MODEL, len(refused),
                           reason="kv_full") == len(refused)


def test_metrics_count_tokens_latencies_pool_and_prefix_hits(server):
    system = "You are a careful assistant that answers in short sentences. " * 4
    for question in ("def a", "class b"):
        _, errors = stream(server, MODEL, system + question, parameters={"max_tokens": 4, "temperature": 0})
        assert not errors
    assert wait_for_metric(server, "coalesce_generate_prefix_cache_hit_tokens_total", MODEL, 16) >= 16
    assert metric(server, "coalesce_generate_tokens_total", MODEL) > 0
    assert metric(server, "coalesce_generate_time_to_first_token_seconds_count", MODEL) > 0
    assert metric(server, "coalesce_generate_inter_token_seconds_count", MODEL) > 0
    assert metric(server, "coalesce_generate_kv_cache_blocks_total", MODEL) == 64 * 1024 * 1024 // (4096 * 16)
    assert metric(server, "coalesce_generate_kv_cache_blocks", MODEL, state="cached") > 0


def test_the_readme_generate_examples_answer_as_shown(server):
    from tests.integration.test_readme import README

    examples = re.findall(r"/v2/models/(\w+)/(generate(?:_stream)?) \\\n\s+-d '([^']*)'", README)
    assert {endpoint for _, endpoint, _ in examples} == {"generate", "generate_stream"}
    for model, endpoint, body in examples:
        status, answer = post(server, f"{model}/{endpoint}", json.loads(body))
        assert status == 200, answer
        outputs = [e["text_output"] for e in events(answer)] if endpoint == "generate_stream" else [
            json.loads(answer)["text_output"]]
        assert outputs and all(isinstance(o, str) for o in outputs)
        if endpoint == "generate":
            assert outputs[0].startswith(json.loads(body)["text_input"]), "the prompt comes first unless excluded"
        else:
            assert len(outputs) > 1, "one event per step"


def test_unloading_during_a_stream_ends_it_cleanly_and_the_model_loads_again(server, http_client, reference):
    """A stream in flight when its model is unloaded finishes (Triton waits for it) or ends in an error; never hangs."""
    from tests.integration.conftest import add_model

    name = "tinylm_unload"
    add_model(server.options.model_repository, name, source=model_dir(MODEL))
    http_client.load_model(name)
    try:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(stream, server, name, "def unload():", parameters={
                "max_tokens": 300, "temperature": 0, "ignore_eos": True})
            time.sleep(0.5)
            http_client.unload_model(name)
            texts, errors = running.result(timeout=120)
        assert errors or len(texts) >= 250, (len(texts), errors)
        http_client.load_model(name)
        status, body = post(server, f"{name}/generate", {"text_input": "def again():",
                                                          "parameters": {"max_tokens": 8, "temperature": 0}})
        assert status == 200 and json.loads(body)["text_output"] == "def again():" + reference("def again():", 8)
    finally:
        http_client.unload_model(name)
