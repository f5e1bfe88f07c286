"""The README's examples run as written against a real server: every curl body, and the tritonclient snippet."""

from __future__ import annotations

import json
import math
import re
import urllib.request

import pytest

from tests.conftest import ROOT

README = (ROOT / "README.md").read_text()
#: Each curl example: the model it posts to, its JSON body, and the answer the README shows under it.
CURLS = re.findall(r"/v2/models/(\w+)/infer [^\n]*\\\n\s+-d '([^']*)'\n# ([^\n]*)", README)


def test_the_readme_has_a_curl_example_per_task():
    assert {model for model, _, _ in CURLS} == {"minilm", "minilm_rerank", "minilm_tokens"}


@pytest.mark.parametrize(("model", "body", "shown"), CURLS, ids=[model for model, _, _ in CURLS])
def test_every_curl_example_answers_what_the_readme_shows(server, model, body, shown):
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/infer", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())
    (output,) = answer["outputs"]
    name, datatype, shape = re.search(r'"name":"(\w+)","datatype":"(\w+)","shape":(\[[\d,]+\])', shown).groups()
    assert (output["name"], output["datatype"], output["shape"]) == (name, datatype, json.loads(shape))
    assert len(output["data"]) == math.prod(output["shape"])


def test_the_tritonclient_snippet_runs_as_written(server):
    (snippet,) = re.findall(r"```python\n(import numpy as np\nimport tritonclient\.grpc.*?)```", README, re.S)
    scope: dict[str, object] = {}
    exec(snippet.replace("localhost:8001", server.grpc_url), scope)  # the README's own code, as a user runs it
    assert scope["vectors"].shape == (2, 384)
    assert scope["scores"].shape == (2, 1)
    assert scope["logits"].shape == (3, 10)


#: Each gateway curl example: its route, JSON body, and the answer the README shows under it.
GATEWAY_CURLS = re.findall(r"localhost:9000(/v1/[\w/]+) [^\n]*\\\n\s+-d '([^']*)'\n# ([^\n]*)", README)


def test_the_readme_shows_the_gateways_embeddings_rerank_and_chat():
    assert [route for route, _, _ in GATEWAY_CURLS] == ["/v1/embeddings", "/v1/rerank", "/v1/chat/completions"]


@pytest.mark.parametrize(("route", "body", "shown"), GATEWAY_CURLS, ids=[r for r, _, _ in GATEWAY_CURLS])
def test_every_gateway_curl_example_answers_what_the_readme_shows(gateway, route, body, shown):
    request = urllib.request.Request(gateway.url + route, data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        text = response.read().decode()
    if json.loads(body).get("stream"):
        events = [line for line in text.splitlines() if line]
        assert events[-1] == "data: [DONE]" and '"object":"chat.completion.chunk"' in events[0]
        return
    answer = json.loads(text)
    for key in re.findall(r'"(\w+)":', shown)[:2]:
        assert key in answer, f"the README shows '{key}' in the answer of {route}"
    if route == "/v1/rerank":
        assert answer["results"][0]["document"]["text"] == "Batching groups requests."


def test_the_openai_snippet_runs_as_written(gateway):
    (snippet,) = re.findall(r"```python\n(from openai import OpenAI\n.*?)```", README, re.S)
    scope: dict[str, object] = {}
    exec(snippet.replace("http://localhost:9000", gateway.url).replace("print(", "str("), scope)
    assert len(scope["vectors"].data) == 2 and len(scope["vectors"].data[0].embedding) == 384
    assert "Paris" in scope["answer"].choices[0].message.content
