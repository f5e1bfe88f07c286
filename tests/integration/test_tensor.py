"""The tensor task on a real tritonserver, over HTTP and gRPC: any ONNX graph, named tensors in and out.

Two example models: ``minilm_tokens`` (the MiniLM graph served raw: token ids of any
length in, token states out, each row cut back to its own length) and ``digits`` (a
fixed-shape classifier trained at set-up, from a minimal config the backend completes).
Coalesced results must equal each row run alone with ONNX Runtime directly.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from tritonclient.utils import InferenceServerException

from coalesce_client.load import model_counts, sample_texts
from tests.conftest import built
from tests.integration.conftest import FIXED_COST, in_one_execute, infer, infer_concurrently

TOKENS = "minilm_tokens"
DIGITS = "digits"
PROTOCOLS = ("http", "grpc")


@pytest.fixture(scope="module")
def sessions():
    return {name: ort.InferenceSession(str(built(name) / "model.onnx"), providers=["CPUExecutionProvider"])
            for name in (TOKENS, DIGITS)}


@pytest.fixture(scope="module")
def token_rows():
    """Token ids of sample texts of many lengths (the packaged tokenizer, special tokens added)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(built("minilm") / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=200)
    texts = [*sample_texts(40, seed=2), "a", "word " * 300]
    return [np.array(e.ids, dtype=np.int64) for e in tokenizer.encode_batch(texts)]


def tokens_request(rows: list[np.ndarray], *, send_mask: bool) -> list[tuple[str, np.ndarray, str]]:
    """One request of ``rows``, right-padded with 0 to the longest of them (with a mask of real positions)."""
    length = max(len(r) for r in rows)
    ids = np.zeros((len(rows), length), dtype=np.int64)
    mask = np.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = row
        mask[i, :len(row)] = 1
    request = [("input_ids", ids, "INT64"), ("token_type_ids", np.zeros_like(ids), "INT64")]
    return request + ([("attention_mask", mask, "INT64")] if send_mask else [])


def alone(session, request: list[tuple[str, np.ndarray, str]], output: str) -> np.ndarray:
    """Each row of ``request`` run by itself with ONNX Runtime (the mask filled with ones where not sent)."""
    feeds = {name: array for name, array, _ in request}
    if "input_ids" in feeds and "attention_mask" not in feeds:
        feeds["attention_mask"] = np.ones_like(feeds["input_ids"])
    rows = len(next(iter(feeds.values())))
    return np.concatenate([session.run([output], {k: v[i:i + 1] for k, v in feeds.items()})[0] for i in range(rows)])


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_token_rows_of_every_length_are_coalesced_and_equal_each_row_alone(server, protocol, sessions, token_rows):
    rng = np.random.default_rng(9)
    requests = []
    for i in range(24):
        if i % 3 == 0:  # one row, no mask: the backend fills it
            requests.append(tokens_request([token_rows[i % len(token_rows)]], send_mask=False))
        else:  # several rows padded by the client to the request's longest, with the client's mask
            picks = rng.choice(len(token_rows), size=int(rng.integers(2, 4)), replace=False)
            requests.append(tokens_request([token_rows[j] for j in picks], send_mask=True))
    before = model_counts(server.grpc_url, TOKENS)
    answers = infer_concurrently(server, protocol, TOKENS, requests, ["last_hidden_state"])
    after = model_counts(server.grpc_url, TOKENS)
    assert after[1] - before[1] < len(requests), "Triton should have handed several requests to one execute()"
    lengths = {r[0][1].shape[1] for r in requests}
    assert len(lengths) > 10, "the requests should span many lengths"
    for request, answer in zip(requests, answers, strict=True):
        assert not isinstance(answer, Exception), answer
        got = answer["last_hidden_state"]
        ids = request[0][1]
        assert got.shape == (*ids.shape, 384), "each row is cut back to its own request's length"
        np.testing.assert_allclose(got, alone(sessions[TOKENS], request, "last_hidden_state"), atol=2e-4, rtol=1e-4)


def test_digits_was_served_from_a_minimal_config(grpc_client):
    config = grpc_client.get_model_config(DIGITS, as_json=True)["config"]
    assert [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in config["input"]] == \
        [("image", "TYPE_FP32", [8, 8])]
    assert [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in config["output"]] == \
        [("logits", "TYPE_FP32", [10])]
    assert int(config["max_batch_size"]) == 256 and "dynamic_batching" in config


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_digit_images_are_stacked_and_equal_each_image_alone(server, protocol, sessions):
    from sklearn.datasets import load_digits

    data = load_digits()
    images = data.images.astype(np.float32)
    rng = np.random.default_rng(4)
    requests, targets, at = [], [], 0
    for _ in range(30):
        count = int(rng.integers(1, 6))
        requests.append([("image", images[at:at + count], "FP32")])
        targets.append(data.target[at:at + count])
        at += count
    answers = infer_concurrently(server, protocol, DIGITS, requests, ["logits"])
    correct = 0
    for request, target, answer in zip(requests, targets, answers, strict=True):
        assert not isinstance(answer, Exception), answer
        np.testing.assert_allclose(answer["logits"], alone(sessions[DIGITS], request, "logits"), atol=1e-5, rtol=1e-5)
        correct += int((answer["logits"].argmax(axis=1) == target).sum())
    assert correct / at >= 0.9, f"{correct} of {at} digits"


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(("case", "fragment"), [
    ("lengths_differ", "input 'token_type_ids' has length 5 on dim 1, but 'input_ids' has 4"),
    ("mask_length", "input 'attention_mask' has length 6 on dim 1, but 'input_ids' has 4"),
    ("too_long", "input 'input_ids' has rows of length 600; the model takes 1 to 512"),
    ("empty_rows", "input 'input_ids' has rows of length 0"),
    ("wrong_dtype", "data-type is 'INT32', but model 'minilm_tokens' expects 'INT64'"),
])
def test_bad_tensors_get_invalid_arg_naming_the_tensor(server, protocol, case, fragment):
    ids = np.ones((1, 4), dtype=np.int64)
    requests = {
        "lengths_differ": [("input_ids", ids, "INT64"), ("token_type_ids", np.zeros((1, 5), np.int64), "INT64")],
        "mask_length": [("input_ids", ids, "INT64"), ("token_type_ids", np.zeros_like(ids), "INT64"),
                        ("attention_mask", np.ones((1, 6), np.int64), "INT64")],
        "too_long": [("input_ids", np.ones((1, 600), np.int64), "INT64"),
                     ("token_type_ids", np.zeros((1, 600), np.int64), "INT64")],
        "empty_rows": [("input_ids", np.ones((1, 0), np.int64), "INT64"),
                       ("token_type_ids", np.zeros((1, 0), np.int64), "INT64")],
        "wrong_dtype": [("input_ids", ids.astype(np.int32), "INT32"), ("token_type_ids", ids, "INT64")],
    }
    with pytest.raises(InferenceServerException) as info:
        infer(server, protocol, TOKENS, requests[case], ["last_hidden_state"])
    assert fragment in info.value.message()
    assert str(info.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT")
    ok = infer(server, protocol, TOKENS, [("input_ids", ids, "INT64"), ("token_type_ids", ids * 0, "INT64")],
               ["last_hidden_state"])
    assert ok["last_hidden_state"].shape == (1, 4, 384)


def test_a_bad_request_in_an_execute_does_not_fail_its_neighbours(server, scratch_model, http_client, sessions,
                                                                  token_rows):
    scratch_model("tokens_wide", source=TOKENS, wide=4, parameters={"cost_model": FIXED_COST})
    http_client.load_model("tokens_wide")
    requests = [tokens_request([token_rows[i]], send_mask=False) for i in range(4)]
    requests[2] = [("input_ids", np.ones((1, 3), np.int64), "INT64"),
                   ("token_type_ids", np.zeros((1, 7), np.int64), "INT64")]
    results = in_one_execute(server, "tokens_wide", requests, ["last_hidden_state"])
    assert isinstance(results[2], InferenceServerException)
    assert "input 'token_type_ids' has length 7" in results[2].message()
    for i in (0, 1, 3):
        assert isinstance(results[i], dict), results[i]
        np.testing.assert_allclose(results[i]["last_hidden_state"],
                                   alone(sessions[TOKENS], requests[i], "last_hidden_state"), atol=2e-4, rtol=1e-4)
