"""The embedding task's pooling (``mean`` or ``cls``) and normalisation, against numpy from the token states."""

import numpy as np
import pytest

from coalesce.loader import load_pipeline
from coalesce.tasks.embedding.pooling import pool
from tests.conftest import model_config
from tests.unit.fakes import EncoderRuntime, answers, contextual_states, embedding_pipeline, texts

TEXTS = ["a short one", "a somewhat longer text with more tokens in it", "x"]


def states_and_mask():
    rng = np.random.default_rng(3)
    hidden = rng.standard_normal((3, 6, 5)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0, 0], [1] * 6, [1, 1, 0, 0, 0, 0]])
    return hidden, mask


def reference(hidden, mask, mode, normalize):
    """numpy in float64: the first token's state, or the mean over the real tokens; then the L2 norm."""
    hidden = hidden.astype(np.float64)
    if mode == "cls":
        pooled = hidden[:, 0, :]
    else:
        pooled = np.stack([hidden[r, mask[r] == 1].mean(axis=0) for r in range(len(hidden))])
    if normalize:
        pooled = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
    return pooled


@pytest.mark.parametrize("mode", ["mean", "cls"])
@pytest.mark.parametrize("normalize", [True, False])
def test_pool_matches_numpy(mode, normalize):
    hidden, mask = states_and_mask()
    got = pool(hidden, mask, mode=mode, normalize=normalize)
    assert got.dtype == np.float32 and got.shape == (3, 5) and got.flags.c_contiguous
    np.testing.assert_allclose(got, reference(hidden, mask, mode, normalize), rtol=1e-5, atol=1e-6)
    norms = np.linalg.norm(got, axis=1)
    if normalize:
        np.testing.assert_allclose(norms, 1.0, rtol=1e-5)
    else:
        assert not np.allclose(norms, 1.0)


def test_padding_never_reaches_a_pooled_vector():
    hidden, mask = states_and_mask()
    garbage = hidden.copy()
    garbage[mask == 0] = 1e6
    for mode in ("mean", "cls"):
        np.testing.assert_array_equal(pool(garbage, mask, mode=mode, normalize=True),
                                      pool(hidden, mask, mode=mode, normalize=True))


def own_states(task, text, states_of):
    """The token states of ``text`` alone, unpadded, and its mask."""
    prepared = task.prepare([text])
    feeds = task.assemble(prepared, np.array([0]), int(prepared.lengths[0]))
    return states_of(feeds), feeds["attention_mask"]


@pytest.mark.parametrize(("pooling", "normalize"), [("cls", "true"), ("cls", "false"), ("mean", "false")])
def test_the_pipeline_pools_each_rows_own_token_states(pooling, normalize):
    runtime = EncoderRuntime()
    pipeline, _ = embedding_pipeline(runtime, pooling=pooling, normalize=normalize, planner="greedy",
                                     max_padding_ratio="100")
    (result,) = answers(pipeline, {"TEXT": texts(*TEXTS)})
    longest = max(pipeline.task.lengths(TEXTS))
    assert runtime.calls == [(3, longest)]  # one pass: the short rows were padded
    for row, text in enumerate(TEXTS):
        states, mask = own_states(pipeline.task, text, contextual_states)
        want = reference(states, mask, pooling, normalize == "true")[0]
        np.testing.assert_allclose(result["EMBEDDING"][row], want, rtol=1e-5, atol=1e-6)
    # cls takes each row's first token, which differs per row (the fake's states carry their row's context).
    assert len({v.tobytes() for v in result["EMBEDDING"]}) == 3


@pytest.mark.parametrize(("pooling", "normalize"), [("cls", True), ("mean", False), ("cls", False)])
def test_the_real_graphs_token_states_pooled_as_configured(version_dir, pooling, normalize):
    config = model_config("minilm", pooling=pooling, normalize=str(normalize).lower(), cost_model="0.001,0.0001,0",
                          precision="fp32")
    pipeline = load_pipeline(config, version_dir)
    (result,) = answers(pipeline, {"TEXT": texts(*TEXTS)})
    # The token states of each text alone, from the same ONNX graph, pooled in numpy.
    for row, text in enumerate(TEXTS):
        states, mask = own_states(pipeline.task, text,
                                  lambda feeds: pipeline.runtime.run(feeds, ["last_hidden_state"])["last_hidden_state"])
        want = reference(states, mask, pooling, normalize)[0]
        np.testing.assert_allclose(result["EMBEDDING"][row], want, rtol=1e-4, atol=1e-5)
