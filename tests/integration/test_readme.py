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
