"""Bulk jobs on Ray (``coalesce-client batch --engine ray``, ``coalesce_client.ray``) against a real server.

A local Ray instance (two CPUs, no dashboard) runs the actors; the server is the shared test
server. Outputs match direct calls and the local engine's columns, bad rows land in the rejects
file with their reasons, and a rerun after lost part files sends only the rows they held (counted
by the server itself, ``coalesce_rows_total``). The multi-node run with a killed worker is
tests/integration/test_bulk_ray_cluster.py (slow, ``make bulk-ray-test``).
"""

# ruff: noqa: F811 (the fixtures of test_batch, imported, are this module's arguments)
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from coalesce_client import EmbeddingClient
from coalesce_client.batch import BatchOptions, run_batch
from coalesce_client.load import sample_texts
from tests.conftest import INT8_SCORE_ATOL
from tests.integration.conftest import infer
from tests.integration.test_adaptive import steady
from tests.integration.test_batch import (  # noqa: F401 (fixtures)
    ROWS,
    assert_matches,
    batch_model,
    direct,
    run_cli,
    texts,
    vectors_by_id,
)
from tests.integration.test_cache import metric, settled_metric

ray = pytest.importorskip("ray", reason="the ray extra is not installed")


@pytest.fixture(scope="module")
def local_ray():
    for attempt in range(3):  # a loaded machine sometimes misses Ray's start-up timeout (its raylet never registers)
        try:
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                     logging_level="WARNING")
            break
        except Exception:  # Ray raises a bare Exception ("The current node timed out during startup")
            ray.shutdown()  # ends the half-started instance's GCS before the next try
            if attempt == 2:
                raise
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


def test_a_ray_job_matches_direct_calls_and_the_local_columns(server, batch_model, texts, direct, tmp_path,
                                                              local_ray):
    source = tmp_path / "in.jsonl"
    lines = [json.dumps({"id": f"r{i}", "text": t}) for i, t in enumerate(texts)]
    bad = ['{"id": "x", "text": "unterminated', '{"text": "no id"}', '{"id": "e", "text": ""}',
           '{"id": 7, "text": "a"}']
    for offset, line in enumerate(bad):
        lines.insert(40 * offset + 3, line)
    source.write_text("\n".join(lines) + "\n")
    with EmbeddingClient(server.grpc_url, model=batch_model) as client:
        report = run_batch(BatchOptions(source, tmp_path / "ray.parquet", engine="ray", ray_batch_rows=64,
                                        progress=False), [client], log=lambda _: None)
        local = run_batch(BatchOptions(source, tmp_path / "local.parquet", progress=False), [client],
                          log=lambda _: None)
    assert (report.output_rows, report.rejected) == (ROWS, 4)
    assert pq.read_schema(tmp_path / "ray.parquet").equals(pq.read_schema(tmp_path / "local.parquet"),
                                                           check_metadata=True)
    assert local.output_rows == ROWS
    assert_matches(vectors_by_id(tmp_path / "ray.parquet"), direct, [f"r{i}" for i in range(ROWS)])
    rejects = [json.loads(line) for line in (tmp_path / "ray.parquet.rejects.jsonl").read_text().splitlines()]
    reasons = sorted(r["reason"] for r in rejects)
    assert reasons == sorted(["invalid JSON: Unterminated string starting at (column 21)", "missing 'id'",
                              "'text' is empty", "'id' must be a string like the first row's"]), reasons
    assert {r["raw"] for r in rejects} == set(bad)
    assert not (tmp_path / "ray.parquet.parts").exists()


def test_a_ray_rerun_sends_only_the_rows_whose_parts_are_missing(server, batch_model, texts, direct, tmp_path,
                                                                 local_ray):
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": pa.array(range(ROWS), pa.int64()), "text": texts}), source)
    output = tmp_path / "out.parquet"
    parts = tmp_path / "out.parquet.parts"
    argv = ["--url", server.grpc_url, "--model", batch_model, "batch", str(source), str(output), "--engine",
            "ray", "--ray-batch-rows", "50", "--keep-parts"]
    done = run_cli(*argv, timeout=180)
    assert done.returncode == 0, done.stderr
    written = sorted(parts.glob("part-*.parquet"))
    assert len(written) == ROWS // 50  # a part per batch
    # Lose two parts and the output (as a job killed before its merge would): the rerun sends their rows only.
    lost = sum(pq.ParquetFile(p).metadata.num_rows for p in written[:2])
    for part in written[:2]:
        part.unlink()
    output.unlink()
    before = steady(lambda: metric(server, "coalesce_rows_total", batch_model))
    done = run_cli(*argv, timeout=180)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["skipped"], report["written"], report["output_rows"]) == (ROWS - lost, lost, ROWS)
    settled_metric(server, "coalesce_rows_total", batch_model, lambda value: value >= before + lost)
    seen = steady(lambda: metric(server, "coalesce_rows_total", batch_model)) - before
    assert seen == lost, f"the server saw {seen} rows; {lost} were lost"
    assert_matches(vectors_by_id(output), direct, list(range(ROWS)))


def test_ray_data_callables_embed_and_score_in_a_users_pipeline(server, batch_model, texts, direct, local_ray):
    from coalesce_client.ray import Embed, Score

    rows = [{"id": i, "text": t} for i, t in enumerate(texts[:100])] + [{"id": 100, "text": ""}]
    out = ray.data.from_items(rows).map_batches(
        Embed, fn_constructor_args=([server.grpc_url], batch_model), batch_format="pyarrow", batch_size=32,
        compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0.25).take_all()
    by_id = {r["id"]: r for r in out}
    assert len(by_id) == 101 and by_id[100]["embedding"] is None and by_id[100]["error"] == "'text' is empty"
    got = np.stack([np.asarray(by_id[i]["embedding"], dtype=np.float32) for i in range(100)])
    np.testing.assert_allclose(got, direct[:100], atol=2e-4)
    pairs = [("what is batching", text) for text in sample_texts(20, seed=3)]
    scored = ray.data.from_items([{"id": i, "query": q, "doc": d} for i, (q, d) in enumerate(pairs)]).map_batches(
        Score, fn_constructor_args=([server.grpc_url], "minilm_rerank"),
        fn_constructor_kwargs={"text_column": "query", "pair_column": "doc"}, batch_format="pyarrow",
        batch_size=8, compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0.25).take_all()
    want = infer(server, "grpc", "minilm_rerank",
                 [("TEXT", np.array([[q.encode()] for q, _ in pairs], dtype=object), "BYTES"),
                  ("TEXT_PAIR", np.array([[d.encode()] for _, d in pairs], dtype=object), "BYTES")],
                 ["SCORES"])["SCORES"][:, 0]
    got_scores = [next(r["scores"] for r in scored if r["id"] == i) for i in range(len(pairs))]
    # The same pairs batched otherwise: INT8 scores agree to INT8_SCORE_ATOL, not bit for bit.
    np.testing.assert_allclose(got_scores, want, atol=INT8_SCORE_ATOL)


def test_an_openai_batch_file_through_ray_answers_as_through_the_local_engine(server, tmp_path, local_ray):
    from tests.integration.test_batch_openai import RERANK_BODY, TEXTS, line

    source = tmp_path / "in.jsonl"
    source.write_text("\n".join([
        line("emb", "/v1/embeddings", {"model": "minilm", "input": TEXTS}),
        line("rerank", "/v1/rerank", RERANK_BODY),
        line("bad", "/v1/embeddings", {"model": "minilm", "input": ""}),
    ]) + "\n")
    answers = {}
    for engine in ("local", "ray"):
        output = tmp_path / f"{engine}.jsonl"
        done = run_cli("--url", server.grpc_url, "batch", "--format", "openai", str(source), str(output),
                       "--engine", engine, "--no-progress", timeout=180)
        assert done.returncode == 0, done.stderr
        answers[engine] = {r["custom_id"]: r for r in map(json.loads, output.read_text().splitlines())}
    assert list(answers["ray"]) == ["emb", "rerank", "bad"]
    for engine in ("local", "ray"):
        assert answers[engine]["bad"]["error"] is not None and answers[engine]["bad"]["response"]["body"] is None
    local, ray_ = (answers[e]["emb"]["response"]["body"]["data"] for e in ("local", "ray"))
    np.testing.assert_allclose([d["embedding"] for d in ray_], [d["embedding"] for d in local], atol=2e-4)
    local, ray_ = (answers[e]["rerank"]["response"]["body"]["results"] for e in ("local", "ray"))
    assert [r["index"] for r in ray_] == [r["index"] for r in local]
    np.testing.assert_allclose([r["relevance_score"] for r in ray_], [r["relevance_score"] for r in local], atol=1e-4)
