"""OpenAI batch files (``coalesce-client batch --format openai``) against a real server and gateway.

One file mixes embeddings (a string, a list, base64), rerank, a short greedy chat and bad lines.
Its answers are checked against the same server's own: embeddings against ``EmbeddingClient``'s
vectors, rerank against the gateway's ``/v1/rerank`` for the same body, chat for a choice with
text. A rerun after the output is deleted answers from the kept working folder: Triton's own
statistics show no row sent again, and the report no chat line. The README's example runs as written.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys

import httpx
import numpy as np
import pytest

from coalesce_client import EmbeddingClient
from coalesce_client.load import model_counts
from tests.conftest import ROOT

EMBED = "minilm"
RERANK = "minilm_rerank"
CHAT = "smollm2"
TEXTS = ["The cat sat on the mat.", "Triton serves models over HTTP and gRPC.", "Coalesce batches requests.",
         "Paris is the capital of France."]
RERANK_BODY = {"model": RERANK, "query": "What is the capital of France?", "top_n": 3,
               "documents": ["Paris is the capital and largest city of France.", "Bananas are rich in potassium.",
                             {"text": "France's capital city is Paris."}, "The stock market fell today."]}


def line(custom_id, url, body, method="POST"):
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


LINES = [
    line("emb-one", "/v1/embeddings", {"model": EMBED, "input": TEXTS[0]}),
    line("emb-list", "/v1/embeddings", {"model": EMBED, "input": TEXTS[1:]}),
    line("emb-b64", "/v1/embeddings", {"model": EMBED, "input": TEXTS[:2], "encoding_format": "base64"}),
    line("rerank", "/v1/rerank", RERANK_BODY),
    line("chat", "/v1/chat/completions", {"model": CHAT, "max_tokens": 8, "temperature": 0,
                                          "messages": [{"role": "user", "content": "What is the capital of France?"}]}),
    '{"custom_id": "torn", "method": "POST", ',
    line("dims", "/v1/embeddings", {"model": EMBED, "input": "x", "dimensions": 64}),
    line("tokens", "/v1/embeddings", {"model": EMBED, "input": [101, 2023, 102]}),
    line("unknown", "/v1/embeddings", {"model": "no_such_model", "input": "x"}),
    line("get", "/v1/embeddings", {"model": EMBED, "input": "x"}, method="GET"),
    line("stream", "/v1/chat/completions", {"model": CHAT, "stream": True,
                                            "messages": [{"role": "user", "content": "hi"}]}),
    line("chat-bad", "/v1/chat/completions", {"model": CHAT, "messages": "not a list"}),
]


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "coalesce_client.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def job(server, gateway, tmp_path_factory):
    """The mixed file run once through the CLI (parts kept); its command, output lines, report and folder."""
    folder = tmp_path_factory.mktemp("openai_batch")
    source, output = folder / "in.jsonl", folder / "out.jsonl"
    source.write_text("\n".join(LINES) + "\n")
    command = ["--url", server.grpc_url, "batch", "--format", "openai", str(source), str(output),
               "--openai-url", gateway.url, "--keep-parts", "--no-progress"]
    done = run_cli(*command)
    assert done.returncode == 0, done.stderr
    answers = {record["custom_id"]: record for record in map(json.loads, output.read_text().splitlines())}
    return command, answers, json.loads(done.stdout), folder


def test_lines_come_back_in_order_with_one_answer_each(job):
    _, answers, report, folder = job
    lines = (folder / "out.jsonl").read_text().splitlines()
    assert [json.loads(text)["custom_id"] for text in lines] == [
        "emb-one", "emb-list", "emb-b64", "rerank", "chat", None, "dims", "tokens", "unknown", "get", "stream",
        "chat-bad"]
    assert (report["lines"], report["succeeded"], report["failed"]) == (12, 5, 7), {
        custom_id: record["error"] for custom_id, record in answers.items()}
    for record in map(json.loads, lines):
        assert record["id"].startswith("batch_req_") and record["response"]["request_id"]
        assert (record["error"] is None) == (record["response"]["status_code"] == 200)


def test_embeddings_equal_the_clients_vectors(server, job):
    _, answers, _, _ = job
    with EmbeddingClient(server.grpc_url, model=EMBED) as client:
        expected = client.embed(TEXTS)
    one = answers["emb-one"]["response"]["body"]
    assert one["object"] == "list" and one["model"] == EMBED and one["usage"] is None  # no --tokenizer: no count
    got = np.array([d["embedding"] for d in one["data"]] + [d["embedding"] for d in answers["emb-list"]["response"]
                                                           ["body"]["data"]], dtype=np.float32)
    np.testing.assert_allclose(got, expected, atol=2e-3)  # minilm as shipped (INT8): passes of other shapes differ
    b64 = answers["emb-b64"]["response"]["body"]["data"]
    assert [d["index"] for d in b64] == [0, 1]
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in b64])
    np.testing.assert_allclose(decoded, expected[:2], atol=2e-3)


def test_rerank_equals_the_gateways_own_answer(gateway, job):
    _, answers, _, _ = job
    ours = answers["rerank"]["response"]["body"]
    reply = httpx.post(gateway.url + "/v1/rerank", json=RERANK_BODY, timeout=60)
    assert reply.status_code == 200, reply.text
    theirs = reply.json()
    assert [r["index"] for r in ours["results"]] == [r["index"] for r in theirs["results"]]
    assert [r["document"] for r in ours["results"]] == [r["document"] for r in theirs["results"]]
    np.testing.assert_allclose([r["relevance_score"] for r in ours["results"]],
                               [r["relevance_score"] for r in theirs["results"]], atol=2e-2)
    assert ours["model"] == RERANK and ours["id"] == answers["rerank"]["response"]["request_id"]


def test_chat_has_a_choice_with_text_and_bad_lines_name_their_field(job):
    _, answers, _, _ = job
    body = answers["chat"]["response"]["body"]
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"].strip()
    assert body["usage"]["completion_tokens"] <= 8
    expected = {"torn": (None, "invalid JSON"), "dims": ("dimensions", "'dimensions'"),
                "tokens": ("input", "token ids"), "unknown": ("model", "no_such_model"), "get": ("method", "'method'"),
                "stream": ("stream", "'stream'"), "chat-bad": ("messages", "'messages'")}
    for custom_id, (param, says) in expected.items():
        record = answers[custom_id] if custom_id != "torn" else answers[None]
        error = record["error"]
        assert error["param"] == param and says in error["message"], (custom_id, error)
        assert record["response"]["body"] is None and record["response"]["status_code"] >= 400
    assert answers["unknown"]["response"]["status_code"] == 404
    assert answers["chat-bad"]["response"]["status_code"] == 400  # the gateway's own refusal


def test_a_rerun_after_the_output_is_deleted_sends_nothing_again(server, job):
    command, answers, _, folder = job
    (folder / "out.jsonl").unlink()
    before = {model: model_counts(server.grpc_url, model)[0] for model in (EMBED, RERANK)}
    done = run_cli(*[c for c in command if c != "--keep-parts"])
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["chat_sent"] == 0 and report["chat_skipped"] == 2
    assert all(job_report["report"] is None for job_report in report["row_jobs"])
    assert {model: model_counts(server.grpc_url, model)[0] for model in (EMBED, RERANK)} == before
    again = {r["custom_id"]: r for r in map(json.loads, (folder / "out.jsonl").read_text().splitlines())}
    assert again["emb-list"]["response"]["body"] == answers["emb-list"]["response"]["body"]
    assert again["chat"]["response"]["body"] == answers["chat"]["response"]["body"]
    assert not (folder / "out.jsonl.parts").exists()  # removed at the end of a run without --keep-parts


def test_the_readme_example_runs_as_written(server, gateway, tmp_path):
    readme = (ROOT / "client" / "README.md").read_text()
    (requests,) = re.findall(r"cat > requests\.jsonl <<'EOF'\n(.*?)\nEOF\n", readme, re.S)
    (command,) = re.findall(r"\.venv/bin/coalesce-client (--url localhost:8001 batch --format openai .*?)\n```",
                            readme, re.S)
    (tmp_path / "requests.jsonl").write_text(requests + "\n")
    args = command.replace("\\\n", " ").replace("localhost:8001", server.grpc_url).replace(
        "http://localhost:9000", gateway.url).replace("model_repository/", str(ROOT / "model_repository") + "/")
    args = [a.replace("requests.jsonl", str(tmp_path / "requests.jsonl")).replace(
        "answers.jsonl", str(tmp_path / "answers.jsonl")) for a in args.split()]
    done = run_cli(*args, "--no-progress")
    assert done.returncode == 0, done.stderr
    answers = [json.loads(text) for text in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert [a["custom_id"] for a in answers] == ["e1", "r1", "c1"] and all(a["error"] is None for a in answers)
    assert answers[0]["response"]["body"]["usage"]["prompt_tokens"] > 0
    assert answers[1]["response"]["body"]["results"][0]["index"] == 0
