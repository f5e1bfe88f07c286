"""The similarity task (``minilm_rerank``): each pair's score is the cosine of its two texts' embeddings.

Over a fake encoder the scores are checked against the embedding task's own vectors, the
passes against what they must feed (2k sequences for k rows), and over the real FP32 graph
against sentence-transformers' ``util.cos_sim``. No Triton.
"""

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coalesce.batching.costmodel import calibrate
from coalesce.core.errors import ConfigError, InvalidInputError, RuntimeFailure
from coalesce.core.task import Pass
from coalesce.runtimes.quantized import agreement
from coalesce.settings import ModelSettings, SettingsError
from coalesce.tasks import create_task
from coalesce.tasks.embedding.task import EmbeddingTask
from coalesce.tasks.similarity.task import SimilarityTask
from tests.conftest import built, model_config
from tests.unit.fakes import EncoderRuntime, answers, embedding_pipeline, similarity_pipeline, text_graph, texts

QUERIES = ["what is dynamic batching", "how tall is the eiffel tower", "which fruit is yellow"]
DOCUMENTS = ["Dynamic batching groups requests that arrive close together into one forward pass.",
             "The Eiffel Tower is 330 metres tall.", "Bananas are yellow and rich in potassium, " * 3]


def task_of(config):
    return create_task(ModelSettings.from_model_config(config), config, built("minilm_rerank"))


def pairs_request(rows):
    return {"TEXT": texts(*(q for q, _ in rows)), "TEXT_PAIR": texts(*(d for _, d in rows))}


def scores(pipeline, *requests):
    return [got["SCORES"] for got in answers(pipeline, *(pairs_request(rows) for rows in requests))]


# -- the contract ------------------------------------------------------------------------------------------------


def test_the_example_reranker_is_a_similarity_model_of_pairs_giving_one_score():
    task = task_of(model_config("minilm_rerank"))
    assert isinstance(task, SimilarityTask) and isinstance(task, EmbeddingTask)
    assert [(t.name, t.optional) for t in task.inputs] == [("TEXT", False), ("TEXT_PAIR", False)]
    assert [(t.name, t.data_type, t.dims) for t in task.outputs] == [("SCORES", "TYPE_FP32", (1,))]
    assert task.graph_outputs == ("last_hidden_state",) and task.graph_rows_per_row == 2
    assert task.unit_norm_outputs() == frozenset()  # a score is not a vector the cache may check for norm 1
    task.bind(text_graph("last_hidden_state", (None, None, 384)))
    assert task.hidden_width == 384
    fingerprint = task.fingerprint()
    assert fingerprint["task"] == "similarity" and fingerprint["pooling"] == "mean"


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda c: c["input"].pop(1),
     "model 'minilm_rerank': task 'similarity' scores (text, pair) rows: declare inputs 'TEXT' and 'TEXT_PAIR' "
     "(TYPE_STRING, dims [1]), neither optional"),
    (lambda c: c["input"][1].update(optional=True),
     "model 'minilm_rerank': task 'similarity' scores (text, pair) rows: declare inputs"),
    (lambda c: c["output"][0].update(dims=["384"]),
     "model 'minilm_rerank': task 'similarity' gives one score per row: output 'SCORES' has dims [1], found [384]"),
    (lambda c: c["output"][0].update(name="EMBEDDING"),
     "model 'minilm_rerank': expected outputs ['SCORES'], found ['EMBEDDING']"),
], ids=["no_pair", "optional_pair", "width", "output_name"])
def test_the_config_must_declare_the_similarity_contract(mutate, message):
    config = copy.deepcopy(model_config("minilm_rerank"))
    mutate(config)
    with pytest.raises(ConfigError) as info:
        task_of(config)
    assert str(info.value).startswith(message)


def test_scores_are_cosines_so_normalize_cannot_be_turned_off():
    with pytest.raises(SettingsError, match=r"'normalize' has bad value 'false': task 'similarity' scores the cosine"):
        ModelSettings.from_model_config(model_config("minilm_rerank", normalize="false"))
    assert ModelSettings.from_model_config(model_config("minilm_rerank", pooling="cls")).embedding.pooling == "cls"
    with pytest.raises(SettingsError, match=r"'activation'.*applies to task classify"):
        ModelSettings.from_model_config(model_config("minilm_rerank", activation="sigmoid"))


@pytest.mark.parametrize(("graph", "message"), [
    (text_graph("logits", (None, 1)), "model 'minilm_rerank': the graph has no output 'last_hidden_state'"),
    (text_graph("last_hidden_state", (None, 384)),
     "model 'minilm_rerank': graph output 'last_hidden_state' has shape [None, 384], expected 3 dims"),
    (text_graph("last_hidden_state", (None, None, 384), inputs=("input_ids", "pixel_values")),
     "model 'minilm_rerank': the graph takes inputs ['input_ids', 'pixel_values']; task 'similarity' fills"),
], ids=["logits", "rank", "foreign_input"])
def test_the_graph_must_give_token_states(graph, message):
    with pytest.raises(ConfigError) as info:
        task_of(model_config("minilm_rerank")).bind(graph)
    assert str(info.value).startswith(message)


def test_auto_completion_declares_both_inputs_required_and_one_score():
    config = {"name": "scorer", "max_batch_size": 8, "parameters": {"task": {"string_value": "similarity"}}}
    inputs, outputs = SimilarityTask.complete(config, text_graph("last_hidden_state", (None, None, 768)))
    assert [t.as_config() for t in inputs] == [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": [1]},
                                               {"name": "TEXT_PAIR", "data_type": "TYPE_STRING", "dims": [1]}]
    assert [t.as_config() for t in outputs] == [{"name": "SCORES", "data_type": "TYPE_FP32", "dims": [1]}]


# -- rows and passes ---------------------------------------------------------------------------------------------


def test_a_request_without_pairs_or_with_too_few_is_refused_naming_the_input():
    pipeline, _ = similarity_pipeline()
    alone, short, good = answers(pipeline, {"TEXT": texts("a query")},
                                 {"TEXT": texts("a", "b"), "TEXT_PAIR": texts("c")}, pairs_request([("q", "d")]))
    assert isinstance(alone, InvalidInputError) and "request has no input 'TEXT_PAIR'" in str(alone)
    assert isinstance(short, InvalidInputError) and "'TEXT_PAIR' has 1 rows but 'TEXT' has 2" in str(short)
    assert good["SCORES"].shape == (1, 1)


def test_a_pass_of_k_rows_feeds_2k_sequences_first_texts_then_pairs_padded_to_the_longer():
    task = task_of(model_config("minilm_rerank"))
    task.bind(text_graph("last_hidden_state", (None, None, 384)))
    rows = [("a b c d e f", "g"), ("h", "i j"), ("k l", "m n o p q r s t")]
    prepared = task.prepare(rows)
    singles = [len(task.tokenizer.encode([text]).ids) for row in rows for text in row]
    np.testing.assert_array_equal(prepared.lengths, [max(singles[0], singles[1]), max(singles[2], singles[3]),
                                                     max(singles[4], singles[5])])
    np.testing.assert_array_equal(task.lengths(rows), prepared.lengths)
    feeds = task.assemble(prepared, np.array([2, 0]), 12)
    assert feeds["input_ids"].shape == (4, 12)
    # Each text tokenised alone: [CLS] ... [SEP], type ids all 0 (a cross-encoder's pair would be one sequence).
    order = ["k l", "a b c d e f", "m n o p q r s t", "g"]
    for sequence, text in enumerate(order):
        ids = task.tokenizer.encode([text]).ids
        np.testing.assert_array_equal(feeds["input_ids"][sequence, :len(ids)], ids)
        assert feeds["attention_mask"][sequence].sum() == len(ids) and not feeds["token_type_ids"].any()


def test_scores_are_the_cosines_of_the_embedding_tasks_vectors():
    pipeline, _ = similarity_pipeline()
    embed, _ = embedding_pipeline(precision="fp32")
    rows = [(q, d) for q in QUERIES for d in DOCUMENTS]
    (got,) = scores(pipeline, rows)
    (first,), (second,) = (answers(embed, {"TEXT": texts(*column)}) for column in zip(*rows, strict=True))
    want = (first["EMBEDDING"] * second["EMBEDDING"]).sum(axis=1, keepdims=True)
    assert got.shape == (len(rows), 1) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert (np.abs(got) <= 1).all()
    assert {shape[0] % 2 for shape in pipeline.runtime.calls} == {0}  # every pass fed pairs of sequences


def test_a_wrong_shape_from_the_graph_is_a_runtime_failure():
    task = task_of(model_config("minilm_rerank"))
    task.bind(text_graph("last_hidden_state", (None, None, 384)))
    prepared = task.prepare([("a", "b c")])
    batch = Pass(prepared, np.array([0]), 4, task.assemble(prepared, np.array([0]), 4))
    with pytest.raises(RuntimeFailure, match=r"came back with shape \[1, 4, 384\], expected \[2, 4, 384\]"):
        task.split(batch, {"last_hidden_state": np.zeros((1, 4, 384), dtype=np.float32)})


text_strategy = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)


@settings(max_examples=30, deadline=None)
@given(requests=st.lists(st.lists(st.tuples(text_strategy, text_strategy), min_size=1, max_size=5), min_size=1,
                         max_size=6),
       max_rows=st.integers(1, 8), planner=st.sampled_from(["dp", "greedy"]))
def test_coalesced_scores_equal_each_row_alone(requests, max_rows, planner):
    pipeline, _ = similarity_pipeline(max_batch_rows=str(max_rows), planner=planner)
    together = scores(pipeline, *requests)
    for request, got in zip(requests, together, strict=True):
        alone = np.concatenate([scores(pipeline, [row])[0] for row in request])
        np.testing.assert_allclose(got, alone, rtol=1e-5, atol=1e-6)


# -- calibration, runtime limits, the INT8 guard -----------------------------------------------------------------


def test_calibration_times_passes_of_two_sequences_a_row():
    task = task_of(model_config("minilm_rerank"))
    runtime = EncoderRuntime()
    task.bind(runtime.graph)
    feeds = task.synthetic_feeds(3, 7)
    assert feeds["input_ids"].shape == (6, 7)
    _, samples = calibrate(runtime, task, max_rows=4, max_tokens=64, shapes=((1, 8), (4, 16)), repeats=1)
    assert [(rows, length) for rows, length, _ in samples] == [(1, 8), (4, 16)]  # the planner's rows: pairs
    assert sorted({shape for shape in runtime.calls}) == [(2, 8), (8, 16)]  # the graph's rows: sequences


def test_a_runtime_row_limit_bounds_passes_in_pairs():
    runtime = EncoderRuntime()
    runtime.max_rows = 9  # type: ignore[attr-defined]  # a TensorRT profile's most rows
    pipeline, _ = similarity_pipeline(runtime)
    assert pipeline.limits.max_rows == 4


def test_the_int8_guard_compares_each_texts_embedding():
    task = task_of(model_config("minilm_rerank"))
    with pytest.raises(ConfigError, match="the INT8 accuracy guard compares embeddings and needs the graph's"):
        task.guarded_task()
    runtime = EncoderRuntime()
    task.bind(runtime.graph)
    guarded = task.guarded_task()
    assert isinstance(guarded, EmbeddingTask) and not isinstance(guarded, SimilarityTask)
    assert [t.name for t in guarded.outputs] == ["EMBEDDING"] and guarded.width == 384
    found = agreement(task, runtime.run, runtime.run, texts=["one text", "another, longer text", "x"])
    assert found.min_cosine == pytest.approx(1.0, abs=1e-6) and found.texts == 3


# -- the real graph ------------------------------------------------------------------------------------------------


def test_fp32_scores_equal_sentence_transformers_cos_sim(reference_model):
    from sentence_transformers import util

    from coalesce.loader import load_pipeline

    pipeline = load_pipeline(model_config("minilm_rerank", precision="fp32", cost_model="0.001,0.0001,0"),
                             built("minilm_rerank"))
    rows = [(q, d) for q in QUERIES for d in DOCUMENTS] + [("token " * 400, "a long query's document")]
    (got,) = scores(pipeline, rows)
    want = np.array([[float(util.cos_sim(reference_model.encode(q), reference_model.encode(d)))] for q, d in rows])
    np.testing.assert_allclose(got, want, atol=1e-3)
    # Each query's own document ranks first.
    assert (got[:9].reshape(3, 3).argmax(axis=1) == [0, 1, 2]).all()
