"""Long texts are cut by bytes before tokenising: the tokenizer's work is bounded, the results unchanged."""

import numpy as np
import pytest

from coalesce.core.errors import InvalidInputError
from coalesce.tasks.text.reading import cut_utf8, read_texts
from tests.unit.fakes import EncoderRuntime, answers, classify_pipeline, embedding_pipeline, texts

#: minilm: max_sequence_length 256 x text_bytes_per_token 64.
CUT = 256 * 64


@pytest.mark.parametrize(("data", "limit", "expected"), [
    (b"abcdef", 10, b"abcdef"),
    (b"abcdef", 3, b"abc"),
    ("aé".encode(), 2, b"a"),           # é is 2 bytes: never half of it
    ("a€".encode(), 3, b"a"),           # € is 3 bytes
    ("a€b".encode(), 4, "a€".encode()),
    ("😀😀".encode(), 7, "😀".encode()),  # 4 bytes each
    ("é".encode(), 1, b""),
])
def test_cut_utf8_ends_at_a_character_boundary(data, limit, expected):
    assert cut_utf8(data, limit) == expected
    cut_utf8(data, limit).decode("utf-8")  # always decodes


def test_read_texts_cuts_only_what_is_longer_and_never_decodes_the_tail():
    tail_not_utf8 = b"x" * 8 + b"\xff\xfe"
    got = read_texts(texts("short", tail_not_utf8, "é" * 10), "TEXT", max_bytes=1 << 20, cut_bytes=8)
    assert got == ["short", "x" * 8, "é" * 4]
    assert read_texts(texts("é" * 10), "TEXT", max_bytes=1 << 20) == ["é" * 10]  # 0: never cut
    with pytest.raises(InvalidInputError, match="row 0 is 11 bytes, over the model's limit of 10 "
                                                r"\(parameter 'max_text_bytes'\)"):
        read_texts(texts("x" * 11), "TEXT", max_bytes=10, cut_bytes=5)  # refused by its full size


def test_str_items_are_cut_too():
    array = np.empty((1, 1), dtype=np.object_)
    array[0, 0] = "ü" * 20
    assert read_texts(array, "TEXT", max_bytes=1 << 20, cut_bytes=7) == ["ü" * 3]


def test_a_long_text_gives_the_same_embedding_as_before_and_the_tokenizer_sees_only_its_head():
    words = " ".join(f"word{i} and some more ordinary prose" for i in range(20_000))  # ~700 KB
    normal = "a normal sentence about batching"
    cut_pipeline, _ = embedding_pipeline(EncoderRuntime())
    whole_pipeline, _ = embedding_pipeline(EncoderRuntime(), text_bytes_per_token=0)
    (row,) = cut_pipeline.read({"TEXT": texts(words)})
    assert len(row.encode()) <= CUT and words.startswith(row)
    (whole,) = whole_pipeline.read({"TEXT": texts(words)})
    assert whole == words
    request = {"TEXT": texts(words, normal, "é" * 300_000)}
    cut, = answers(cut_pipeline, request)
    full, = answers(whole_pipeline, request)
    np.testing.assert_array_equal(cut["EMBEDDING"], full["EMBEDDING"])


def test_text_pairs_are_cut_each_and_a_query_with_a_long_document_scores_as_before():
    pipeline, _ = classify_pipeline()
    query, document = "what is dynamic batching", "document text about batching " * 5000
    (pair,) = pipeline.read({"TEXT": texts("query words " * 5000), "TEXT_PAIR": texts(document)})
    assert len(pair[0].encode()) <= CUT and len(pair[1].encode()) <= CUT
    whole, _ = classify_pipeline(text_bytes_per_token=0)
    request = {"TEXT": texts(query, "q"), "TEXT_PAIR": texts(document, "d")}
    np.testing.assert_array_equal(answers(pipeline, request)[0]["SCORES"], answers(whole, request)[0]["SCORES"])
