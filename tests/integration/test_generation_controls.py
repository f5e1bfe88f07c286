"""Sampling controls, structured output and priority on the shipped ``smollm2``, through a real tritonserver.

Sixteen gRPC streams at once, mixed: JSON-schema, regex and choice constraints beside plain
greedy streams with and without penalties. Every constrained output parses and validates
(``jsonschema``), and every greedy output equals transformers' ``generate`` on the same model
alone (its float32 weights; the shipped config stores them in fp16), with the same penalty
and, for a constrained one, the same grammar mask applied by a logits processor.
"""

from __future__ import annotations

import json
import re
import threading
import time

import numpy as np
import pytest

from tests.conftest import built
from tests.integration.test_generate import post, stream

torch = pytest.importorskip("torch")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "smollm2"

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
NUMBERS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4}
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "capital"],
        "properties": {"city": {"enum": ["Paris", "Berlin", "Rome"]}, "capital": {"type": "boolean"}}}
PHONE = r"[0-9]{3}-[0-9]{4}"
MOODS = ["positive", "negative", "neutral"]


@pytest.fixture(scope="module")
def hf():
    """SmolLM2 as transformers loads it (float32) and its tokenizer, for the references."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = built(MODEL) / "hf"
    return AutoModelForCausalLM.from_pretrained(str(folder)).eval(), AutoTokenizer.from_pretrained(str(folder))


def chat(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)


def reference(hf, prompt: str, sampling: dict) -> str:
    """transformers' greedy ``generate`` alone: the same penalty and, for a guide, the same grammar mask."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from coalesce.generation.constraints import GrammarCompiler, apply_bitmask, new_bitmask, read_guide

    model, tokenizer = hf
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    processors = LogitsProcessorList()
    guide = read_guide(sampling, "reference")
    if guide is not None:
        eos = [model.generation_config.eos_token_id]
        matcher = GrammarCompiler(str(built(MODEL) / "hf" / "tokenizer.json"), model.config.vocab_size,
                                  eos).matcher(guide)

        class Guided(LogitsProcessor):
            def __call__(self, input_ids, scores):
                if input_ids.shape[1] > ids.shape[1]:
                    assert matcher.accept(int(input_ids[0, -1]))
                bitmask = new_bitmask(1, scores.shape[1])
                matcher.fill(bitmask, 0)
                apply_bitmask(scores, bitmask, [0])
                return scores

        processors.append(Guided())
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=sampling["max_tokens"],
                             do_sample=False, repetition_penalty=sampling.get("repetition_penalty", 1.0),
                             logits_processor=processors)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def streams(server, jobs: list[tuple[str, dict]]) -> list[tuple[str, list[str]]]:
    """Run ``jobs`` (prompt, sampling parameters) as concurrent gRPC streams; each one's text and errors."""
    results: list[tuple[str, list[str]]] = [("", [])] * len(jobs)
    start = threading.Barrier(len(jobs))

    def run(index: int, prompt: str, sampling: dict) -> None:
        start.wait()
        texts, errors = stream(server, MODEL, prompt, parameters=sampling, timeout_s=300)
        results[index] = ("".join(texts), errors)

    threads = [threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=400)
    return results


def test_sixteen_mixed_streams_validate_and_equal_transformers_alone(server, hf):
    _, tokenizer = hf
    greedy = {"temperature": 0, "max_tokens": 40}
    constrained = [
        (chat(tokenizer, "Describe Ana, who is 31, as JSON."), {**greedy, "guided_json": PERSON}),
        (chat(tokenizer, "Describe Bob, aged 58, as a JSON object."), {**greedy, "guided_json": json.dumps(PERSON)}),
        (chat(tokenizer, "List three small numbers as JSON."), {**greedy, "guided_json": NUMBERS}),
        (chat(tokenizer, "Which city is the capital of Italy? Answer in JSON."), {**greedy, "guided_json": CITY}),
        (chat(tokenizer, "Give me a phone number."), {**greedy, "guided_regex": PHONE}),
        (chat(tokenizer, "Write a seven digit number with a dash."), {**greedy, "guided_regex": PHONE}),
        (chat(tokenizer, "How does 'I love this film' feel?"), {**greedy, "guided_choice": MOODS}),
        (chat(tokenizer, "How does 'this is awful' feel?"), {**greedy, "guided_choice": MOODS}),
    ]
    # Seeded sampling under a schema: valid, though no reference text.
    sampled = [(chat(tokenizer, "Invent a person as JSON."),
                {"temperature": 0.9, "seed": seed, "max_tokens": 40, "guided_json": PERSON}) for seed in (1, 2)]
    plain = [
        ("The capital of France is", greedy),
        ("Once upon a time", {**greedy, "repetition_penalty": 1.3}),
        (chat(tokenizer, "Name three colours."), greedy),
        (chat(tokenizer, "What is 2 + 2?"), {**greedy, "repetition_penalty": 1.2}),
        ("def fibonacci(n):", greedy),
        ("The best way to learn a language is", {**greedy, "repetition_penalty": 1.5}),
    ]
    jobs = [*constrained, *sampled, *plain]
    assert len(jobs) == 16
    results = streams(server, jobs)
    for (prompt, sampling), (text, errors) in zip(jobs, results, strict=True):
        assert not errors, (sampling, errors)
        if "guided_json" in sampling:
            schema = sampling["guided_json"]
            jsonschema.validate(json.loads(text), json.loads(schema) if isinstance(schema, str) else schema)
        elif "guided_regex" in sampling:
            assert re.fullmatch(sampling["guided_regex"], text), text
        elif "guided_choice" in sampling:
            assert text in sampling["guided_choice"], text
        if sampling["temperature"] == 0:
            assert text == reference(hf, prompt, sampling), (prompt, sampling)
    # The same seed, alone this time, gives the same sample it gave among fifteen others.
    for (prompt, sampling), (text, _) in zip(sampled, results[len(constrained):][:len(sampled)], strict=True):
        texts, errors = stream(server, MODEL, prompt, parameters=sampling)
        assert not errors and "".join(texts) == text


@pytest.mark.parametrize("key, value, reason", [
    ("guided_json", {"type": "nonsense"}, "guided_json' is not a valid JSON Schema"),
    ("guided_json", "{not json", "guided_json"),
    ("guided_regex", "([a-z", "guided_regex' is not a valid regular expression"),
    ("guided_choice", [], "guided_choice"),
])
def test_a_bad_guide_is_invalid_arg_naming_it(server, key, value, reason):
    """Over HTTP, where Triton's code shows (a gRPC stream's error carries the message only): 400, naming it."""
    # Triton's HTTP parameters are scalars: a schema or a list goes as its JSON text, as vLLM clients send it.
    text = value if isinstance(value, str) else json.dumps(value)
    status, body = post(server, f"{MODEL}/generate", {"text_input": "Hello",
                                                      "parameters": {"max_tokens": 4, key: text}})
    assert status == 400 and reason in json.loads(body)["error"], body
    texts, errors = stream(server, MODEL, "Hello", parameters={"max_tokens": 4, key: value})
    assert not texts and len(errors) == 1 and reason in errors[0], errors


def test_priority_orders_admission_when_the_running_set_is_full(server, repository):
    """A variant that runs one sequence at a time (``max_active_sequences`` 1), so a full running set is quick.

    While one long request runs, four wait: two at level 5, one at level 1 (the highest, Triton's
    convention) sent as a sampling parameter and one at level 1 sent as a request parameter.
    They finish level 1 first, then level 5, each level in arrival order.
    """
    import tritonclient.grpc as grpcclient

    from tests.integration.conftest import add_model

    name = "smollm2_one_at_a_time"
    # The waiting requests may wait longer than the shipped max_queue_wait_ms on a loaded machine.
    add_model(repository, name, source=built(MODEL).parent,
              parameters={"max_active_sequences": "1", "max_queue_wait_ms": "120000"})
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.load_model(name)
    try:
        finished: dict[str, float] = {}
        failures: list[str] = []

        def send(label: str, parameters: dict, *, as_request_parameters: bool = False) -> threading.Thread:
            def run() -> None:
                _, errors = stream(server, name, "Count to ten:", parameters=parameters,
                                   as_request_parameters=as_request_parameters, timeout_s=300)
                failures.extend(errors)
                finished[label] = time.monotonic()

            thread = threading.Thread(target=run)
            thread.start()
            return thread

        short = {"max_tokens": 3, "temperature": 0}
        # Long enough (about 5 s here, more under load) that all four wait behind it however slow the machine.
        running = send("running", {"max_tokens": 160, "ignore_eos": True, "temperature": 0})
        time.sleep(1.0)  # it holds the one place now
        waiting = [send("late 5a", {**short, "priority_level": 5})]
        time.sleep(0.2)
        waiting.append(send("late 5b", {**short, "priority_level": 5}))
        time.sleep(0.2)
        waiting.append(send("urgent 1a", {**short, "priority_level": 1}))
        time.sleep(0.2)
        waiting.append(send("urgent 1b", {**short, "priority_level": "1"}, as_request_parameters=True))
        for thread in (running, *waiting):
            thread.join(timeout=300)
        assert not failures, failures
        order = sorted(finished, key=finished.__getitem__)
        assert order == ["running", "urgent 1a", "urgent 1b", "late 5a", "late 5b"], order
    finally:
        client.unload_model(name)


def test_logprobs_and_counts_come_back_as_vllm_sends_them(server, hf):
    """``logprobs`` (top 2) and the additional outputs over gRPC: one entry per token, the counts right."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    values = [("text_input", b"The capital of France is", "BYTES"),
              ("sampling_parameters", json.dumps({"max_tokens": "5", "temperature": "0", "logprobs": "2"}).encode(),
               "BYTES"), ("stream", False, "BOOL"), ("return_logprobs", True, "BOOL"),
              ("return_num_input_tokens", True, "BOOL"), ("return_num_output_tokens", True, "BOOL"),
              ("return_cumulative_logprob", True, "BOOL"), ("return_finish_reason", True, "BOOL")]
    inputs = []
    for tensor_name, value, datatype in values:
        tensor = grpcclient.InferInput(tensor_name, [1], datatype)
        tensor.set_data_from_numpy(np.array([value], dtype=object if datatype == "BYTES" else bool))
        inputs.append(tensor)
    done = threading.Event()
    results = []
    client.start_stream(callback=lambda result, error: (results.append((result, error)), done.set()))
    try:
        client.async_stream_infer(MODEL, inputs)
        assert done.wait(120)
    finally:
        client.stop_stream()
    result, error = results[0]
    assert error is None, error
    logprobs = json.loads(result.as_numpy("logprobs")[0])
    assert len(logprobs) == 5 and all(1 <= len(entry) <= 3 for entry in logprobs)
    assert int(result.as_numpy("num_output_tokens")[0]) == 5
    prompt_tokens = len(hf[1]("The capital of France is", add_special_tokens=False)["input_ids"])
    assert int(result.as_numpy("num_input_tokens")[0]) == prompt_tokens
    assert result.as_numpy("finish_reason")[0] == b"length"
    best = [max(entry.values(), key=lambda e: e["logprob"]) for entry in logprobs]
    assert abs(sum(e["logprob"] for e in best) - float(result.as_numpy("cumulative_logprob")[0])) < 1e-3
