"""The similarity task on a real tritonserver: ``minilm_rerank``, a bi-encoder scorer on all-MiniLM-L6-v2.

Its scores are cosines of the two texts' embeddings: held to sentence-transformers'
``util.cos_sim`` of the packaged model's vectors (FP32 to 1e-3; the shipped INT8 graph
within what its accuracy guard lets through), and they rank a relevant document above
unrelated ones.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from coalesce_client.client import encode_texts
from tests.conftest import TRICKY_TEXTS, model_dir
from tests.integration.conftest import FIXED_COST, add_model, infer, infer_concurrently

MODEL = "minilm_rerank"
PROTOCOLS = ("http", "grpc")
#: FP32 scores equal the reference to this; 1e-3 is the ">= 0.999" of the embedding contract, for a cosine.
FP32_ATOL = 1e-3
#: The shipped INT8 graph: each embedding passed the guard (cosine >= 0.98 with FP32, mean >= 0.99); its scores
#: differed from FP32's by at most 0.017 (mean 0.005) on 158 pairs of the guard's texts, held here with room.
INT8_ATOL = 0.03
#: (query, relevant document, unrelated documents): the relevant one must score highest.
RANKINGS = [
    ("What is the capital of France?", "Paris is the capital and most populous city of France.",
     ["The mitochondria is the powerhouse of the cell.", "Python lists can hold items of different types.",
      "The 2022 World Cup final was played in Qatar."]),
    ("how do plants make their food", "Photosynthesis lets plants turn sunlight, water and carbon dioxide into sugar.",
     ["The stock market fell sharply on Monday.", "A good espresso needs finely ground coffee.",
      "Paris is the capital and most populous city of France."]),
    ("best way to learn a programming language",
     "Practise every day: write small programs, read other people's code and build a project you care about.",
     ["Whales are mammals that live in the ocean.", "The Eiffel Tower is 330 metres tall.",
      "Heavy rain is expected in the north tomorrow."]),
    ("symptoms of the flu", "Influenza commonly causes fever, cough, sore throat, muscle aches and tiredness.",
     ["Mount Everest is the highest mountain above sea level.", "Bake the bread at 220 degrees for 30 minutes.",
      "The train to Berlin leaves at nine."]),
]


def pairs_request(pairs: list[tuple[str, str]]) -> list[tuple[str, np.ndarray, str]]:
    return [("TEXT", encode_texts([q for q, _ in pairs]), "BYTES"),
            ("TEXT_PAIR", encode_texts([d for _, d in pairs]), "BYTES")]


@pytest.fixture(scope="module")
def reference(reference_model):
    """sentence-transformers' ``util.cos_sim`` of the packaged model's embeddings, per (text, pair) row."""
    from sentence_transformers import util

    def scores(pairs: list[tuple[str, str]]) -> np.ndarray:
        first = reference_model.encode([q for q, _ in pairs], convert_to_tensor=True)
        second = reference_model.encode([d for _, d in pairs], convert_to_tensor=True)
        return util.cos_sim(first, second).diagonal().numpy()[:, None]

    return scores


@pytest.fixture(scope="module")
def exact(server, repository):
    """minilm_rerank served from its FP32 graph: the scores sentence-transformers computes."""
    import tritonclient.http as httpclient

    name = "minilm_rerank_fp32"
    add_model(repository, name, source=model_dir(MODEL), parameters={"precision": "fp32", "cost_model": FIXED_COST})
    client = httpclient.InferenceServerClient(server.http_url)
    client.load_model(name)
    yield name
    client.unload_model(name)
    client.close()
    shutil.rmtree(repository / name, ignore_errors=True)


def all_pairs() -> list[tuple[str, str]]:
    documents = [*TRICKY_TEXTS, "Triton's dynamic batcher gathers requests.", "word " * 400]
    return [("how do dynamic batchers coalesce requests?", d) for d in documents] + [
        (query, document) for query, relevant, others in RANKINGS for document in (relevant, *others)]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_fp32_scores_equal_sentence_transformers_cos_sim(server, exact, reference, protocol):
    pairs = all_pairs()
    got = infer(server, protocol, exact, pairs_request(pairs), ["SCORES"])["SCORES"]
    assert got.shape == (len(pairs), 1) and got.dtype == np.float32
    np.testing.assert_allclose(got, reference(pairs), atol=FP32_ATOL)


def test_the_shipped_int8_scores_stay_within_the_guard_of_the_reference(server, reference):
    pairs = all_pairs()
    got = infer(server, "grpc", MODEL, pairs_request(pairs), ["SCORES"])["SCORES"]
    assert np.abs(got - reference(pairs)).max() <= INT8_ATOL
    assert (np.abs(got) <= 1).all()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_relevant_document_outranks_unrelated_ones(server, protocol):
    for query, relevant, others in RANKINGS:
        documents = [*others[:1], relevant, *others[1:]]
        scores = infer(server, protocol, MODEL, pairs_request([(query, d) for d in documents]), ["SCORES"])["SCORES"]
        assert int(np.argmax(scores[:, 0])) == 1, (query, scores[:, 0].tolist())
        assert scores[1, 0] - np.delete(scores[:, 0], 1).max() > 0.1, (query, scores[:, 0].tolist())


def test_concurrent_requests_are_coalesced_and_equal_the_reference(server, exact, reference):
    pairs = all_pairs()
    requests = [pairs_request(pairs[i:i + 3]) for i in range(0, len(pairs), 3)]
    answers = infer_concurrently(server, "grpc", exact, requests, ["SCORES"])
    for i, answer in zip(range(0, len(pairs), 3), answers, strict=True):
        assert not isinstance(answer, Exception), answer
        np.testing.assert_allclose(answer["SCORES"], reference(pairs[i:i + 3]), atol=FP32_ATOL)


@pytest.mark.parametrize(("case", "fragment"), [
    ("pair_missing", "missing required input(s) ['TEXT_PAIR']"),
    ("pair_not_utf8", "input 'TEXT_PAIR' row 1 is not valid UTF-8: byte 0xff at offset 0"),
])
def test_bad_inputs_get_invalid_arg(server, case, fragment):
    requests = {
        "pair_missing": [("TEXT", encode_texts(["a"]), "BYTES")],
        "pair_not_utf8": [("TEXT", encode_texts(["a", "b"]), "BYTES"),
                          ("TEXT_PAIR", encode_texts([b"fine", b"\xffbad"]), "BYTES")],
    }
    with pytest.raises(InferenceServerException) as info:
        infer(server, "grpc", MODEL, requests[case], ["SCORES"])
    assert fragment in info.value.message()
    assert infer(server, "grpc", MODEL, pairs_request([("still", "alive")]), ["SCORES"])["SCORES"].shape == (1, 1)
