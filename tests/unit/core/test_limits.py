"""A request's size is measured before any work, and one over ``max_request_bytes`` is refused alone."""

import numpy as np

from coalesce.core.errors import InvalidInputError
from coalesce.core.limits import check_request_bytes, request_bytes
from tests.unit.fakes import EncoderRuntime, embedding_pipeline, texts


def test_request_bytes_counts_numeric_bytes_and_the_items_of_string_tensors():
    assert request_bytes({"x": np.zeros((4, 8), dtype=np.float32)}) == 128
    assert request_bytes({"TEXT": texts("abc", b"\xc3\xa9")}) == 5  # the items, not the pointers
    assert request_bytes({"TEXT": texts("ab"), "ids": np.zeros(3, dtype=np.int64)}) == 26


def test_check_names_the_limit_the_size_and_the_parameter():
    assert check_request_bytes({"TEXT": texts("x" * 10)}, 10) is None
    assert check_request_bytes({"TEXT": texts("x" * 11)}, 0) is None  # 0: no limit
    error = check_request_bytes({"TEXT": texts("x" * 11)}, 10)
    assert isinstance(error, InvalidInputError) and error.code == "INVALID_ARG"
    assert str(error) == ("request is 11 bytes, over the model's limit of 10 bytes per request (parameter "
                          "'max_request_bytes'); send fewer or shorter rows per request")


def test_an_oversized_request_is_refused_before_reading_and_its_neighbour_is_answered():
    runtime = EncoderRuntime()
    pipeline, _ = embedding_pipeline(runtime, max_request_bytes=1000)
    # Not valid UTF-8 either: refused for its size before the task reads (decodes) a byte of it.
    big = {"TEXT": texts(b"\xff" * 600, b"y" * 600)}
    small = {"TEXT": texts("a neighbour")}
    results = pipeline.run(pipeline.read_all([big, small]))
    assert isinstance(results[0], InvalidInputError)
    assert "request is 1200 bytes, over the model's limit of 1000 bytes per request" in str(results[0])
    assert results[1]["EMBEDDING"].shape == (1, 384)
    assert runtime.rows_computed == 1
    rows, size = pipeline.read_sized(small)
    assert size == len("a neighbour") and rows == ["a neighbour"]
