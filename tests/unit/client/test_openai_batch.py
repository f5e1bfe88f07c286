"""OpenAI batch files without a server: reading and checking each line, putting answers together from rows,
the output's shape and order, chat answers kept for a rerun, and resuming.

The row jobs run against ``ScriptedClient``, a stand-in for ``EmbeddingClient`` (its ``model_config``
and ``infer``, nothing of Triton) computing each row's output from its text; chat lines go to a
``ScriptedSender`` (a stand-in for the gateway's answers) or, for ``ChatSender`` itself, to a small
HTTP server on this machine. The real server and gateway are in tests/integration/test_batch_openai.py.
"""

from __future__ import annotations

import base64
import http.server
import json
import threading

import numpy as np
import pytest

from coalesce_client import BatchJobError, ModelNotFoundError
from coalesce_client.batch import BatchOptions, ChatSender, GatewayUnavailableError, read_batch_file, run_openai_batch
from coalesce_client.batch.openai import (
    Answer,
    BatchLine,
    ChatAnswers,
    LineError,
    RowGroup,
    assemble,
    output_record,
    parse_line,
    row_groups,
)
from coalesce_client.cli import main

EMBED_CONFIG = {"name": "emb", "max_batch_size": 4,
                "input": [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": [1]}],
                "output": [{"name": "EMBEDDING", "data_type": "TYPE_FP32", "dims": [3]}],
                "parameters": {}}  # no task: the backend's default, embedding
RERANK_CONFIG = {"name": "rr", "max_batch_size": 4,
                 "input": [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": [1]},
                           {"name": "TEXT_PAIR", "data_type": "TYPE_STRING", "dims": [1]}],
                 "output": [{"name": "SCORES", "data_type": "TYPE_FP32", "dims": [1]}],
                 "parameters": {"task": {"string_value": "similarity"}}}
CLASSIFY_CONFIG = {**EMBED_CONFIG, "name": "cls", "parameters": {"task": {"string_value": "classify"}}}


def vector(text: bytes) -> np.ndarray:
    """The stand-in embedding model's output: a function of the text alone."""
    return np.array([len(text), sum(text) % 97, 1.0], dtype=np.float32)


def score(query: bytes, document: bytes) -> float:
    """The stand-in scorer: shared letters, so that an order follows from the texts."""
    return len(set(query.lower()) & set(document.lower())) / 10.0


class ScriptedClient:
    """Answers like ``EmbeddingClient`` for one model, counting the rows it is sent; ``refuse``: texts it refuses."""

    def __init__(self, model, config, *, refuse=(), missing=False):
        self.url, self.model, self.config, self.refuse, self.missing = "s1", model, config, set(refuse), missing
        self.sent: list[bytes] = []
        self.lock = threading.Lock()

    def model_config(self):
        if self.missing:
            raise ModelNotFoundError(f"model '{self.model}' at s1: unknown model")
        return dict(self.config)

    def infer(self, inputs, outputs):
        from coalesce_client import InvalidInputError

        texts = [row[0] for row in inputs["TEXT"]]
        with self.lock:
            if self.refuse.intersection(texts) or (
                    "TEXT_PAIR" in inputs and self.refuse.intersection(row[0] for row in inputs["TEXT_PAIR"])):
                raise InvalidInputError("input 'TEXT' row 0 is refused")
            self.sent.extend(texts)
        if "TEXT_PAIR" in inputs:
            pairs = [row[0] for row in inputs["TEXT_PAIR"]]
            return {outputs[0]: np.array([[score(q, d)] for q, d in zip(texts, pairs, strict=True)],
                                         dtype=np.float32)}
        return {outputs[0]: np.stack([vector(t) for t in texts])}


class Servers:
    """One scripted client per model, as ``clients_for`` hands them out."""

    def __init__(self, **kwargs):
        self.clients = {"emb": ScriptedClient("emb", EMBED_CONFIG, **kwargs),
                        "rr": ScriptedClient("rr", RERANK_CONFIG, **kwargs),
                        "cls": ScriptedClient("cls", CLASSIFY_CONFIG),
                        "nope": ScriptedClient("nope", EMBED_CONFIG, missing=True)}

    def __call__(self, model):
        return [self.clients[model]]

    def sent(self):
        return sum(len(c.sent) for c in self.clients.values())


class ScriptedSender:
    """Answers chat bodies as the gateway would (text from the last message); ``fail_after``: then it is gone."""

    def __init__(self, fail_after=None):
        self.bodies: list[dict] = []
        self.fail_after = fail_after
        self.lock = threading.Lock()

    def send(self, body, line):
        with self.lock:
            if self.fail_after is not None and len(self.bodies) >= self.fail_after:
                raise GatewayUnavailableError(f"line {line}: cannot reach the gateway")
            self.bodies.append(body)
        if body.get("max_tokens") == 0:
            return Answer(400, "rid", error=LineError(400, "invalid_request_error", "'max_tokens' is 0", "max_tokens"))
        text = body["messages"][-1]["content"].upper()
        return Answer(200, f"rid-{line}", {"object": "chat.completion", "model": body["model"],
                                           "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                                        "finish_reason": "stop"}]})


def request(custom_id, url, body, method="POST"):
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def chat(custom_id, content, **extra):
    return request(custom_id, "/v1/chat/completions",
                   {"model": "chatty", "messages": [{"role": "user", "content": content}], **extra})


def options(tmp_path, **kwargs):
    defaults = {"input_path": tmp_path / "in.jsonl", "output_path": tmp_path / "out.jsonl", "progress": False,
                "rows_per_request": 2, "part_rows": 2}
    return BatchOptions(**{**defaults, **kwargs})


def read_output(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- reading and checking lines ---------------------------------------------------------------------------------


def error_of(text, seen=None):
    line = parse_line(7, text.encode() if isinstance(text, str) else text, {} if seen is None else seen)
    assert line.error is not None, f"{text!r} should fail"
    return line.error


@pytest.mark.parametrize(("text", "param", "says"), [
    ('{"custom_id": "a", ', None, "invalid JSON"),
    ("[1, 2]", None, "expected a JSON object, found a list"),
    (b'{"custom_id": "\xff"}', None, "not valid UTF-8"),
    ('{"method": "POST"}', "custom_id", "'custom_id' must be a non-empty string, missing"),
    ('{"custom_id": ""}', "custom_id", "found an empty string"),
    ('{"custom_id": 5}', "custom_id", "found an integer"),
    (request("a", "/v1/embeddings", {"model": "m", "input": "x"}, method="GET"), "method", "'method' is 'GET'"),
    (request("a", "/v1/completions", {"model": "m"}), "url", "'url' is '/v1/completions': it must be one of"),
    (json.dumps({"custom_id": "a", "method": "POST", "url": ["x"], "body": {}}), "url", "'url' is ['x']"),
    (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": "x"}), "body",
     "'body' must be an object, found a string"),
    (request("a", "/v1/embeddings", {"input": "x"}), "model", "'body.model' must be a non-empty string"),
    (request("a", "/v1/embeddings", {"model": "m", "input": [1, 2, 3]}), "input", "'input' holds token ids"),
    (request("a", "/v1/embeddings", {"model": "m", "input": [[1, 2], [3]]}), "input", "'input' holds token ids"),
    (request("a", "/v1/embeddings", {"model": "m", "input": []}), "input", "'input' is an empty list"),
    (request("a", "/v1/embeddings", {"model": "m"}), "input", "'input' must be a string or a non-empty list"),
    (request("a", "/v1/embeddings", {"model": "m", "input": ["ok", ""]}), "input", "'input[1]' is empty"),
    (request("a", "/v1/embeddings", {"model": "m", "input": ["ok", 3]}), "input",
     "'input[1]' must be a string, found an integer"),
    (request("a", "/v1/embeddings", {"model": "m", "input": "\ud800"}), "input", "not valid UTF-8"),
    (request("a", "/v1/embeddings", {"model": "m", "input": "x", "encoding_format": "hex"}), "encoding_format",
     "'encoding_format' is 'hex'"),
    (request("a", "/v1/embeddings", {"model": "m", "input": "x", "dimensions": 128}), "dimensions",
     "'dimensions' is not supported"),
    (request("a", "/v1/rerank", {"model": "m", "documents": ["d"]}), "query", "'query' must be a string"),
    (request("a", "/v1/rerank", {"model": "m", "query": "q", "documents": []}), "documents",
     "'documents' must be a non-empty list"),
    (request("a", "/v1/rerank", {"model": "m", "query": "q", "documents": ["d", {"txt": "e"}]}), "documents",
     "'documents[1].text' must be a string"),
    (request("a", "/v1/rerank", {"model": "m", "query": "q", "documents": ["d"], "top_n": 0}), "top_n",
     "'top_n' must be an integer of at least 1"),
    (request("a", "/v1/rerank", {"model": "m", "query": "q", "documents": ["d"], "return_documents": "yes"}),
     "return_documents", "'return_documents' must be true or false"),
    (chat("a", "hi", stream=True), "stream", "'stream' is true"),
])
def test_each_bad_line_fails_alone_naming_its_field(text, param, says):
    error = error_of(text)
    assert error.status == 400 and error.param == param and says in error.message, error


def test_a_duplicate_custom_id_fails_the_later_line_and_names_the_first():
    seen: dict[str, int] = {}
    first = parse_line(1, chat("a", "hi").encode(), seen)
    assert first.error is None and first.kind == "chat" and first.model == "chatty"
    error = error_of(chat("a", "again"), seen)
    assert (error.code, error.param, error.message) == ("duplicate_custom_id", "custom_id",
                                                        "duplicate 'custom_id' 'a': first on line 1")


def test_good_lines_carry_their_texts(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([
        request("e1", "/v1/embeddings", {"model": "emb", "input": "one"}),
        "",
        request("e2", "/v1/embeddings", {"model": "emb", "input": ["two", "three"], "encoding_format": "base64"}),
        request("r1", "/v1/rerank", {"model": "rr", "query": "q", "documents": ["a", {"text": "b"}], "top_n": 1}),
        "   ",
        chat("c1", "hello"),
    ]) + "\n")
    lines = read_batch_file(path)
    assert [(line.line, line.custom_id, line.kind, line.texts) for line in lines] == [
        (1, "e1", "embeddings", ("one",)), (3, "e2", "embeddings", ("two", "three")),
        (4, "r1", "rerank", ("a", "b")), (6, "c1", "chat", ())]
    assert lines[2].query == "q" and all(line.error is None for line in lines)
    with pytest.raises(BatchJobError, match="is not a file"):
        read_batch_file(tmp_path / "absent.jsonl")


def test_rows_are_numbered_per_model_and_kind_in_line_order():
    lines = [BatchLine(1, "a", "/v1/embeddings", {"model": "emb"}, texts=("x", "y")),
             BatchLine(2, "b", "/v1/rerank", {"model": "rr"}, texts=("d1", "d2", "d3"), query="q"),
             BatchLine(3, "c", "/v1/embeddings", {"model": "emb"}, texts=("z",)),
             BatchLine(4, "d", "/v1/embeddings", {"model": "emb"}, error=LineError(400, "x", "bad")),
             BatchLine(5, "e", "/v1/chat/completions", {"model": "emb"})]
    embed, rerank = row_groups(lines)
    assert (embed.model, embed.kind, [line.line for line in embed.lines]) == ("emb", "embeddings", [1, 3])
    assert embed.starts.tolist() == [0, 2] and embed.rows == 3 and embed.stem == "emb-embeddings"
    assert embed.table().to_pydict() == {"id": [0, 1, 2], "text": ["x", "y", "z"]}
    assert rerank.table().to_pydict() == {"id": [0, 1, 2], "text": ["q", "q", "q"], "pair": ["d1", "d2", "d3"]}
    odd = RowGroup("org/model:v1", "embeddings", []).stem
    assert odd.startswith("org_model_v1-") and odd.endswith("-embeddings") and "/" not in odd
    assert RowGroup("org/model:v1", "embeddings", []).stem != RowGroup("org_model_v1", "embeddings", []).stem


# --- answers from rows ------------------------------------------------------------------------------------------


def test_embeddings_answers_in_float_and_base64_and_a_refused_row_fails_its_line():
    lines = [BatchLine(1, "a", "/v1/embeddings", {"model": "emb", "input": ["x", "y"]}, texts=("x", "y")),
             BatchLine(2, "b", "/v1/embeddings", {"model": "emb", "input": "z", "encoding_format": "base64"},
                       texts=("z",)),
             BatchLine(3, "c", "/v1/embeddings", {"model": "emb", "input": ["u", "v"]}, texts=("u", "v"))]
    group = RowGroup("emb", "embeddings", lines)
    values = np.arange(15, dtype=np.float32).reshape(5, 3) / 7
    answers = assemble(group, values, np.ones(5, dtype=bool), {4: "refused by the server: too long"},
                       np.array([5, 2, 9]))
    first, second, third = answers[1], answers[2], answers[3]
    assert first.status == 200 and first.body is not None and first.error is None
    assert first.body["object"] == "list" and first.body["model"] == "emb"
    assert first.body["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    assert [d["index"] for d in first.body["data"]] == [0, 1]
    np.testing.assert_array_equal(np.array([d["embedding"] for d in first.body["data"]], dtype=np.float32),
                                  values[:2])
    decoded = np.frombuffer(base64.b64decode(second.body["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, values[2])
    assert third.status == 400 and third.body is None
    assert third.error == LineError(400, "refused_by_server", "'input[1]': refused by the server: too long", "input")
    none = assemble(group, values, np.array([True, True, True, False, True]), {}, None)
    assert none[1].body["usage"] is None
    assert none[3].error.code == "missing_answer" and none[3].status == 500


def test_rerank_answers_are_sorted_best_first_cut_to_top_n_with_or_without_documents():
    body = {"model": "rr", "query": "q", "documents": ["a", "b", "c"]}
    lines = [BatchLine(1, "a", "/v1/rerank", body, texts=("a", "b", "c"), query="q"),
             BatchLine(2, "b", "/v1/rerank", {**body, "top_n": 2, "return_documents": False}, texts=("a", "b", "c"),
                       query="q")]
    group = RowGroup("rr", "rerank", lines)
    values = np.array([[0.1], [0.9], [0.1], [0.3], [0.2], [0.8]], dtype=np.float32)
    answers = assemble(group, values, np.ones(6, dtype=bool), {}, None)
    whole = answers[1].body
    assert [(r["index"], r["document"]["text"]) for r in whole["results"]] == [(1, "b"), (0, "a"), (2, "c")]
    assert whole["results"][0]["relevance_score"] == pytest.approx(0.9)
    assert whole["id"] == answers[1].request_id and whole["meta"] == {"billed_units": {"search_units": 1}}
    cut = answers[2].body["results"]
    assert [r["index"] for r in cut] == [2, 0] and all("document" not in r for r in cut)


def test_output_lines_follow_vllm_and_openai():
    line = BatchLine(4, "x", "/v1/embeddings", {"model": "emb"})
    good = output_record(line, Answer(200, "rid", {"object": "list"}))
    assert good["id"].startswith("batch_req_") and good["custom_id"] == "x" and good["error"] is None
    assert good["response"] == {"status_code": 200, "request_id": "rid", "body": {"object": "list"}}
    bad = output_record(line, Answer(404, "rid", error=LineError(404, "model_not_found", "gone", "model")))
    assert bad["response"] == {"status_code": 404, "request_id": "rid", "body": None}
    assert bad["error"] == {"code": "model_not_found", "message": "gone", "param": "model", "line": 4}


# --- whole jobs -------------------------------------------------------------------------------------------------


def write_job(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


MIXED = [
    request("e1", "/v1/embeddings", {"model": "emb", "input": "hello there"}),
    request("r1", "/v1/rerank", {"model": "rr", "query": "apple", "documents": ["banana", "apple pie", "zzz"]}),
    "not json",
    chat("c1", "hi"),
    request("e2", "/v1/embeddings", {"model": "emb", "input": ["a", "bb", "ccc"], "encoding_format": "base64"}),
    request("e3", "/v1/embeddings", {"model": "nope", "input": "x"}),
    request("e4", "/v1/embeddings", {"model": "cls", "input": "x"}),
    chat("c2", "bad", max_tokens=0),
    request("r2", "/v1/rerank", {"model": "emb", "query": "q", "documents": ["d"]}),
    chat("c3", "there"),
]


def test_a_mixed_file_answers_every_line_in_input_order(tmp_path):
    write_job(tmp_path / "in.jsonl", MIXED)
    servers, sender = Servers(), ScriptedSender()
    messages: list[str] = []
    report = run_openai_batch(options(tmp_path), servers, sender=sender, log=messages.append)
    out = read_output(tmp_path / "out.jsonl")
    assert [o["custom_id"] for o in out] == ["e1", "r1", None, "c1", "e2", "e3", "e4", "c2", "r2", "c3"]
    by_id = {o["custom_id"]: o for o in out}
    e1 = by_id["e1"]["response"]["body"]
    np.testing.assert_array_equal(e1["data"][0]["embedding"], vector(b"hello there"))
    assert e1["usage"] is None  # no tokenizer: no count
    e2 = by_id["e2"]["response"]["body"]["data"]
    for item, text in zip(e2, [b"a", b"bb", b"ccc"], strict=True):
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4"), vector(text))
    r1 = by_id["r1"]["response"]["body"]["results"]
    assert [r["document"]["text"] for r in r1] == ["apple pie", "banana", "zzz"]
    assert by_id["c1"]["response"]["body"]["choices"][0]["message"]["content"] == "HI"
    assert out[2]["error"]["code"] == "invalid_json" and out[2]["error"]["line"] == 3
    assert by_id["e3"]["error"]["code"] == "model_not_found" and by_id["e3"]["response"]["status_code"] == 404
    assert "does not serve /v1/embeddings" in by_id["e4"]["error"]["message"]
    assert "pair scorer" in by_id["r2"]["error"]["message"] and by_id["r2"]["error"]["param"] == "model"
    assert by_id["c2"]["error"] == {"code": "invalid_request_error", "message": "'max_tokens' is 0",
                                    "param": "max_tokens", "line": 8}
    assert (report.lines, report.succeeded, report.failed, report.chat_sent) == (10, 5, 5, 3)
    assert {(j["model"], j["kind"]) for j in report.row_jobs} == {("emb", "embeddings"), ("rr", "rerank"),
                                                                ("nope", "embeddings"), ("cls", "embeddings"),
                                                                ("emb", "rerank")}
    assert sorted(servers.clients["emb"].sent) == sorted([b"hello there", b"a", b"bb", b"ccc"])
    assert not (tmp_path / "out.jsonl.parts").exists()  # removed at the end
    assert json.dumps(report.as_dict())


def test_chat_lines_without_a_gateway_fail_naming_the_flag(tmp_path):
    write_job(tmp_path / "in.jsonl", [chat("c1", "hi"), request("e1", "/v1/embeddings",
                                                                {"model": "emb", "input": "x"})])
    run_openai_batch(options(tmp_path), Servers())
    c1, e1 = read_output(tmp_path / "out.jsonl")
    assert "--openai-url" in c1["error"]["message"] and c1["response"]["body"] is None
    assert e1["error"] is None


def test_usage_is_counted_with_the_tokenizer(tmp_path, version_dir):
    write_job(tmp_path / "in.jsonl", [
        request("e1", "/v1/embeddings", {"model": "emb", "input": ["hello world", "a b c"]}),
        request("r1", "/v1/rerank", {"model": "rr", "query": "hello", "documents": ["world"]})])
    run_openai_batch(options(tmp_path, tokenizer=version_dir / "tokenizer.json"), Servers())
    e1, r1 = read_output(tmp_path / "out.jsonl")
    # [CLS] hello world [SEP] + [CLS] a b c [SEP]; a bi-encoder scorer counts each text alone: 3 + 3.
    assert e1["response"]["body"]["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
    assert r1["response"]["body"]["usage"] == {"prompt_tokens": 6, "total_tokens": 6}


def test_a_row_the_server_refuses_fails_only_its_line(tmp_path):
    write_job(tmp_path / "in.jsonl", [
        request("e1", "/v1/embeddings", {"model": "emb", "input": ["fine", "poison"]}),
        request("e2", "/v1/embeddings", {"model": "emb", "input": ["also fine"]}),
        request("r1", "/v1/rerank", {"model": "rr", "query": "q", "documents": ["ok", "poison"]})])
    run_openai_batch(options(tmp_path), Servers(refuse={b"poison"}))
    e1, e2, r1 = read_output(tmp_path / "out.jsonl")
    assert e1["error"]["code"] == "refused_by_server" and e1["error"]["message"].startswith("'input[1]': refused")
    assert e2["error"] is None and r1["error"]["message"].startswith("'documents[1]'")


def test_a_stopped_job_resumes_without_sending_finished_rows_or_chat_lines(tmp_path):
    write_job(tmp_path / "in.jsonl", MIXED)
    servers = Servers()
    with pytest.raises(GatewayUnavailableError, match="run the job again to resume"):
        run_openai_batch(options(tmp_path), servers, sender=ScriptedSender(fail_after=1))
    assert not (tmp_path / "out.jsonl").exists()
    rows_sent = servers.sent()
    assert rows_sent == 4 + 3  # embeddings of emb, and rerank pairs of rr: all done before the chat lines
    sender = ScriptedSender()
    report = run_openai_batch(options(tmp_path, keep_parts=True), servers, sender=sender)
    assert servers.sent() == rows_sent  # no row sent again
    assert len(sender.bodies) == 2 and report.chat_skipped == 1 and report.chat_sent == 2
    assert all(j["report"] is None for j in report.row_jobs)  # every row job was done by the first run
    first = read_output(tmp_path / "out.jsonl")
    # Run again after deleting the output: the kept working folder answers everything, chat lines included
    # (no gateway is given this time, and none is needed).
    (tmp_path / "out.jsonl").unlink()
    run_openai_batch(options(tmp_path), servers)
    assert servers.sent() == rows_sent
    second = read_output(tmp_path / "out.jsonl")
    for a, b in zip(first, second, strict=True):
        assert a["custom_id"] == b["custom_id"] and a["error"] == b["error"]
        assert a["response"]["body"] == b["response"]["body"] or a["custom_id"] == "r1"  # rerank ids are per run
    assert not (tmp_path / "out.jsonl.parts").exists()


def test_a_row_job_killed_midway_resumes_from_its_parts(tmp_path):
    write_job(tmp_path / "in.jsonl", [
        request(f"e{i}", "/v1/embeddings", {"model": "emb", "input": [f"t{i}a", f"t{i}b"]}) for i in range(20)])

    class Killing(ScriptedClient):
        def infer(self, inputs, outputs):
            if len(self.sent) >= 10:
                raise KeyboardInterrupt
            return super().infer(inputs, outputs)

    killing = Killing("emb", EMBED_CONFIG)
    with pytest.raises(KeyboardInterrupt):
        run_openai_batch(options(tmp_path, part_interval_s=0.001, concurrency=1), lambda model: [killing])
    done = len(killing.sent)
    assert 0 < done < 40
    fresh = ScriptedClient("emb", EMBED_CONFIG)
    run_openai_batch(options(tmp_path), lambda model: [fresh])
    assert len(fresh.sent) + done == 40 and len(set(fresh.sent) | set(killing.sent)) == 40
    out = read_output(tmp_path / "out.jsonl")
    assert [o["custom_id"] for o in out] == [f"e{i}" for i in range(20)] and all(o["error"] is None for o in out)


def test_a_changed_input_an_existing_output_and_restart(tmp_path):
    path = write_job(tmp_path / "in.jsonl", [request("e1", "/v1/embeddings", {"model": "emb", "input": "x"})])
    with pytest.raises(GatewayUnavailableError):
        write_job(path, [request("e1", "/v1/embeddings", {"model": "emb", "input": "x"}), chat("c", "hi")])
        run_openai_batch(options(tmp_path), Servers(), sender=ScriptedSender(fail_after=0))
    write_job(path, [request("e1", "/v1/embeddings", {"model": "emb", "input": "changed"}), chat("c", "hi")])
    with pytest.raises(BatchJobError, match=r"holds the parts of another job .*pass --restart"):
        run_openai_batch(options(tmp_path), Servers(), sender=ScriptedSender())
    servers = Servers()
    run_openai_batch(options(tmp_path, restart=True), servers, sender=ScriptedSender())
    assert servers.clients["emb"].sent == [b"changed"]
    with pytest.raises(BatchJobError, match=r"out\.jsonl exists: pass --restart"):
        run_openai_batch(options(tmp_path), Servers(), sender=ScriptedSender())


def test_chat_answers_survive_a_torn_last_line(tmp_path):
    path = tmp_path / "chat.jsonl"
    kept = ChatAnswers(path)
    kept.add(BatchLine(3, "c", "/v1/chat/completions", {}), Answer(200, "r3", {"ok": 1}))
    kept.add(BatchLine(5, "d", "/v1/chat/completions", {}), Answer(400, "r5", error=LineError(400, "bad", "no", "x")))
    kept.close()
    with open(path, "a") as stream:
        stream.write('{"line": 9, "custom_id": "e", "stat')  # a kill mid-write
    again = ChatAnswers(path)
    assert again.done == {3: Answer(200, "r3", {"ok": 1}), 5: Answer(400, "r5", error=LineError(400, "bad", "no", "x"))}
    again.add(BatchLine(9, "e", "/v1/chat/completions", {}), Answer(200, "r9", {"ok": 9}))
    again.close()
    assert set(ChatAnswers(path).done) == {3, 5, 9}


# --- the chat sender against an HTTP server on this machine -----------------------------------------------------


@pytest.fixture()
def fake_gateway():
    """An HTTP server answering POST /v1/chat/completions from a script: a list of (status, body) per call."""
    script: list[tuple[int, bytes]] = []
    seen: list[tuple[str, dict, dict]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            seen.append((self.path, body, self.headers))  # names read case-insensitively
            status, answer = script.pop(0) if script else (200, b'{"choices": []}')
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("x-request-id", self.headers.get("x-request-id", ""))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", script, seen
    server.shutdown()
    server.server_close()


def test_chat_sender_posts_bodies_keeps_refusals_and_retries_not_now(fake_gateway):
    url, script, seen = fake_gateway
    sender = ChatSender(url + "/v1/", headers={"authorization": "Bearer k"}, timeout_s=5, attempts=3,
                        sleep=lambda s: None)
    script.append((200, b'{"id": "chatcmpl-1", "choices": [{"message": {"content": "hi"}}]}'))
    answer = sender.send({"model": "m", "messages": []}, 1)
    assert answer.status == 200 and answer.body["id"] == "chatcmpl-1" and answer.request_id.startswith("coalesce-")
    path, body, headers = seen[-1]
    assert path == "/v1/chat/completions" and body == {"model": "m", "messages": []}
    assert headers["authorization"] == "Bearer k" and headers["x-request-id"] == answer.request_id
    script.append((400, b'{"error": {"message": "\'messages\' must be a list", "type": "invalid_request_error", '
                        b'"param": "messages", "code": null}}'))
    refused = sender.send({"model": "m"}, 2)
    assert refused.status == 400 and refused.error == LineError(400, "invalid_request_error",
                                                                "'messages' must be a list", "messages")
    script.extend([(503, b'{"error": {"message": "busy"}}'), (200, b'{"choices": [1]}')])
    assert sender.send({"model": "m"}, 3).body == {"choices": [1]}  # retried once
    script.extend([(503, b"busy")] * 3)
    with pytest.raises(GatewayUnavailableError, match=r"line 4: .* answered 503: busy"):
        sender.send({"model": "m"}, 4)
    script.append((500, b"not json"))
    broken = sender.send({"model": "m"}, 5)
    assert broken.status == 500 and broken.error.code == "gateway_error" and "not json" in broken.error.message


def test_chat_sender_reports_an_unreachable_gateway():
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sender = ChatSender(f"http://127.0.0.1:{port}", timeout_s=2, attempts=2, sleep=lambda s: None)
    with pytest.raises(GatewayUnavailableError, match="cannot reach"):
        sender.send({"model": "m"}, 1)
    with pytest.raises(ValueError, match="must start with http"):
        ChatSender("127.0.0.1:9000")


def test_cli_runs_an_openai_file(tmp_path, capsys, fake_gateway):
    url, _, seen = fake_gateway
    write_job(tmp_path / "in.jsonl", [chat("c1", "hi"), "{broken"])
    code = main(["--url", "127.0.0.1:1", "batch", "--format", "openai", str(tmp_path / "in.jsonl"),
                 str(tmp_path / "out.jsonl"), "--openai-url", url, "--no-progress"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["lines"], report["succeeded"], report["failed"], report["chat_sent"]) == (2, 1, 1, 1)
    c1, broken = read_output(tmp_path / "out.jsonl")
    assert c1["response"]["status_code"] == 200 and broken["error"]["code"] == "invalid_json"
    assert seen[0][1]["messages"] == [{"role": "user", "content": "hi"}]
