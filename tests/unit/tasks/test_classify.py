"""The classify task: activations against numpy, and the contract checks of its config and graph."""

import copy

import numpy as np
import pytest

from coalesce.core.errors import ConfigError
from coalesce.settings import ModelSettings
from coalesce.tasks import create_task
from coalesce.tasks.classify.task import ClassifyTask, activate
from tests.conftest import built, model_config
from tests.unit.fakes import text_graph

LOGITS = np.array([[2.0, -1.0, 0.5], [-30.0, 0.0, 30.0], [1000.0, 999.0, -1000.0]], dtype=np.float32)


def test_none_returns_the_logits_unchanged():
    got = activate(LOGITS, "none")
    assert got.dtype == np.float32 and got.tobytes() == LOGITS.tobytes()
    assert activate(LOGITS.astype(np.float64), "none").dtype == np.float32


# Logits of -1000 must not overflow (no warning) and give the limit, 0.
@pytest.mark.filterwarnings("error")
def test_sigmoid_is_per_label():
    got = activate(LOGITS, "sigmoid")
    want = np.exp(-np.logaddexp(0.0, -LOGITS.astype(np.float64)))
    assert got.dtype == np.float32 and got.shape == LOGITS.shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)


def test_softmax_is_over_the_labels_and_stable_for_large_logits():
    got = activate(LOGITS, "softmax")
    shifted = LOGITS.astype(np.float64) - LOGITS.max(axis=1, keepdims=True)
    want = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    assert got.dtype == np.float32 and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, rtol=1e-6)


def task_of(config):
    return create_task(ModelSettings.from_model_config(config), config, built("minilm_cross_encoder"))


def test_the_test_cross_encoder_takes_pairs_and_gives_one_sigmoid_score():
    task = task_of(model_config("minilm_cross_encoder"))
    assert isinstance(task, ClassifyTask)
    assert task.pairs and task.activation == "sigmoid" and task.width == 1
    assert [(t.name, t.optional) for t in task.inputs] == [("TEXT", False), ("TEXT_PAIR", False)]
    assert task.graph_outputs == ("logits",)
    task.bind(text_graph("logits", (None, 1)))


def test_a_classifier_of_single_texts_and_several_labels():
    config = copy.deepcopy(model_config("minilm_cross_encoder", activation="softmax"))
    config["input"] = config["input"][:1]
    config["output"][0]["dims"] = ["3"]
    task = task_of(config)
    assert not task.pairs and task.width == 3
    task.bind(text_graph("logits", (None, 3)))


def test_text_pair_may_be_declared_optional():
    config = copy.deepcopy(model_config("minilm_cross_encoder"))
    config["input"][1]["optional"] = True
    task = task_of(config)
    assert [(t.name, t.optional) for t in task.inputs] == [("TEXT", False), ("TEXT_PAIR", True)]


@pytest.mark.parametrize(("dims", "graph_labels", "message"), [
    (["2"], 1, "model 'minilm_cross_encoder': output SCORES has dims [2] but the graph produces width 1"),
    (["1"], 3, "model 'minilm_cross_encoder': output SCORES has dims [1] but the graph produces width 3"),
])
def test_scores_must_have_the_graphs_number_of_labels(dims, graph_labels, message):
    config = copy.deepcopy(model_config("minilm_cross_encoder"))
    config["output"][0]["dims"] = dims
    task = task_of(config)
    with pytest.raises(ConfigError) as info:
        task.bind(text_graph("logits", (None, graph_labels)))
    assert str(info.value) == message


def test_logits_of_another_rank_or_name_are_refused():
    task = task_of(model_config("minilm_cross_encoder"))
    with pytest.raises(ConfigError, match=r"graph output 'logits' has shape \[None, None, 1\], expected 2 dims"):
        task.bind(text_graph("logits", (None, None, 1)))
    with pytest.raises(ConfigError, match=r"the graph has no output 'logits' \(outputs: \['last_hidden_state'\]\)"):
        task.bind(text_graph("last_hidden_state", (None, None, 384)))


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda c: c["output"][0].update(name="LOGITS"),
     "model 'minilm_cross_encoder': expected outputs ['SCORES'], found ['LOGITS']"),
    (lambda c: c["input"][1].update(name="DOCUMENT"),
     "model 'minilm_cross_encoder': task 'classify' takes input 'TEXT' and optionally 'TEXT_PAIR', found "
     "['DOCUMENT', 'TEXT']"),
    (lambda c: c["input"][1].update(dims=["2"]),
     "model 'minilm_cross_encoder': input 'TEXT_PAIR' has data_type 'TYPE_STRING' and dims [2], expected "
     "'TYPE_STRING' and [1]"),
    (lambda c: c["input"][1].update(data_type="TYPE_FP32"),
     "model 'minilm_cross_encoder': input 'TEXT_PAIR' has data_type 'TYPE_FP32' and dims [1], expected "
     "'TYPE_STRING' and [1]"),
], ids=["output_name", "pair_name", "pair_dims", "pair_type"])
def test_the_config_must_declare_the_classify_contract(mutate, message):
    config = copy.deepcopy(model_config("minilm_cross_encoder"))
    mutate(config)
    with pytest.raises(ConfigError) as info:
        task_of(config)
    assert str(info.value) == message


def test_activation_is_refused_on_another_task():
    with pytest.raises(ValueError, match="parameter 'activation' \\(value 'sigmoid'\\) applies to task classify, "
                                         "but this model's task is 'embedding'"):
        ModelSettings.from_model_config(model_config("minilm", activation="sigmoid"))
