"""The gateway in front of a real tritonserver, driven by clients no one here wrote.

The official ``openai`` SDK (models, embeddings float and base64, completions, chat streamed
and not, typed errors), ``langchain-openai`` (``OpenAIEmbeddings``, ``ChatOpenAI``), and plain
HTTP for the rerank routes and what the SDKs do not show (``[DONE]``, request ids, metrics,
cancellation, priority headers). What comes back is checked against Triton's own answers on
the same server: embeddings against ``tritonclient``'s vectors, greedy chat against Triton's
generate endpoint; structured output (``response_format``, vLLM's ``guided_*`` in
``extra_body``) by parsing and validating what the model wrote.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
import urllib.request

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from coalesce_tools.gateway.options import GatewayOptions
from coalesce_tools.gateway.server import GatewayProcess
from coalesce_tools.launcher import free_port
from tests.integration.conftest import start_gateway

openai = pytest.importorskip("openai")

EMBED = "minilm"
RERANK = "minilm_rerank"
CHAT = "smollm2"
TINY = "tinylm"  # untrained: fast, for what does not read the text
TEXTS = ["The cat sat on the mat.", "Triton serves models over HTTP and gRPC.", "Coalesce batches requests.",
         "Paris is the capital of France."]


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def triton_vectors(server, texts: list[str]) -> np.ndarray:
    with grpcclient.InferenceServerClient(server.grpc_url) as triton:
        tensor = grpcclient.InferInput("TEXT", [len(texts), 1], "BYTES")
        tensor.set_data_from_numpy(np.array(texts, dtype=object).reshape(-1, 1))
        return triton.infer(EMBED, [tensor]).as_numpy("EMBEDDING")


def triton_generate(server, prompt: str, max_tokens: int) -> str:
    body = {"text_input": prompt, "parameters": {"max_tokens": max_tokens, "temperature": 0},
            "exclude_input_in_output": True}
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/{CHAT}/generate", json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["text_output"]


def chat_prompt(repository, messages) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(repository / CHAT / "1" / "hf"))
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_models_lists_each_ready_model_with_its_routes(client):
    models = {m.id: m for m in client.models.list()}
    assert {EMBED, RERANK, CHAT} <= set(models)
    assert models[EMBED].model_extra["coalesce"]["routes"] == ["/v1/embeddings"]
    assert "/v1/rerank" in models[RERANK].model_extra["coalesce"]["routes"]
    assert "/v1/chat/completions" in models[CHAT].model_extra["coalesce"]["routes"]
    assert client.models.retrieve(EMBED).id == EMBED


def test_embeddings_equal_tritonclient_vectors_float_and_base64(server, client):
    expected = triton_vectors(server, TEXTS)
    floats = client.embeddings.create(model=EMBED, input=TEXTS)
    got = np.array([d.embedding for d in sorted(floats.data, key=lambda d: d.index)], dtype=np.float32)
    np.testing.assert_array_equal(got, expected)
    encoded = client.embeddings.create(model=EMBED, input=TEXTS, encoding_format="base64")
    decoded = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype=np.float32) for d in encoded.data])
    np.testing.assert_array_equal(decoded, expected)
    one = client.embeddings.create(model=EMBED, input=TEXTS[0])
    np.testing.assert_array_equal(np.array(one.data[0].embedding, dtype=np.float32), expected[0])


def test_embedding_usage_counts_the_models_own_tokens(client, repository):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(repository / EMBED / "1" / "tokenizer.json"))
    tokenizer.no_padding()  # the packaged file pads to 128; the model reads each text's own tokens
    tokenizer.no_truncation()
    long_text = "word " * 400  # past max_sequence_length: the count is what the model read, 256
    reply = client.embeddings.create(model=EMBED, input=[*TEXTS, long_text])
    expected = sum(len(tokenizer.encode(t).ids) for t in TEXTS) + 256
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == expected


def test_more_texts_than_max_batch_size_come_back_in_order(server, client):
    texts = [f"sentence number {i} about batching" for i in range(150)]  # minilm's max_batch_size is 64
    reply = client.embeddings.create(model=EMBED, input=texts)
    assert [d.index for d in reply.data] == list(range(150))
    got = np.array([d.embedding for d in reply.data], dtype=np.float32)
    np.testing.assert_array_equal(got[100:110], triton_vectors(server, texts[100:110]))


def test_dimensions_are_refused_unless_the_model_declares_them(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=EMBED, input="x", dimensions=128)
    assert caught.value.body["param"] == "dimensions" and "matryoshka_dimensions" in caught.value.body["message"]
    assert len(client.embeddings.create(model=EMBED, input="x", dimensions=384).data[0].embedding) == 384


def test_typed_errors_carry_openai_json_and_the_backends_message(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.embeddings.create(model="no_such_model", input="x")
    assert caught.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=CHAT, input="x")
    assert "does not serve this route" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=EMBED, input=[[1, 2, 3]])
    assert caught.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=CHAT, prompt="Hi", n=2)
    assert caught.value.body["param"] == "n"
    # Refused by the backend itself: its message comes through.
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=EMBED, input="x" * (2 << 20))
    assert "max_text_bytes" in caught.value.body["message"] or "bytes" in caught.value.body["message"]


def test_keys_body_limit_and_request_ids(server, repository):
    keyed = start_gateway(server, repository, api_keys=("k-one", "k-two"), max_body_bytes=4096)
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=keyed.url + "/v1", api_key="k-two", max_retries=0)
        assert good.embeddings.create(model=EMBED, input="x").data
        with pytest.raises(openai.APIStatusError) as caught:
            good.embeddings.create(model=EMBED, input=["y" * 1000] * 8)
        assert caught.value.status_code == 413 and "OPENAI_MAX_BODY_BYTES" in caught.value.body["message"]
        reply = httpx.post(keyed.url + "/v1/embeddings", json={"model": EMBED, "input": "x"},
                           headers={"Authorization": "Bearer k-one", "x-request-id": "trace-42"})
        assert reply.status_code == 200 and reply.headers["x-request-id"] == "trace-42"
        assert httpx.get(keyed.url + "/metrics").status_code == 200  # scraped without a key
    finally:
        keyed.stop()


def test_a_gateway_whose_triton_is_gone_answers_503(repository):
    options = GatewayOptions(model_repository=repository, triton_grpc_url=f"127.0.0.1:{free_port()}",
                             port=free_port())
    process = GatewayProcess(options)
    process._spawn()  # not start(): its /health waits for a Triton that never comes
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                reply = httpx.post(process.url + "/v1/embeddings", json={"model": EMBED, "input": "x"}, timeout=10)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the gateway did not start"
                time.sleep(0.2)
        assert reply.status_code == 503 and reply.json()["error"]["type"] == "server_error"
        assert httpx.get(process.url + "/health").status_code == 503
    finally:
        process.stop()


def rerank(gateway, path: str, body: dict) -> httpx.Response:
    return httpx.post(gateway.url + path, json=body, timeout=60)


def test_rerank_orders_documents_by_relevance_in_cohere_and_jina_shapes(gateway):
    documents = ["The Eiffel Tower is in Paris.", "Bananas are rich in potassium.",
                 "Paris is the capital and largest city of France.", "Python is a programming language."]
    for path in ("/v1/rerank", "/v2/rerank"):
        reply = rerank(gateway, path, {"model": RERANK, "query": "What is the capital of France?",
                                       "documents": [{"text": d} for d in documents], "top_n": 3})
        assert reply.status_code == 200, reply.text
        results = reply.json()["results"]
        assert len(results) == 3 and results[0]["index"] == 2
        assert results[0]["document"]["text"] == documents[2]
        scores = [r["relevance_score"] for r in results]
        assert scores == sorted(scores, reverse=True)
    bare = rerank(gateway, "/v1/rerank", {"model": RERANK, "query": "fruit nutrition", "documents": documents,
                                          "return_documents": False}).json()
    assert bare["results"][0]["index"] == 1 and "document" not in bare["results"][0]
    assert bare["usage"]["total_tokens"] > 0


def test_score_matches_rerank_pair_by_pair_and_one_to_many(gateway):
    query, documents = "capital of France", ["Paris is in France.", "Cats purr."]
    many = rerank(gateway, "/v1/score", {"model": RERANK, "text_1": query, "text_2": documents}).json()
    pairs = rerank(gateway, "/v1/score", {"model": RERANK, "text_1": [query, query], "text_2": documents}).json()
    ranked = rerank(gateway, "/v1/rerank", {"model": RERANK, "query": query, "documents": documents}).json()
    by_index = {r["index"]: r["relevance_score"] for r in ranked["results"]}
    assert [d["score"] for d in many["data"]] == [d["score"] for d in pairs["data"]] == [by_index[0], by_index[1]]
    bad = rerank(gateway, "/v1/score", {"model": RERANK, "text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"
    wrong = rerank(gateway, "/v1/rerank", {"model": EMBED, "query": "q", "documents": ["d"]})
    assert wrong.status_code == 400 and "does not serve this route" in wrong.json()["error"]["message"]


def test_greedy_chat_equals_tritons_generate_endpoint_streamed_and_not(server, repository, client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = triton_generate(server, chat_prompt(repository, messages), 12)
    whole = client.chat.completions.create(model=CHAT, messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].message.role == "assistant"
    assert "Paris" in expected
    pieces, usage, finish = [], None, None
    for chunk in client.chat.completions.create(model=CHAT, messages=messages, max_completion_tokens=12,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == expected
    assert usage == whole.usage and usage.prompt_tokens > 10 and finish == whole.choices[0].finish_reason


def test_completions_with_stop_seed_and_length(server, client):
    prompt = "The capital of France is"
    greedy = client.completions.create(model=CHAT, prompt=prompt, max_tokens=6, temperature=0)
    assert greedy.choices[0].text == triton_generate(server, prompt, 6)
    assert greedy.choices[0].finish_reason == "length" and greedy.usage.completion_tokens == 6
    stopped = client.completions.create(model=CHAT, prompt=prompt, max_tokens=20, temperature=0, stop=["."])
    assert "." not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    seeded = [client.completions.create(model=CHAT, prompt=prompt, max_tokens=8, temperature=1.0, top_p=0.9,
                                        seed=7).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=CHAT, prompt=prompt, max_tokens=100_000)
    assert caught.value.body["param"] == "max_tokens"


def test_sse_stream_ends_with_done(gateway):
    body = {"model": CHAT, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=60) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in reply.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def backend_cancelled(server) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return sum(float(v) for v in re.findall(rf'^coalesce_generate_cancelled_total{{[^}}]*model="{CHAT}"[^}}]*}} (\S+)$',
                                             text, re.M))


def test_a_client_that_disconnects_cancels_its_generation(server, gateway):
    before = backend_cancelled(server)
    body = {"model": CHAT, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=60) as reply:
        received = 0
        for line in reply.iter_lines():
            received += line.startswith("data: ")
            if received >= 4:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 10
    while backend_cancelled(server) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backend_cancelled(server) == before + 1
    page = httpx.get(gateway.url + "/metrics").text
    assert re.search(rf'coalesce_gateway_cancelled_total{{model="{CHAT}"}} [1-9]', page)


def test_a_stream_stopped_at_its_final_piece_is_not_cancelled_but_one_left_early_is(server):
    """The SSE route stops reading at the final piece; that must end the gRPC stream, not cancel it.

    A cancel that meets the final response can lose the request in Triton 24.10's gRPC
    frontend, and the model then never unloads (the server's stop times out).
    """
    from coalesce_tools.gateway.triton import Triton

    async def run() -> list[str]:
        cancelled: list[str] = []
        triton = Triton(server.grpc_url, timeout_s=60, on_cancel=cancelled.append)
        try:
            whole = triton.generate(TINY, "Once upon a time", {"max_tokens": 4, "temperature": 0})
            async for piece in whole:
                if piece.final:
                    break
            await whole.aclose()
            assert cancelled == []
            left = triton.generate(TINY, "Once upon a time", {"max_tokens": 400, "temperature": 0,
                                                              "ignore_eos": True})
            await left.__anext__()
            await left.aclose()
        finally:
            await triton.close()
        return cancelled

    assert asyncio.run(run()) == [TINY]


def test_metrics_count_requests_per_route_and_status(gateway, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.embeddings.create(model=EMBED, input="counted")
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="absent", input="x")
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(gateway.url + "/metrics").text)}
    counts = {(s.labels["route"], s.labels["status"]): s.value for s in families["coalesce_gateway_requests"].samples}
    assert counts[("/v1/embeddings", "200")] >= 1 and counts[("/v1/embeddings", "404")] >= 1
    assert any(s.labels.get("route") == "/v1/embeddings"
               for s in families["coalesce_gateway_request_duration_seconds"].samples)


def test_langchain_embeddings_and_chat(gateway, server):
    langchain_openai = pytest.importorskip("langchain_openai")
    embeddings = langchain_openai.OpenAIEmbeddings(model=EMBED, base_url=gateway.url + "/v1", api_key="unused",
                                                   check_embedding_ctx_length=False)
    vectors = np.array(embeddings.embed_documents(TEXTS[:2]), dtype=np.float32)
    np.testing.assert_allclose(vectors, triton_vectors(server, TEXTS[:2]), rtol=0, atol=1e-6)
    chat = langchain_openai.ChatOpenAI(model=CHAT, base_url=gateway.url + "/v1", api_key="unused", temperature=0,
                                       max_tokens=12)
    assert "Paris" in chat.invoke("What is the capital of France?").content


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


def test_response_format_json_schema_gives_json_that_validates(client):
    jsonschema = pytest.importorskip("jsonschema")
    reply = client.chat.completions.create(
        model=CHAT, messages=ASK_PERSON, max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    content = reply.choices[0].message.content
    jsonschema.validate(json.loads(content), PERSON)
    assert reply.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=CHAT, messages=ASK_PERSON, max_tokens=64, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}) if c.choices]
    assert "".join(pieces) == content


def test_response_format_json_object_gives_a_json_object(client):
    reply = client.chat.completions.create(model=CHAT, messages=ASK_PERSON, max_tokens=48, temperature=0,
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_vllm_guided_fields_pass_through_extra_body(client):
    choice = client.chat.completions.create(
        model=CHAT, messages=[{"role": "user", "content": "Is Paris in France? Answer yes or no."}], max_tokens=8,
        temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].message.content in {"yes", "no"}
    digits = client.completions.create(model=CHAT, prompt="The year the Eiffel Tower opened:", max_tokens=8,
                                       temperature=0, extra_body={"guided_regex": "[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{4}", digits.choices[0].text)


def test_a_bad_schema_is_a_400_naming_the_problem(gateway, client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=CHAT, messages=ASK_PERSON, max_tokens=16,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}})
    body = caught.value.body
    assert body["param"] == "response_format" and "nonsense" in body["message"], body
    streamed = httpx.post(gateway.url + "/v1/chat/completions", timeout=60, json={
        "model": CHAT, "messages": ASK_PERSON, "max_tokens": 16, "stream": True,
        "guided_json": {"type": "nonsense"}})
    assert streamed.status_code == 400, streamed.text
    assert streamed.json()["error"]["param"] == "guided_json" and "nonsense" in streamed.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=CHAT, messages=ASK_PERSON, max_tokens=16,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert caught.value.body["param"] == "response_format.json_schema.schema"


def test_the_priority_header_reaches_generation(gateway):
    body = {"model": CHAT, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    plain = httpx.post(gateway.url + "/v1/completions", json=body, timeout=60)
    ranked = httpx.post(gateway.url + "/v1/completions", json=body, timeout=60,
                        headers={"x-coalesce-priority": "2", "x-coalesce-tenant": "search"})
    assert plain.status_code == ranked.status_code == 200, ranked.text
    assert ranked.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    bad = httpx.post(gateway.url + "/v1/completions", json=body, timeout=60, headers={"x-coalesce-priority": "abc"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-coalesce-priority"
