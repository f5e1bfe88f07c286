"""Bulk jobs without a server: readers and their line-numbered rejects, the model's I/O from its config,
request planning, the concurrency search, spreading over servers, part files and resuming.

The job's loop is run here against ``ScriptedClient``, a stand-in for ``EmbeddingClient`` (its
``model_config`` and ``infer``, nothing of Triton) that computes each row's vector from its
text, so that splitting, retrying and resuming can be checked row by row; the real server is
in tests/integration/test_batch.py.
"""

from __future__ import annotations

import json
import random
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from coalesce_client import BatchJobError, InvalidInputError, ServerError, ServerUnavailableError
from coalesce_client.batch import (
    FORMATS,
    BatchOptions,
    ConcurrencySearch,
    EndpointPool,
    OutputFile,
    PartWriter,
    estimate_tokens,
    finished_ids,
    model_io,
    output_schema,
    plan_requests,
    read_csv,
    read_jsonl,
    read_parquet,
    row_lengths,
    run_batch,
)
from coalesce_client.cli import main

EMBED_CONFIG = {"name": "minilm", "max_batch_size": 64,
                "input": [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": ["1"]}],
                "output": [{"name": "EMBEDDING", "data_type": "TYPE_FP32", "dims": ["4"]}],
                "parameters": {"precision": {"string_value": "int8"}}}
PAIR_CONFIG = {"name": "minilm_rerank", "max_batch_size": 64,
               "input": [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": [1]},
                         {"name": "TEXT_PAIR", "data_type": "TYPE_STRING", "dims": [1]}],
               "output": [{"name": "SCORES", "data_type": "TYPE_FP32", "dims": [1]}],
               "parameters": {"max_request_bytes": {"string_value": "1000"},
                              "max_sequence_length": {"string_value": "256"},
                              "max_batch_tokens": {"string_value": "8192"}}}


# --- readers -------------------------------------------------------------------------------------------------


def test_jsonl_rejects_each_bad_line_with_its_number_and_keeps_the_rest(tmp_path):
    lines = [
        '{"id": "a", "text": "first"}',            # 1 ok
        '{"id": "b", "text": "unterminated',        # 2 invalid JSON
        "",                                         # 3 blank: skipped, not a reject
        '{"text": "no id"}',                        # 4 missing id
        '{"id": "c", "text": ""}',                  # 5 empty text
        '{"id": "d", "text": 7}',                   # 6 text of the wrong type
        '{"id": 1.5, "text": "float id"}',          # 7 id of the wrong type
        '{"id": "a", "text": "again"}',             # 8 duplicate id
        '["not", "an", "object"]',                  # 9 not an object
        '{"id": 2, "text": "int among strings"}',   # 10 id kind differs from the file's
        '{"id": "e", "text": "last"}',              # 11 ok
        '{"id": null, "text": "null id"}',          # 12 null id
        '{"id": "f"}',                              # 13 missing text
        '{"id": "  ", "text": "blank id"}',         # 14 empty id
    ]
    path = tmp_path / "in.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"id": "g", "text": "\xff"}\n')  # 15 not UTF-8
    rows = read_jsonl(path)
    assert rows.ids == ["a", "e"] and rows.texts == [b"first", b"last"] and rows.lines == [1, 11]
    reasons = {r.line: r.reason for r in rows.rejects}
    assert reasons == {
        2: "invalid JSON: Unterminated string starting at (column 21)",
        4: "missing 'id'",
        5: "'text' is empty",
        6: "'text' must be a string, got an integer",
        7: "'id' must be a string or an integer, got a number",
        8: "duplicate 'id' 'a': first on line 1",
        9: "expected a JSON object, got a list",
        10: "'id' 2 is an integer, but the ids before it are strings",
        12: "'id' is null",
        13: "missing 'text'",
        14: "'id' is empty",
        15: "not valid UTF-8 (byte 22)",
    }
    bad = next(r for r in rows.rejects if r.line == 2)
    assert bad.raw == lines[1] and bad.message() == "line 2: invalid JSON: Unterminated string starting at (column 21)"
    assert next(r for r in rows.rejects if r.line == 8).id == "a"


def test_jsonl_integer_ids_pairs_and_long_raw_lines(tmp_path):
    path = tmp_path / "in.jsonl"
    long_text = "x" * 10000
    path.write_text("\n".join([json.dumps({"qid": 3, "q": "query", "doc": "document"}),
                               json.dumps({"qid": 4, "q": "query"}),
                               json.dumps({"qid": 5, "q": "", "doc": long_text}),
                               json.dumps({"qid": 2**70, "q": "a", "doc": "b"})]) + "\n")
    rows = read_jsonl(path, "qid", "q", "doc")
    assert rows.ids == [3] and rows.pairs == [b"document"]
    assert [(r.line, r.reason) for r in rows.rejects] == [
        (2, "missing 'doc'"), (3, "'q' is empty"), (4, f"'qid' {2**70} does not fit in 64 bits")]
    assert len(rows.rejects[1].raw) < 4200 and rows.rejects[1].raw.endswith("characters)")


def test_csv_numbers_records_by_their_first_line(tmp_path):
    path = tmp_path / "in.csv"
    path.write_bytes(b'id,text,extra\n'            # 1 header
                     b'1,"one\nspanning two lines",x\n'  # 2-3 ok (a quoted newline)
                     b'2,two\n'                     # 4 too few fields
                     b'\n'                          # 5 blank
                     b',no id,x\n'                  # 6 missing id
                     b'3,,x\n'                      # 7 empty text
                     b'1,dup,x\n'                   # 8 duplicate
                     b'\xff4,bad id,x\n'            # 9 id not UTF-8
                     b'5,"caf\xc3\xa9",x\n')        # 10 ok
    rows = read_csv(path)
    assert rows.ids == ["1", "5"] and rows.texts == [b"one\nspanning two lines", "café".encode()]
    assert rows.lines == [2, 10]
    assert [(r.line, r.reason) for r in rows.rejects] == [
        (4, "expected 3 fields, found 2"), (6, "missing 'id'"), (7, "'text' is empty"),
        (8, "duplicate 'id' '1': first on line 2"), (9, "'id' is not valid UTF-8")]
    assert rows.rejects[0].raw == "2,two" and rows.rejects[4].raw == "\\udcff4,bad id,x"


def test_csv_without_the_columns_fails_the_whole_file(tmp_path):
    path = tmp_path / "in.csv"
    path.write_text("key,body\n1,x\n")
    with pytest.raises(BatchJobError, match=r"the CSV header has no column 'id', 'text' \(it has 'key', 'body'\)"):
        read_csv(path)
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(BatchJobError, match="is empty: a CSV input needs a header line"):
        read_csv(tmp_path / "empty.csv")


def test_parquet_rows_and_column_types(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": pa.array([1, 2, None, 4, 1], pa.int64()),
                             "text": pa.array(["a", None, "c", "", "e"])}), path)
    rows = read_parquet(path)
    assert rows.ids == [1] and rows.noun == "row"
    assert [(r.line, r.reason) for r in rows.rejects] == [
        (2, "'text' must be a string, got null"), (3, "'id' is null"), (4, "'text' is empty"),
        (5, "duplicate 'id' 1: first on line 1")]
    assert rows.rejects[0].message(rows.noun) == "row 2: 'text' must be a string, got null"
    assert json.loads(rows.rejects[0].raw) == {"id": 2, "text": None}
    pq.write_table(pa.table({"id": [1.5], "text": ["a"]}), path)
    with pytest.raises(BatchJobError, match="column 'id' is double: ids must be strings or integers"):
        read_parquet(path)
    pq.write_table(pa.table({"id": ["a"], "text": [3]}), path)
    with pytest.raises(BatchJobError, match="column 'text' is int64: texts must be strings"):
        read_parquet(path)
    with pytest.raises(BatchJobError, match=r"no column 'doc'"):
        read_parquet(path, pair_column="doc")


def test_the_format_comes_from_the_suffix_or_is_named(tmp_path):
    assert BatchOptions(tmp_path / "a.JSONL", tmp_path / "o.parquet").format == "jsonl"
    assert BatchOptions(tmp_path / "a.txt", tmp_path / "o.parquet", input_format="csv").format == "csv"
    with pytest.raises(BatchJobError, match="cannot tell the format of"):
        _ = BatchOptions(tmp_path / "a.txt", tmp_path / "o.parquet").format
    with pytest.raises(ValueError, match="the id, text and pair columns must be distinct names"):
        BatchOptions(tmp_path / "a.csv", tmp_path / "o.parquet", text_column="id")
    with pytest.raises(ValueError, match="part_interval_s must be > 0, got 0"):
        BatchOptions(tmp_path / "a.csv", tmp_path / "o.parquet", part_interval_s=0)
    assert set(FORMATS) == {"jsonl", "csv", "parquet"}  # the CLI writes them out


# --- the model -----------------------------------------------------------------------------------------------


def test_model_io_from_the_config():
    embed = model_io(EMBED_CONFIG)
    assert (embed.text_input, embed.pair_input, embed.output, embed.output_dims) == ("TEXT", None, "EMBEDDING", (4,))
    assert embed.max_rows == 64 and embed.max_request_bytes == 4 * 1024 * 1024 and not embed.scalar
    assert embed.max_sequence_length is None and embed.max_batch_tokens is None
    assert embed.column == "embedding" and embed.dtype == np.float32
    pair = model_io(PAIR_CONFIG, pair=True)
    assert (pair.pair_input, pair.output, pair.scalar, pair.max_request_bytes) == ("TEXT_PAIR", "SCORES", True, 1000)
    assert (pair.max_sequence_length, pair.max_batch_tokens) == (256, 8192)


@pytest.mark.parametrize(("config", "kwargs", "message"), [
    (PAIR_CONFIG, {}, r"takes a text pair \(TEXT, TEXT_PAIR\): give the second texts' column \(--pair-column\)"),
    (EMBED_CONFIG, {"pair": True}, r"takes one text \(TEXT\): leave out the pair column"),
    (EMBED_CONFIG, {"output": "LOGITS"}, r"has no output 'LOGITS' \(it has EMBEDDING\)"),
    ({**EMBED_CONFIG, "max_batch_size": 0}, {}, "has max_batch_size 0"),
    ({"name": "digits", "max_batch_size": 256, "input": [{"name": "image", "data_type": "TYPE_FP32", "dims": [8, 8]}],
      "output": [{"name": "logits", "data_type": "TYPE_FP32", "dims": [10]}]}, {},
     r"takes image \(TYPE_FP32\): a bulk job sends texts"),
    ({**EMBED_CONFIG, "output": [{"name": "A", "data_type": "TYPE_FP32", "dims": [2]},
                                 {"name": "B", "data_type": "TYPE_FP32", "dims": [2]}]}, {},
     r"has outputs A, B: name the one to write \(--output-name\)"),
    ({**EMBED_CONFIG, "output": [{"name": "T", "data_type": "TYPE_FP32", "dims": [-1, 384]}]}, {},
     "has dims \\[-1, 384\\]: a bulk job writes fixed-size rows"),
    ({**EMBED_CONFIG, "output": [{"name": "T", "data_type": "TYPE_STRING", "dims": [1]}]}, {},
     "is TYPE_STRING: a bulk job writes numbers"),
])
def test_model_io_says_why_a_model_does_not_fit(config, kwargs, message):
    with pytest.raises(BatchJobError, match=message):
        model_io(config, **kwargs)


# --- planning and concurrency --------------------------------------------------------------------------------


def test_requests_hold_length_sorted_rows_within_every_bound():
    rng = random.Random(3)
    lengths = [rng.randint(1, 300) for _ in range(1001)]
    sizes = [4 * n for n in lengths[:1000]] + [5000]
    requests = plan_requests(lengths, sizes, max_rows=64, max_bytes=4000, max_tokens=4096, seed=None)
    everything = np.concatenate(requests)
    assert sorted(everything.tolist()) == list(range(len(sizes)))  # every row exactly once
    for request in requests:
        assert len(request) <= 64
        assert sum(sizes[i] for i in request) <= 4000 or len(request) == 1
        assert len(request) * max(lengths[i] for i in request) <= 4096 or len(request) == 1
    assert [1000] in [r.tolist() for r in requests]  # larger than max_bytes: alone
    in_order = [lengths[i] for i in everything]
    assert in_order == sorted(in_order)  # seed None: length order
    assert max(len(r) for r in plan_requests(lengths, [1] * 1001, max_rows=64, max_bytes=10**9, seed=None)) == 64


def test_requests_go_out_shuffled_with_the_cheapest_last():
    lengths = list(range(1, 641))  # 10 requests of 64 rows, ever longer
    requests = plan_requests(lengths, [1] * 640, max_rows=64, max_bytes=10**6, seed=1)
    first_rows = [int(r[0]) for r in requests]
    assert sorted(first_rows) == list(range(0, 640, 64))
    assert first_rows[-1] == 0  # the cheapest tenth (one request) last
    assert first_rows[:-1] != sorted(first_rows[:-1])  # the rest in a random order...
    assert [int(r[0]) for r in plan_requests(lengths, [1] * 640, max_rows=64, max_bytes=10**6, seed=1)] == \
        first_rows  # ...drawn from the seed
    assert plan_requests([], [], max_rows=8, max_bytes=10) == []


def test_row_lengths_are_estimated_or_counted_by_the_tokenizer(version_dir):
    texts = [b"a short one", b"Don't stop: co-operate, please!", ("word " * 400).encode()]
    assert [estimate_tokens(t) for t in texts[:2]] == [3 + 2, 11 + 2]
    assert row_lengths(texts, None, max_tokens=256).tolist() == [5, 13, 256]
    assert row_lengths(texts[:1], [b"and its pair"]).tolist() == [5 + 5]
    counted = row_lengths(texts, None, tokenizer=version_dir / "tokenizer.json", max_tokens=256)
    assert counted.tolist() == [5, 13, 256]  # [CLS] ... [SEP]; the packaged file's own padding to 128 is off
    paired = row_lengths(texts[:1], [b"and its pair"], tokenizer=version_dir / "tokenizer.json")
    assert paired.tolist() == [5 + 4]  # [CLS] a [SEP] b [SEP]


def simulate(search, rows_per_s, answers, rows=64):
    """Feed ``search`` answers of ``rows`` rows arriving at ``rows_per_s(concurrency)``; the concurrency at the end."""
    now = 0.0
    for _ in range(answers):
        now += rows / rows_per_s(search.target)
        search.record(rows, now)
    return search.target


def test_the_search_climbs_while_it_pays_and_holds_the_best():
    search = ConcurrencySearch(start=1, maximum=64, reprobe_windows=1000)
    assert simulate(search, lambda c: 100.0 * min(c, 4), 400) == 4
    assert [c for c, _ in search.history[:4]] == [1, 2, 4, 8]
    assert search.history[3][1] == pytest.approx(400.0)
    flat = ConcurrencySearch(start=2, maximum=64)
    assert simulate(flat, lambda c: 300.0, 200) == 2  # no gain from more: stays at the start
    capped = ConcurrencySearch(start=2, maximum=6)
    assert simulate(capped, lambda c: 50.0 * c, 400) == 6


def test_the_search_probes_again_while_holding_and_backs_off():
    search = ConcurrencySearch(start=2, maximum=32, reprobe_windows=3)
    capacity = {"limit": 2}
    simulate(search, lambda c: 100.0 * min(c, capacity["limit"]), 100)
    assert search.target == 2
    capacity["limit"] = 8  # the server got faster (a neighbour finished)
    assert simulate(search, lambda c: 100.0 * min(c, capacity["limit"]), 400) == 8
    assert search.back_off() == 4 and search.target == 4


def test_the_search_ignores_answers_sent_before_a_change():
    search = ConcurrencySearch(start=2, maximum=4, window_s=1.0, min_requests=1)
    search.record(10, 0.0)   # opens the window
    search.record(10, 0.5)
    search.record(10, 1.0)   # closes it (a window holds at least `concurrency` answers): 20 rows/s at 2
    assert search.target == 4 and search.history == [(2, 20.0)]
    search.record(1000, 1.1)  # sent at 2: not counted
    search.record(1000, 1.2)  # sent at 2: not counted; the window opens here
    for now in (1.45, 1.7, 1.95, 2.2):
        search.record(40, now)
    assert search.history[-1] == (4, pytest.approx(160.0))


def test_requests_go_to_the_least_busy_server_that_is_up_in_turn():
    pool = EndpointPool(["a", "b", "c"], cooldown_s=5)
    picked = []
    for _ in range(6):
        endpoint = pool.pick(0.0)
        picked.append(endpoint.url)
    assert picked == ["a", "b", "c", "a", "b", "c"]  # equals in turn
    pool.endpoints[0].in_flight = 3
    assert pool.pick(0.0).url != "a"
    pool.endpoints[0].in_flight = 0
    pool.fail(pool.endpoints[1], now=10.0)
    assert {pool.pick(11.0).url for _ in range(4)} == {"a", "c"}
    pool.fail(pool.endpoints[0], now=10.0)
    pool.fail(pool.endpoints[2], now=12.0)
    assert pool.pick(11.0) is None and pool.next_up_s(11.0) == pytest.approx(4.0)
    assert pool.pick(15.0).url in ("a", "b")


# --- part files and resuming ---------------------------------------------------------------------------------


def test_parts_are_whole_files_and_resuming_reads_their_ids(tmp_path):
    io = model_io(EMBED_CONFIG)
    schema = output_schema(io, "doc", "string")
    clock = {"now": 0.0}
    writer = PartWriter(tmp_path, schema, part_rows=3, part_interval_s=10.0, clock=lambda: clock["now"])
    writer.add(np.array(["a", "b"], dtype=object), np.ones((2, 4), np.float32))
    assert writer.buffered == 2 and not list(tmp_path.iterdir())
    writer.add(np.array(["c"], dtype=object), np.ones((1, 4), np.float32))  # 3 rows: a part
    writer.add(np.array(["d"], dtype=object), np.zeros((1, 4), np.float32))
    assert not writer.due()
    clock["now"] = 11.0
    assert writer.due() and writer.flush() == 1
    (tmp_path / "part-000003.tmp").write_bytes(b"torn")  # what a kill during a write leaves
    assert finished_ids(tmp_path, "doc") == {"a", "b", "c", "d"}
    assert not list(tmp_path.glob("*.tmp"))
    later = PartWriter(tmp_path, schema, part_rows=10, part_interval_s=10.0)  # numbered after the others
    later.add(np.array(["e"], dtype=object), np.full((1, 4), 2, np.float32))
    later.flush()
    assert [p.name for p in sorted(tmp_path.glob("part-*"))] == ["part-000001.parquet", "part-000002.parquet",
                                                                  "part-000003.parquet"]
    output = OutputFile(tmp_path / "out.parquet", schema)
    assert output.copy_parts(tmp_path) == 5 and output.rows == 5
    output.commit()
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 4)
    assert table.column("doc").to_pylist() == ["a", "b", "c", "d", "e"]
    assert table.schema.metadata[b"coalesce.output"] == b"EMBEDDING"
    assert not (tmp_path / "out.parquet.tmp").exists()
    later.add(np.array(["a"], dtype=object), np.ones((1, 4), np.float32))
    later.flush()
    with pytest.raises(BatchJobError, match="holds 1 ids twice"):
        finished_ids(tmp_path, "doc")


# --- the job's loop ------------------------------------------------------------------------------------------


def vector(text: bytes) -> np.ndarray:
    """The stand-in model's output for one text: a function of the text alone."""
    return np.array([len(text), sum(text) % 97, text[0], 1.0], dtype=np.float32)


class ScriptedClient:
    """Answers like ``EmbeddingClient.infer`` for a 4-wide embedding model, computing each row from its text.

    ``refuse``: texts the "server" answers INVALID_ARG for (the whole request fails, as Triton does);
    ``down``: raise ``ServerUnavailableError`` for every request; ``stop_after``: answer that many
    requests, then raise KeyboardInterrupt in the job's own thread (a kill, as far as the job can tell).
    """

    def __init__(self, url="s1", *, refuse=(), down=False, config=EMBED_CONFIG):
        self.url, self.model, self.refuse, self.down, self.config = url, "minilm", set(refuse), down, config
        self.sent_rows: list[bytes] = []
        self.requests = 0
        self.lock = threading.Lock()

    def model_config(self):
        if self.down:
            raise ServerUnavailableError(f"cannot reach {self.url}")
        return dict(self.config)

    def infer(self, inputs, outputs):
        texts = [row[0] for row in inputs["TEXT"]]
        with self.lock:
            self.requests += 1
            if self.down:
                raise ServerUnavailableError(f"cannot reach {self.url}")
            if self.refuse.intersection(texts):
                raise InvalidInputError("input 'TEXT' row 0 is refused")
            self.sent_rows.extend(texts)
        return {outputs[0]: np.stack([vector(t) for t in texts])}


def write_input(path, count, bad_every=0):
    with open(path, "w") as stream:
        for i in range(count):
            if bad_every and i % bad_every == 0:
                stream.write('{"id": "broken\n')
            stream.write(json.dumps({"id": f"r{i}", "text": f"row number {i} " + "word " * (i % 17)}) + "\n")
    return path


def options(tmp_path, **kwargs):
    defaults = {"input_path": tmp_path / "in.jsonl", "output_path": tmp_path / "out.parquet", "progress": False,
                "rows_per_request": 8, "part_rows": 8}
    return BatchOptions(**{**defaults, **kwargs})


def read_output(path):
    table = pq.read_table(path)
    return dict(zip(table.column("id").to_pylist(), table.column("embedding").to_pylist(), strict=True))


def test_a_job_writes_every_valid_row_once_and_rejects_the_rest(tmp_path):
    write_input(tmp_path / "in.jsonl", 100, bad_every=25)
    client = ScriptedClient()
    messages = []
    report = run_batch(options(tmp_path), [client], log=messages.append)
    assert (report.rows, report.rejected, report.written, report.output_rows, report.skipped) == (100, 4, 100, 100, 0)
    out = read_output(tmp_path / "out.parquet")
    assert set(out) == {f"r{i}" for i in range(100)}
    for i in (0, 57, 99):
        np.testing.assert_array_equal(out[f"r{i}"], vector((f"row number {i} " + "word " * (i % 17)).encode()))
    rejects = [json.loads(line) for line in (tmp_path / "out.parquet.rejects.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rejects] == [1, 27, 53, 79]
    assert rejects[0] == {"line": 1, "id": None, "reason": "invalid JSON: Unterminated string starting at (column 8)",
                          "raw": '{"id": "broken'}
    assert messages[0] == "coalesce-client: line 1: invalid JSON: Unterminated string starting at (column 8)"
    assert not (tmp_path / "out.parquet.parts").exists()
    with pytest.raises(BatchJobError, match=r"out\.parquet exists: pass --restart"):
        run_batch(options(tmp_path), [client], log=messages.append)


def test_rows_the_server_refuses_are_found_by_splitting_and_rejected(tmp_path):
    write_input(tmp_path / "in.jsonl", 40)
    client = ScriptedClient(refuse={b"row number 3 word word word "})
    report = run_batch(options(tmp_path), [client], log=lambda _: None)
    assert report.output_rows == 39 and report.rejected == 1
    (reject,) = [json.loads(line) for line in (tmp_path / "out.parquet.rejects.jsonl").read_text().splitlines()]
    assert reject["line"] == 4 and reject["id"] == "r3"
    assert reject["reason"] == "refused by the server: input 'TEXT' row 0 is refused"
    assert json.loads(reject["raw"]) == {"id": "r3", "text": "row number 3 word word word "}
    assert sorted(client.sent_rows) == sorted(set(client.sent_rows))  # every answered row was answered once


def test_a_killed_job_resumes_without_sending_a_finished_row_again(tmp_path):
    write_input(tmp_path / "in.jsonl", 200)

    class Killed(ScriptedClient):
        def infer(self, inputs, outputs):
            if self.requests >= 6:
                raise KeyboardInterrupt  # lands in the job's thread through the future, like Ctrl-C
            return super().infer(inputs, outputs)

    first = Killed()
    with pytest.raises(KeyboardInterrupt):
        run_batch(options(tmp_path, concurrency=1), [first], log=lambda _: None)
    parts = tmp_path / "out.parquet.parts"
    finished = finished_ids(parts, "id")
    assert len(finished) == len(first.sent_rows) == 48  # every answer that came back was written
    second = ScriptedClient()
    messages = []
    report = run_batch(options(tmp_path), [second], log=messages.append)
    assert report.skipped == 48 and report.sent == 152 and report.written == 152
    sent_ids = {f"r{t.split()[2].decode()}" for t in second.sent_rows}
    assert not sent_ids & finished and len(second.sent_rows) == 152
    assert set(read_output(tmp_path / "out.parquet")) == {f"r{i}" for i in range(200)}
    assert "resuming" in messages[0] and "48 rows finished" in messages[0]


def test_a_resumed_job_must_be_the_same_job(tmp_path):
    write_input(tmp_path / "in.jsonl", 20)
    parts = tmp_path / "out.parquet.parts"
    run_batch(options(tmp_path, keep_parts=True), [ScriptedClient()], log=lambda _: None)
    (tmp_path / "out.parquet").unlink()
    with pytest.raises(BatchJobError, match=r"holds the parts of another job \(text_column 'text' then, 'body' now\)"):
        run_batch(options(tmp_path, text_column="body"), [ScriptedClient()], log=lambda _: None)
    report = run_batch(options(tmp_path, restart=True), [ScriptedClient()], log=lambda _: None)
    assert report.skipped == 0 and report.written == 20 and not parts.exists()


def test_a_server_that_is_down_is_left_alone_and_the_others_do_the_work(tmp_path):
    write_input(tmp_path / "in.jsonl", 100)
    up, down = ScriptedClient("up"), ScriptedClient("down")
    messages = []
    run_batch(options(tmp_path, concurrency=4), [up, down], log=messages.append)  # down answers its config
    assert len(read_output(tmp_path / "out.parquet")) == 100
    write_input(tmp_path / "in.jsonl", 100)
    (tmp_path / "out.parquet").unlink()
    down.down = True
    report = run_batch(options(tmp_path, concurrency=4), [up, down], log=messages.append)
    assert report.output_rows == 100 and [s["url"] for s in report.servers] == ["up"]
    assert any("down does not answer" in m for m in messages)


@pytest.mark.parametrize("error", [ServerUnavailableError, ServerError])
def test_a_server_that_fails_mid_job_is_left_alone(tmp_path, error):
    write_input(tmp_path / "in.jsonl", 100)
    up = ScriptedClient("up")

    class Dying(ScriptedClient):
        def infer(self, inputs, outputs):
            with self.lock:
                self.requests += 1
                if self.requests > 2:
                    raise error("Stub process 'minilm_0_0' is not healthy.")
            return {outputs[0]: np.stack([vector(row[0]) for row in inputs["TEXT"]])}

    dying = Dying("dying")
    messages = []
    report = run_batch(options(tmp_path, concurrency=2, cooldown_s=60), [up, dying], log=messages.append)
    assert report.output_rows == 100
    by_url = {s["url"]: s for s in report.servers}
    assert by_url["dying"]["failures"] in (1, 2) and by_url["up"]["rows"] + by_url["dying"]["rows"] == 100
    assert any(f"dying: {error.__name__}: Stub process" in m for m in messages)


def test_when_no_server_answers_the_job_stops_and_keeps_its_parts(tmp_path):
    write_input(tmp_path / "in.jsonl", 30)

    class Failing(ScriptedClient):
        def infer(self, inputs, outputs):
            if self.requests >= 2:
                self.down = True
            return super().infer(inputs, outputs)

    client = Failing()
    with pytest.raises(BatchJobError, match=r"a request failed 3 times, on every server: .*16 rows of this run are "
                                            r"kept in .*out.parquet.parts: run the job again to resume"):
        run_batch(options(tmp_path, concurrency=1, cooldown_s=0.05), [client], log=lambda _: None)
    assert len(finished_ids(tmp_path / "out.parquet.parts", "id")) == 16


def test_a_pair_model_gets_scores(tmp_path):
    path = tmp_path / "in.csv"
    path.write_text("qid,query,doc\n1,q,short\n2,q,a longer document\n")
    seen = []

    class Pairs(ScriptedClient):
        def infer(self, inputs, outputs):
            seen.append(sorted(inputs))
            return {"SCORES": np.array([[len(row[0])] for row in inputs["TEXT_PAIR"]], dtype=np.float32)}

    report = run_batch(options(tmp_path, input_path=path, id_column="qid", text_column="query", pair_column="doc"),
                       [Pairs(config=PAIR_CONFIG)], log=lambda _: None)
    assert report.output_rows == 2 and seen == [["TEXT", "TEXT_PAIR"]]
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.schema.field("scores").type == pa.float32()
    assert dict(zip(table.column("qid").to_pylist(), table.column("scores").to_pylist(), strict=True)) == \
        {"1": 5.0, "2": 17.0}


# --- the CLI -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "fragment"), [
    (["batch", "in.jsonl"], "the following arguments are required: output"),
    (["batch", "in.jsonl", "out.parquet", "--concurrency", "0"], "concurrency must be at least 1, got 0"),
    (["batch", "in.jsonl", "out.parquet", "--format", "xml"], "argument --format: invalid choice: 'xml'"),
    (["--url", "a:1", "--url", "b:2", "embed", "x"], "several --url are for the batch command; embed takes one"),
])
def test_batch_usage_errors_exit_2(capsys, argv, fragment):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_batch_without_a_server_fails_with_exit_1(capsys, tmp_path):
    from coalesce_tools.launcher import free_port

    write_input(tmp_path / "in.jsonl", 3)
    code = main(["--url", f"127.0.0.1:{free_port()}", "--timeout-s", "2", "--max-attempts", "1", "batch",
                 str(tmp_path / "in.jsonl"), str(tmp_path / "out.parquet")])
    assert code == 1
    err = capsys.readouterr().err
    assert "does not answer" in err and "BatchJobError: no server answered" in err
