"""Bulk jobs (``coalesce-client batch``) against a real server: outputs match direct calls, bad rows are
rejected with their line numbers, a killed job resumes without sending a finished row again (counted
by the server itself, ``coalesce_rows_total``), a pair model gets scores, and a dead server is left out.
"""

from __future__ import annotations

import csv
import json
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tritonclient.grpc as grpcclient

from coalesce_client import EmbeddingClient
from coalesce_client.batch import BatchOptions, finished_ids, run_batch
from coalesce_client.load import sample_texts
from coalesce_tools.launcher import free_port
from tests.integration.conftest import FIXED_COST, add_model, infer
from tests.integration.test_adaptive import steady
from tests.integration.test_cache import metric, settled_metric

#: A model of the batch tests alone (FP32, no row cache), so that the server's row counter is theirs.
MODEL = "minilm_batch"
ROWS = 300


@pytest.fixture(scope="module")
def batch_model(server, repository):
    add_model(repository, MODEL, parameters={"cost_model": FIXED_COST})
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.load_model(MODEL)
    yield MODEL
    client.unload_model(MODEL)
    client.close()
    shutil.rmtree(repository / MODEL, ignore_errors=True)


@pytest.fixture(scope="module")
def texts():
    # Short and long rows, so that the job's length sort has something to sort.
    return [text + " padding" * (i % 40) for i, text in enumerate(sample_texts(ROWS, seed=11))]


@pytest.fixture(scope="module")
def direct(server, batch_model, texts):
    """The model's vectors for every text, by plain calls."""
    with EmbeddingClient(server.grpc_url, model=batch_model) as client:
        return client.embed(texts)


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "coalesce_client.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def vectors_by_id(path, id_column="id", column="embedding"):
    table = pq.read_table(path)
    ids = table.column(id_column).to_pylist()
    assert len(ids) == len(set(ids)), "an id is in the output twice"
    return dict(zip(ids, np.asarray(table.column(column).to_pylist(), dtype=np.float32), strict=True))


def assert_matches(out, direct, ids):
    assert sorted(out) == sorted(ids)
    got = np.stack([out[i] for i in ids])
    np.testing.assert_allclose(got, direct[: len(ids)], atol=2e-4)  # FP32; passes of other shapes differ in the 6th


def test_a_jsonl_job_matches_direct_calls_and_rejects_bad_lines(server, batch_model, texts, direct, tmp_path):
    source = tmp_path / "in.jsonl"
    bad = {5: '{"id": "x", "text": "unterminated', 50: '{"text": "no id"}', 120: '{"id": "r3", "text": "dup"}',
           200: '{"id": "e", "text": ""}', 250: "not json at all"}
    lines, line_of_bad = [], {}
    for i, text in enumerate(texts):
        if i in bad:
            lines.append(bad[i])
            line_of_bad[len(lines)] = bad[i]
        lines.append(json.dumps({"id": f"r{i}", "text": text}))
    source.write_text("\n".join(lines) + "\n")
    output = tmp_path / "out.parquet"
    done = run_cli("--url", server.grpc_url, "--model", batch_model, "batch", str(source), str(output))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["rows"], report["rejected"], report["output_rows"], report["skipped"]) == (ROWS, 5, ROWS, 0)
    assert_matches(vectors_by_id(output), direct, [f"r{i}" for i in range(ROWS)])
    rejects = [json.loads(line) for line in (tmp_path / "out.parquet.rejects.jsonl").read_text().splitlines()]
    assert {r["line"]: r["raw"] for r in rejects} == line_of_bad
    reasons = [r["reason"] for r in rejects]
    assert reasons[1:] == ["missing 'id'", "duplicate 'id' 'r3': first on line 4", "'text' is empty",
                           "invalid JSON: Expecting value (column 1)"]
    for reject in rejects:  # each is said on standard error too, with its line number
        assert f"line {reject['line']}: {reject['reason']}" in done.stderr
    assert not (tmp_path / "out.parquet.parts").exists()


@pytest.mark.parametrize("kind", ["csv", "parquet"])
def test_csv_and_parquet_jobs_match_direct_calls(server, batch_model, texts, direct, tmp_path, kind):
    count = 130
    source = tmp_path / f"in.{kind}"
    if kind == "csv":
        with open(source, "w", newline="") as stream:
            writer = csv.writer(stream)
            writer.writerow(["doc", "body"])
            writer.writerows([[f"d{i}", texts[i]] for i in range(count)])
    else:
        pq.write_table(pa.table({"doc": pa.array(range(count), pa.int64()), "body": texts[:count]}), source)
    with EmbeddingClient(server.grpc_url, model=batch_model) as client:
        report = run_batch(BatchOptions(source, tmp_path / "out.parquet", id_column="doc", text_column="body",
                                        progress=False), [client], log=lambda _: None)
    assert report.output_rows == count and report.rejected == 0
    out = vectors_by_id(tmp_path / "out.parquet", id_column="doc")
    ids = [f"d{i}" for i in range(count)] if kind == "csv" else list(range(count))
    assert_matches(out, direct, ids)


def test_a_killed_job_resumes_and_sends_no_finished_row_again(server, batch_model, texts, direct, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": f"r{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    output = tmp_path / "out.parquet"
    parts = tmp_path / "out.parquet.parts"
    # Small requests and parts, one at a time, so that the kill lands mid-job with parts on disk.
    job = subprocess.Popen([sys.executable, "-m", "coalesce_client.cli", "--url", server.grpc_url, "--model",
                            batch_model, "batch", str(source), str(output), "--rows-per-request", "4",
                            "--part-rows", "4", "--concurrency", "1"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(parts.glob("part-*.parquet"))) < 3 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        job.send_signal(signal.SIGKILL)
    finally:
        job.wait(timeout=30)
    assert job.returncode == -signal.SIGKILL, f"the job ended before the kill: {job.stderr.read()}"
    assert not output.exists()
    finished = finished_ids(parts, "id")
    assert 12 <= len(finished) < ROWS
    # The server finishes what the killed job had in flight: count from when its counter stands still.
    before = steady(lambda: metric(server, "coalesce_rows_total", batch_model))
    done = run_cli("--url", server.grpc_url, "--model", batch_model, "batch", str(source), str(output))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    unfinished = ROWS - len(finished)
    assert (report["skipped"], report["sent"], report["written"]) == (len(finished), unfinished, unfinished)
    assert f"{len(finished)} rows finished" in done.stderr
    settled_metric(server, "coalesce_rows_total", batch_model, lambda value: value >= before + unfinished)
    seen = steady(lambda: metric(server, "coalesce_rows_total", batch_model)) - before
    assert seen == unfinished, f"the server saw {seen} rows; {unfinished} were not finished"
    out = vectors_by_id(output)
    assert_matches(out, direct, [f"r{i}" for i in range(ROWS)])  # every id exactly once


def test_a_pair_model_gets_scores_like_direct_calls(server, tmp_path):
    pairs = [("what is batching", text) for text in sample_texts(40, seed=3)]
    source = tmp_path / "pairs.csv"
    with open(source, "w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(["qid", "query", "doc"])
        writer.writerows([[f"q{i}", q, d] for i, (q, d) in enumerate(pairs)])
    output = tmp_path / "scores.parquet"
    done = run_cli("--url", server.grpc_url, "--model", "minilm_rerank", "batch", str(source), str(output),
                   "--id-column", "qid", "--text-column", "query", "--pair-column", "doc")
    assert done.returncode == 0, done.stderr
    table = pq.read_table(output)
    assert table.schema.field("scores").type == pa.float32()
    scores = dict(zip(table.column("qid").to_pylist(), table.column("scores").to_pylist(), strict=True))
    want = infer(server, "grpc", "minilm_rerank",
                 [("TEXT", np.array([[q.encode()] for q, _ in pairs], dtype=object), "BYTES"),
                  ("TEXT_PAIR", np.array([[d.encode()] for _, d in pairs], dtype=object), "BYTES")],
                 ["SCORES"])["SCORES"][:, 0]
    np.testing.assert_allclose([scores[f"q{i}"] for i in range(len(pairs))], want, atol=1e-4)
    done = run_cli("--url", server.grpc_url, "--model", "minilm_rerank", "batch", str(source),
                   str(tmp_path / "other.parquet"))
    assert done.returncode == 1
    assert "takes a text pair (TEXT, TEXT_PAIR): give the second texts' column (--pair-column)" in done.stderr


def test_a_dead_server_among_several_is_left_out(server, batch_model, texts, direct, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts[:100])))
    dead = f"127.0.0.1:{free_port()}"
    done = run_cli("--url", dead, "--url", server.grpc_url, "--model", batch_model, "--max-attempts", "1",
                   "batch", str(source), str(tmp_path / "out.parquet"))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["output_rows"] == 100 and [s["url"] for s in report["servers"]] == [server.grpc_url]
    assert f"{dead} does not answer" in done.stderr
    assert_matches(vectors_by_id(tmp_path / "out.parquet"), direct, list(range(100)))
