"""What the text tasks share: reading UTF-8 rows, tokenising texts and pairs, canonical row bytes, the config and graph
checks at load."""

import copy

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coalesce.core.errors import ConfigError, InvalidInputError, RuntimeFailure
from coalesce.core.task import Pass
from coalesce.core.tensors import GraphIO, GraphTensor
from coalesce.settings import ModelSettings
from coalesce.tasks import create_task
from coalesce.tasks.text.reading import read_texts
from coalesce.tasks.text.tokenizer import TextTokenizer
from tests.conftest import built, model_config
from tests.unit.fakes import text_graph, texts


def task_of(config, name="minilm"):
    return create_task(ModelSettings.from_model_config(config), config, built(name))


@pytest.fixture(scope="module")
def embedding():
    return task_of(model_config("minilm"))


@pytest.fixture(scope="module")
def classify():
    return task_of(model_config("minilm_cross_encoder"), "minilm_cross_encoder")


# -- reading --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("array", "message"), [
    (None, "request has no input 'TEXT'"),
    (np.array([b"a", b"b"], dtype=np.object_), "input 'TEXT' has shape [2], expected [N, 1]"),
    (np.array([[b"a", b"b"]], dtype=np.object_), "input 'TEXT' has shape [1, 2], expected [N, 1]"),
    (np.ones((1, 1), dtype=np.float32), "input 'TEXT' has dtype float32, expected BYTES"),
    (np.empty((0, 1), dtype=np.object_), "input 'TEXT' has no rows: send at least one text (shape [N, 1], N >= 1)"),
    (texts(b"fine", b"ab\xff"), "input 'TEXT' row 1 is not valid UTF-8: byte 0xff at offset 2 (invalid start byte)"),
    (texts(b"\xe2\x82"), "input 'TEXT' row 0 is not valid UTF-8: byte 0xe2 at offset 0 (unexpected end of data)"),
    (texts("ok", "x" * 11),
     "input 'TEXT' row 1 is 11 bytes, over the model's limit of 10 (parameter 'max_text_bytes')"),
    (texts("ééééé", "éééééé"),
     "input 'TEXT' row 1 is 12 bytes, over the model's limit of 10 (parameter 'max_text_bytes')"),
    (np.array([[7]], dtype=np.object_), "input 'TEXT' row 0 is a int, expected bytes"),
], ids=["missing", "rank_1", "two_columns", "not_bytes", "empty", "non_utf8", "truncated_utf8", "too_long",
        "too_long_in_utf8", "not_a_string"])
def test_read_texts_names_the_input_the_row_and_what_is_wrong(array, message):
    with pytest.raises(InvalidInputError) as info:
        read_texts(array, "TEXT", max_bytes=10)
    assert str(info.value) == message


def test_read_texts_takes_bytes_and_str_at_the_limit():
    assert read_texts(texts("é" * 5, b"", "plain"), "TEXT", max_bytes=10) == ["é" * 5, "", "plain"]
    array = np.array([["abc"]], dtype=np.object_)
    assert read_texts(array, "TEXT", max_bytes=3) == ["abc"]


def test_a_pair_model_reads_pairs_and_single_texts(classify):
    assert classify.read({"TEXT": texts("q1", "q2"), "TEXT_PAIR": texts("d1", "d2")}) == [("q1", "d1"), ("q2", "d2")]
    assert classify.read({"TEXT": texts("alone")}) == ["alone"]
    with pytest.raises(InvalidInputError) as info:
        classify.read({"TEXT": texts("q1", "q2", "q3"), "TEXT_PAIR": texts("d1", "d2")})
    assert str(info.value) == "input 'TEXT_PAIR' has 2 rows but 'TEXT' has 3: send one pair text per text"
    with pytest.raises(InvalidInputError, match=r"^input 'TEXT_PAIR' has no rows"):
        classify.read({"TEXT": texts("q1"), "TEXT_PAIR": np.empty((0, 1), dtype=np.object_)})


def test_a_model_without_pairs_never_reads_text_pair(embedding):
    assert embedding.read({"TEXT": texts("one"), "TEXT_PAIR": texts("ignored")}) == ["one"]


# -- canonical row bytes --------------------------------------------------------------------------------------


def test_a_text_and_a_pair_never_share_row_bytes(embedding):
    assert embedding.row_bytes("ab") != embedding.row_bytes(("a", "b"))
    assert embedding.row_bytes(("ab", "c")) != embedding.row_bytes(("a", "bc"))
    assert embedding.row_bytes("") != embedding.row_bytes(("", ""))
    assert embedding.row_bytes("hello") == b"\x00hello"


rows = st.one_of(st.text(max_size=8), st.tuples(st.text(max_size=8), st.text(max_size=8)))


@given(a=rows, b=rows)
def test_row_bytes_are_equal_exactly_for_equal_rows(embedding, a, b):
    assert (embedding.row_bytes(a) == embedding.row_bytes(b)) == (a == b)


# -- tokenising -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer(built("minilm") / "tokenizer.json", 256)


def test_tokenizer_truncates_at_256_and_never_pads(tokenizer):
    rows = tokenizer.encode(["", "hello", "word " * 1000])
    assert rows.lengths.tolist()[:2] == [2, 3]  # [CLS] [SEP], [CLS] hello [SEP]
    assert rows.lengths[2] == 256
    assert len(rows.ids) == 2 + 3 + 256
    assert tokenizer.lengths(["", "hello", "word " * 1000]).tolist() == [2, 3, 256]


def test_pairs_are_truncated_together_and_typed_by_segment(tokenizer):
    rows = tokenizer.encode(["query"], ["word " * 1000])
    assert rows.lengths.tolist() == [256]
    types = rows.type_ids[:256]
    assert types[0] == 0 and types[-1] == 1 and set(types.tolist()) == {0, 1}
    assert tokenizer.lengths(["a", "b"], ["c", None]).tolist() == [5, 3]  # [CLS] a [SEP] c [SEP], [CLS] b [SEP]


def test_mixed_pairs_and_texts_keep_their_order(tokenizer):
    mixed = tokenizer.encode(["a", "b c", "d"], [None, "e", None])
    for row, (text, pair) in enumerate([("a", None), ("b c", "e"), ("d", None)]):
        alone = tokenizer.encode([text], None if pair is None else [pair])
        lo, hi = mixed.offsets[row], mixed.offsets[row + 1]
        assert mixed.ids[lo:hi].tolist() == alone.ids.tolist()
        assert mixed.type_ids[lo:hi].tolist() == alone.type_ids.tolist()


def test_padded_rows_are_right_padded_with_a_mask(tokenizer):
    rows = tokenizer.encode(["hello", "a b c d"])
    feeds = rows.padded(np.array([1, 0]), 8)
    assert feeds["input_ids"].dtype == np.int64 and feeds["input_ids"].shape == (2, 8)
    np.testing.assert_array_equal(feeds["attention_mask"], [[1] * 6 + [0] * 2, [1] * 3 + [0] * 5])
    assert feeds["input_ids"][1, :3].tolist() == rows.ids[:3].tolist() and feeds["input_ids"][1, 3:].sum() == 0
    assert list(rows.padded(np.array([0]), 3, ("input_ids", "attention_mask"))) == ["input_ids", "attention_mask"]


def test_a_missing_tokenizer_fails_the_load_saying_where():
    config = model_config("minilm", tokenizer_file="missing.json")
    with pytest.raises(ConfigError, match=r"^tokenizer file not found: .*/minilm/1/missing.json \(run `make setup`"):
        task_of(config)


# -- the declared contract ------------------------------------------------------------------------------------


def broken(name, mutate):
    config = copy.deepcopy(model_config(name))
    mutate(config)
    return config


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda c: c["input"][0].update(name="TEXTS"), "model 'minilm': task 'embedding' takes input 'TEXT', found "
                                                   "['TEXTS']"),
    (lambda c: c["input"][0].update(data_type="TYPE_FP32"),
     "model 'minilm': input 'TEXT' has data_type 'TYPE_FP32' and dims [1], expected 'TYPE_STRING' and [1]"),
    (lambda c: c["input"][0].update(dims=["2"]),
     "model 'minilm': input 'TEXT' has data_type 'TYPE_STRING' and dims [2], expected 'TYPE_STRING' and [1]"),
    (lambda c: c["input"].append({"name": "TEXT_PAIR", "data_type": "TYPE_STRING", "dims": ["1"]}),
     "model 'minilm': task 'embedding' takes no 'TEXT_PAIR' input"),
    (lambda c: c["output"][0].update(data_type="TYPE_FP16"),
     "model 'minilm': output 'EMBEDDING' has data_type 'TYPE_FP16', expected 'TYPE_FP32'"),
    (lambda c: c["output"][0].update(name="VECTOR"), "model 'minilm': expected outputs ['EMBEDDING'], found "
                                                     "['VECTOR']"),
    (lambda c: c["output"][0].update(dims=["384", "2"]),
     "model 'minilm': task 'embedding' has one output 'EMBEDDING' (TYPE_FP32) of one positive width such as [384]; "
     "found [('EMBEDDING', [384, 2])]"),
    (lambda c: c["output"][0].update(dims=["-1"]),
     "model 'minilm': task 'embedding' has one output 'EMBEDDING' (TYPE_FP32) of one positive width such as [384]; "
     "found [('EMBEDDING', [-1])]"),
    (lambda c: c["input"][0].update(data_type="TYPE_TEXT"),
     "model 'minilm': tensor 'TEXT' has data_type 'TYPE_TEXT', expected one of TYPE_BOOL"),
], ids=["input_name", "input_type", "input_dims", "pair_on_embedding", "output_type", "output_name", "output_rank",
        "output_variable", "unknown_type"])
def test_the_config_must_declare_the_task_contract(mutate, message):
    with pytest.raises(ConfigError) as info:
        task_of(broken("minilm", mutate))
    assert str(info.value).startswith(message)


def test_text_pair_is_only_for_tasks_of_pairs():
    rerank_inputs = model_config("minilm_cross_encoder")["input"]
    embedding_with_pairs = {**model_config("minilm"), "input": rerank_inputs}
    with pytest.raises(ConfigError, match=r"^model 'minilm': task 'embedding' takes no 'TEXT_PAIR' input$"):
        task_of(embedding_with_pairs)
    assert task_of(model_config("minilm_cross_encoder"), "minilm_cross_encoder").pairs


# -- the graph --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("graph", "message"), [
    (text_graph("last_hidden_state", (None, None, 384), inputs=("input_ids", "pixel_values")),
     "model 'minilm': the graph takes inputs ['input_ids', 'pixel_values']; task 'embedding' fills "
     "['input_ids', 'attention_mask', 'token_type_ids'] (input_ids required). Serve other graphs with task 'tensor'"),
    (text_graph("last_hidden_state", (None, None, 384), inputs=("attention_mask",)),
     "model 'minilm': the graph takes inputs ['attention_mask']; task 'embedding' fills"),
    (text_graph("pooler_output", (None, 384)),
     "model 'minilm': the graph has no output 'last_hidden_state' (outputs: ['pooler_output'])"),
    (text_graph("last_hidden_state", (None, 384)),
     "model 'minilm': graph output 'last_hidden_state' has shape [None, 384], expected 3 dims with a static last one"),
    (text_graph("last_hidden_state", (None, None, None)),
     "model 'minilm': graph output 'last_hidden_state' has shape [None, None, None], expected 3 dims"),
    (text_graph("last_hidden_state", (None, None, 768)),
     "model 'minilm': output EMBEDDING has dims [384] but the graph produces width 768"),
], ids=["foreign_input", "no_input_ids", "no_output", "rank", "dynamic_width", "width"])
def test_the_graph_must_fit_the_task(graph, message):
    task = task_of(model_config("minilm"))
    with pytest.raises(ConfigError) as info:
        task.bind(graph)
    assert str(info.value).startswith(message)


def test_the_task_feeds_only_what_the_graph_takes():
    task = task_of(model_config("minilm"))
    assert sorted(task.synthetic_feeds(2, 5)) == ["attention_mask", "input_ids", "token_type_ids"]
    task.bind(text_graph("last_hidden_state", (None, None, 384), inputs=("input_ids", "attention_mask")))
    prepared = task.prepare(["a b", "c"])
    assert sorted(task.assemble(prepared, np.array([0, 1]), 4)) == ["attention_mask", "input_ids"]
    feeds = task.synthetic_feeds(3, 7)
    assert sorted(feeds) == ["attention_mask", "input_ids"]
    assert feeds["input_ids"].shape == (3, 7) and feeds["attention_mask"].all()
    # A runtime that cannot describe its graph (BLS) is fed all three.
    blind = task_of(model_config("minilm"))
    blind.bind(None)
    assert sorted(blind.assemble(prepared, np.array([0]), 4)) == ["attention_mask", "input_ids", "token_type_ids"]


def test_an_output_of_the_wrong_shape_is_a_runtime_failure_naming_it(embedding):
    prepared = embedding.prepare(["a", "b c"])
    batch = Pass(prepared, np.array([0, 1]), 4, embedding.assemble(prepared, np.array([0, 1]), 4))
    with pytest.raises(RuntimeFailure) as info:
        embedding.split(batch, {"last_hidden_state": np.zeros((2, 3, 384), dtype=np.float32)})
    assert str(info.value) == "'last_hidden_state' came back with shape [2, 3, 384], expected [2, 4, 384]"


def test_fingerprint_covers_the_tokenizer_and_the_output_settings():
    base = task_of(model_config("minilm")).fingerprint()
    assert base["task"] == "embedding" and len(base["tokenizer_sha256"]) == 64
    assert base["max_sequence_length"] == 256 and (base["pooling"], base["normalize"]) == ("mean", True)
    assert task_of(model_config("minilm", pooling="cls")).fingerprint()["pooling"] == "cls"
    rerank = task_of(model_config("minilm_cross_encoder"), "minilm_cross_encoder").fingerprint()
    assert rerank["task"] == "classify" and rerank["activation"] == "sigmoid"


def test_a_graph_reports_what_auto_completion_adds():
    from coalesce.tasks.embedding.task import EmbeddingTask

    graph = text_graph("last_hidden_state", (None, None, 312))
    inputs, outputs = EmbeddingTask.complete({"name": "tiny"}, graph)
    assert [(t.name, t.data_type, t.dims) for t in inputs] == [("TEXT", "TYPE_STRING", (1,))]
    assert [(t.name, t.data_type, t.dims) for t in outputs] == [("EMBEDDING", "TYPE_FP32", (312,))]
    declared = model_config("minilm")
    assert EmbeddingTask.complete(declared, graph) == ([], [])
    with pytest.raises(ConfigError, match="the graph takes inputs \\['image'\\]; task 'embedding' fills"):
        EmbeddingTask.complete({"name": "tiny"}, GraphIO(inputs=(GraphTensor("image", "TYPE_FP32", (None, 8)),),
                                                         outputs=()))
