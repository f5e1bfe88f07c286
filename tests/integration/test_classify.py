"""The classify task on a real tritonserver, over HTTP and gRPC: a cross-encoder (``minilm_cross_encoder``).

The served model is the test-only one of ``tests/models/``, built at set-up from the
packaged MiniLM encoder with a seeded classification head (no cross-encoder weights ship
in any package here): its scores are not meaningful, but ``transformers`` computes the
same model's outputs, which the served scores must equal.
"""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from coalesce_client.client import encode_texts
from coalesce_client.load import model_counts, sample_texts
from tests.conftest import TRICKY_TEXTS, built
from tests.integration.conftest import FIXED_COST, in_one_execute, infer, infer_concurrently

MODEL = "minilm_cross_encoder"
PROTOCOLS = ("http", "grpc")
QUERY = "how do dynamic batchers coalesce requests?"


@pytest.fixture(scope="module")
def reference():
    """Sigmoid of ``transformers``' own logits for (text, pair) rows: the model's folder, its tokenizer."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = built(MODEL) / "hf"
    model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))

    def scores(pairs: list[tuple[str, str]], activation: str = "sigmoid") -> np.ndarray:
        encoded = tokenizer([q for q, _ in pairs], [d for _, d in pairs], padding=True, truncation=True,
                            max_length=256, return_tensors="pt")
        with torch.no_grad():
            logits = model(**encoded).logits
        return (torch.sigmoid(logits) if activation == "sigmoid" else logits).numpy()

    return scores


def pairs_request(pairs: list[tuple[str, str]]) -> list[tuple[str, np.ndarray, str]]:
    return [("TEXT", encode_texts([q for q, _ in pairs]), "BYTES"),
            ("TEXT_PAIR", encode_texts([d for _, d in pairs]), "BYTES")]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_rerank_call_equals_transformers(server, protocol, reference):
    documents = [t for t in TRICKY_TEXTS] + ["Triton's dynamic batcher gathers requests.", "word " * 400]
    pairs = [(QUERY, d) for d in documents]
    got = infer(server, protocol, MODEL, pairs_request(pairs), ["SCORES"])["SCORES"]
    want = reference(pairs)
    assert got.shape == (len(pairs), 1) and got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-4
    assert want.std() > 0.01, "the seeded head should spread the scores (else the comparison proves little)"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_concurrent_requests_are_coalesced_and_equal_each_pair_alone(server, protocol, reference):
    texts = sample_texts(60, seed=11)
    rng = np.random.default_rng(5)
    requests, pairs_of = [], []
    for i in range(24):
        count = int(rng.integers(1, 4))
        pairs = [(texts[(i + k) % 60], texts[(3 * i + 7 * k + 1) % 60]) for k in range(count)]
        pairs_of.append(pairs)
        requests.append(pairs_request(pairs))
    before = model_counts(server.grpc_url, MODEL)
    answers = infer_concurrently(server, protocol, MODEL, requests, ["SCORES"])
    after = model_counts(server.grpc_url, MODEL)
    assert after[1] - before[1] < len(requests), "Triton should have handed several requests to one execute()"
    for pairs, answer in zip(pairs_of, answers, strict=True):
        assert not isinstance(answer, Exception), answer
        alone = np.concatenate([reference([pair]) for pair in pairs])  # each pair computed by itself, unpadded
        assert answer["SCORES"].shape == (len(pairs), 1)
        assert np.abs(answer["SCORES"] - alone).max() <= 1e-4


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(("case", "fragment"), [
    ("rows_differ", "input 'TEXT' batch size does not match other inputs"),
    ("pair_missing", "missing required input(s) ['TEXT_PAIR']"),
    ("pair_not_utf8", "input 'TEXT_PAIR' row 1 is not valid UTF-8: byte 0xff at offset 0"),
])
def test_bad_inputs_get_invalid_arg(server, protocol, case, fragment):
    requests = {
        "rows_differ": [("TEXT", encode_texts(["a", "b"]), "BYTES"), ("TEXT_PAIR", encode_texts(["c"]), "BYTES")],
        "pair_missing": [("TEXT", encode_texts(["a"]), "BYTES")],
        "pair_not_utf8": [("TEXT", encode_texts(["a", "b"]), "BYTES"),
                          ("TEXT_PAIR", encode_texts([b"fine", b"\xffbad"]), "BYTES")],
    }
    with pytest.raises(InferenceServerException) as info:
        infer(server, protocol, MODEL, requests[case], ["SCORES"])
    assert fragment in info.value.message()
    assert str(info.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT")
    assert infer(server, protocol, MODEL, pairs_request([("still", "alive")]), ["SCORES"])["SCORES"].shape == (1, 1)


def test_a_bad_request_in_an_execute_does_not_fail_its_neighbours(server, scratch_model, http_client, reference):
    """Four requests reach one execute() (the variant waits for exactly four); one is bad."""
    scratch_model("rerank_wide", source=MODEL, wide=4, parameters={"cost_model": FIXED_COST})
    http_client.load_model("rerank_wide")
    pairs = [(QUERY, f"document number {i}") for i in range(4)]
    requests = [pairs_request([p]) for p in pairs]
    requests[1] = [("TEXT", encode_texts(["q"]), "BYTES"), ("TEXT_PAIR", encode_texts([b"\xc3\x28"]), "BYTES")]
    results = in_one_execute(server, "rerank_wide", requests, ["SCORES"])
    assert isinstance(results[1], InferenceServerException)
    assert "input 'TEXT_PAIR' row 0 is not valid UTF-8" in results[1].message()
    for i in (0, 2, 3):
        assert isinstance(results[i], dict), results[i]
        assert abs(float(results[i]["SCORES"][0, 0]) - float(reference([pairs[i]])[0, 0])) <= 1e-4


def test_activation_none_serves_the_logits(server, scratch_model, http_client, reference):
    scratch_model("rerank_logits", source=MODEL, parameters={"cost_model": FIXED_COST, "activation": "none"})
    http_client.load_model("rerank_logits")
    pairs = [(QUERY, "logits, not probabilities"), (QUERY, "a second document")]
    got = infer(server, "grpc", "rerank_logits", pairs_request(pairs), ["SCORES"])["SCORES"]
    assert np.abs(got - reference(pairs, activation="none")).max() <= 1e-4
    assert np.abs(1 / (1 + np.exp(-got)) - reference(pairs)).max() <= 1e-4  # the shipped model's sigmoid of them
