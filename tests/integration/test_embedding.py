"""The embedding task on a real tritonserver, over HTTP and gRPC: the shipped ``minilm`` model."""

from __future__ import annotations

import json
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from coalesce.runtimes.quantized import int8_pays
from coalesce_client import EmbeddingClient
from coalesce_client.client import encode_texts
from coalesce_client.load import run_load, sample_texts
from tests.conftest import TRICKY_TEXTS, built, model_config
from tests.integration.conftest import EXACT_MODEL, INT8_MODEL, WIDE_BATCH, WIDE_MODEL, in_one_execute, infer
from tests.integration.test_cache import settled_metric

PROTOCOLS = ("http", "grpc")


def raw_infer(server, protocol, inputs_spec, model="minilm"):
    """Send exactly the given inputs: [(name, numpy array, datatype)]; return EMBEDDING."""
    return infer(server, protocol, model, inputs_spec, ["EMBEDDING"])["EMBEDDING"]


def embed_raw(server, protocol, texts, model="minilm"):
    return raw_infer(server, protocol, [("TEXT", encode_texts(texts), "BYTES")], model=model)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_vectors_are_unchanged_from_the_recorded_export(server, protocol):
    """The task interface did not change a vector: the served vectors against those recorded before it.

    ``tests/fixtures/minilm_reference.json`` holds the vectors the embedding-only pipeline
    served (at 244dd6f) for a fixed text set, one text per pass.
    """
    recorded = json.loads((Path(__file__).resolve().parent.parent / "fixtures" / "minilm_reference.json").read_text())
    got = embed_raw(server, protocol, recorded["texts"], model=EXACT_MODEL)
    cosine = (got * np.asarray(recorded["vectors"], dtype=np.float32)).sum(axis=1)
    assert cosine.min() >= 0.9999, dict(zip(recorded["texts"], cosine.tolist(), strict=True))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_matches_sentence_transformers(server, protocol, reference_model):
    got = embed_raw(server, protocol, TRICKY_TEXTS, model=EXACT_MODEL)
    want = reference_model.encode(TRICKY_TEXTS, normalize_embeddings=True)
    assert got.shape == (len(TRICKY_TEXTS), 384) and got.dtype == np.float32
    cosine = (got * want).sum(axis=1)
    assert cosine.min() >= 0.999, dict(zip(TRICKY_TEXTS, cosine.tolist(), strict=True))


def test_minilm_is_served_as_shipped(server, grpc_client):
    """The server runs model_repository/minilm's config unchanged: precision auto and a 64 MiB row cache."""
    shipped = {k: v["string_value"] for k, v in model_config("minilm")["parameters"].items()}
    served = {
        k: v["string_value"]
        for k, v in grpc_client.get_model_config("minilm", as_json=True)["config"]["parameters"].items()
    }
    assert served == shipped
    assert (served["precision"], served["cache_bytes"]) == ("auto", str(64 << 20))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_precision_auto_serves_the_graph_its_record_chose(server, protocol):
    """Shipped minilm serves INT8 where set-up measured it faster than FP32 on this CPU, else the FP32 graph."""
    pays, why = int8_pays(built("minilm") / "model.int8.onnx")
    texts = [f"{t} (auto, {protocol})" for t in TRICKY_TEXTS]  # new to the row cache: computed here
    served = embed_raw(server, protocol, texts)
    fp32 = embed_raw(server, protocol, texts, model=EXACT_MODEL)
    cosine = (served * fp32).sum(axis=1)
    if pays:
        assert not np.array_equal(served, fp32) and cosine.min() >= 0.98, why
    else:
        assert cosine.min() >= 0.99999, why  # the FP32 graph (on one thread or every core: the same sums)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_int8_graph_stays_within_its_guard_of_sentence_transformers(server, protocol, reference_model):
    """The INT8 graph set-up made (precision int8 forced: auto serves it only where it pays) keeps its contract."""
    texts = (TRICKY_TEXTS + sample_texts(64, seed=11))[:64]  # one request: up to max_batch_size rows
    texts = [f"{t} ({protocol})" for t in texts]
    want = reference_model.encode(texts, normalize_embeddings=True)
    served = embed_raw(server, protocol, texts, model=INT8_MODEL)
    # The INT8 graph answered, not the FP32 one: its vectors are close to FP32's but not equal.
    fp32 = embed_raw(server, protocol, texts, model=EXACT_MODEL)
    assert not np.array_equal(served, fp32)
    together = (served * want).sum(axis=1)
    with ThreadPoolExecutor(max_workers=8) as pool:  # and one text per request, batched by Triton
        apart = np.concatenate(list(pool.map(lambda t: embed_raw(server, protocol, [f"{t} (apart)"],
                                                                 model=INT8_MODEL), texts)))
    alone = (apart * reference_model.encode([f"{t} (apart)" for t in texts], normalize_embeddings=True)).sum(axis=1)
    for cosine in (together, alone):
        assert cosine.mean() >= 0.99 and cosine.min() >= 0.98, dict(zip(texts, cosine.tolist(), strict=True))


def test_one_request_of_many_equals_many_requests_of_one(server):
    """Coalescing changes no vector: FP32 without a row cache, so that every row is computed both ways."""
    texts = sample_texts(40, seed=3) + TRICKY_TEXTS
    together = embed_raw(server, "grpc", texts, model=EXACT_MODEL)
    with ThreadPoolExecutor(max_workers=16) as pool:
        apart = list(pool.map(lambda t: embed_raw(server, "grpc", [t], model=EXACT_MODEL)[0], texts))
    cosine = (together * np.stack(apart)).sum(axis=1)
    assert cosine.min() >= 0.99999


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("wrong_dtype", "data-type is 'FP32', but model 'minilm' expects 'BYTES'"),
        ("unknown_input", "unexpected inference input 'PROMPT'"),
        ("over_max_batch", "batch-size must be <= 64"),
        ("non_utf8", "input 'TEXT' row 1 is not valid UTF-8: byte 0xff at offset 3"),
        # Triton refuses an empty batch itself, before the backend sees it (the backend's own refusal,
        # "input 'TEXT' has no rows", is unit-tested).
        ("empty", "expected 1 string elements for inference input 'TEXT' for model 'minilm', got 0"),
    ],
)
def test_bad_inputs_get_clear_errors(server, protocol, case, fragment):
    specs = {
        "wrong_dtype": [("TEXT", np.ones((1, 1), dtype=np.float32), "FP32")],
        "unknown_input": [("PROMPT", encode_texts(["hi"]), "BYTES")],
        "over_max_batch": [("TEXT", encode_texts(["hi"] * 65), "BYTES")],
        "non_utf8": [("TEXT", encode_texts([b"fine", b"bad\xff"]), "BYTES")],
        "empty": [("TEXT", np.empty((0, 1), dtype=np.object_), "BYTES")],
    }
    with pytest.raises(InferenceServerException) as info:
        raw_infer(server, protocol, specs[case])
    assert fragment in info.value.message()
    if case == "non_utf8":
        status = str(info.value.status())
        assert status in ("400", "StatusCode.INVALID_ARGUMENT"), status
    # The server is still healthy after every bad input.
    assert embed_raw(server, protocol, ["still alive"]).shape == (1, 384)


def test_bad_request_in_a_batch_does_not_fail_its_neighbours(server, reference_model):
    """Six requests reach one execute() (the wide model waits for exactly six); one is bad."""
    texts = [f"neighbour number {i}" for i in range(WIDE_BATCH)]
    payloads = [[t.encode()] for t in texts]
    payloads[2] = [b"\xc3\x28 invalid"]  # one row, so the six requests are exactly six rows
    results = in_one_execute(
        server, WIDE_MODEL, [[("TEXT", encode_texts(p), "BYTES")] for p in payloads], ["EMBEDDING"]
    )
    assert isinstance(results[2], InferenceServerException)
    assert "row 0 is not valid UTF-8: byte 0xc3" in results[2].message()
    want = reference_model.encode(texts, normalize_embeddings=True)
    for i in set(range(WIDE_BATCH)) - {2}:
        assert isinstance(results[i], dict), results[i]
        assert float(results[i]["EMBEDDING"][0] @ want[i]) >= 0.999


def test_concurrent_load_is_batched(server, capsys):
    with EmbeddingClient(server.grpc_url, protocol="grpc") as client:
        report = run_load(client, stats_url=server.grpc_url, requests=256, concurrency=32)
    assert report.inference_count == 256
    # Triton's dynamic batcher must have merged requests: far fewer executions than inferences.
    assert report.execution_count <= report.inference_count / 4, report
    with capsys.disabled():
        print(f"\nconcurrent load (gRPC, 256 requests x 1 text, concurrency 32): {json.dumps(report.as_dict())}")


def test_metrics_are_exported(server):
    embed_raw(server, "http", ["count me", "and me"])
    settled_metric(server, "coalesce_stage_seconds_count", "minilm", lambda v: v >= 6)  # sent every 100 ms
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    labels = 'model="minilm",version="1"'
    for family in (
        "coalesce_rows_total",
        "coalesce_forward_passes_total",
        "coalesce_real_tokens_total",
        "coalesce_padded_tokens_total",
        "coalesce_padding_ratio_count",
        "coalesce_executions_total",
    ):
        lines = [line for line in text.splitlines() if line.startswith(family + "{") and labels in line]
        assert lines, f"{family} with {labels} missing"
        assert float(lines[0].rsplit(" ", 1)[1]) > 0
    stages = {}
    for labelled, value in re.findall(r"^coalesce_stage_seconds_count\{([^}]*)\} (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', labelled))
        if found.get("model") == "minilm" and found.get("version") == "1":
            stages[found["stage"]] = float(value)
    assert set(stages) == {"read", "prepare", "plan", "infer", "split", "scatter"}, stages
    assert all(count > 0 for count in stages.values()), stages
