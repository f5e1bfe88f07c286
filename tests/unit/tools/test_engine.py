"""``coalesce build-engine`` without TensorRT: the profiles it builds from each model's config, and its refusals."""

import importlib.util
import json

import pytest

from coalesce.core.tensors import GraphIO, GraphTensor
from coalesce.runtimes.profiles import Profile
from coalesce_tools.config import read_model_config
from coalesce_tools.engine import input_shapes, main, profiles_for, read_config_limits
from tests.conftest import REPOSITORY


def test_limits_from_the_shipped_configs():
    assert read_config_limits(read_model_config(REPOSITORY / "minilm" / "config.pbtxt")) == {
        "max_batch_size": 64, "preferred_batch_sizes": [16, 32, 64], "max_batch_rows": 64,
        "max_sequence_length": 256}
    # A tensor model's rows are as long as its variable dims may be; a fixed-shape one has rows of one position.
    assert read_config_limits(read_model_config(REPOSITORY / "minilm_tokens" / "config.pbtxt"))[
        "max_sequence_length"] == 512
    assert read_config_limits(read_model_config(REPOSITORY / "digits" / "config.pbtxt")) == {
        "max_batch_size": 256, "preferred_batch_sizes": [], "max_batch_rows": 64, "max_sequence_length": 1}
    # A similarity model's row is two texts: the engine takes twice its rows (a pass of 32 pairs is 64 sequences).
    assert read_config_limits(read_model_config(REPOSITORY / "minilm_rerank" / "config.pbtxt")) == {
        "max_batch_size": 128, "preferred_batch_sizes": [], "max_batch_rows": 64, "max_sequence_length": 256}


def test_profiles_follow_the_config():
    assert [(p.min_length, p.max_length, p.opt_rows) for p in profiles_for(REPOSITORY / "minilm")] == [
        (1, 32, 64), (33, 128, 64), (129, 256, 64)]
    assert [(p.min_length, p.max_length) for p in profiles_for(REPOSITORY / "digits")] == [(1, 1)]
    assert [p.max_length for p in profiles_for(REPOSITORY / "minilm", length_buckets=(64,))] == [64, 256]


def test_every_graph_input_gets_the_profiles_rows_and_length():
    graph = GraphIO(inputs=(GraphTensor("input_ids", "TYPE_INT64", (None, None)),
                            GraphTensor("pixels", "TYPE_FP32", (None, 3, None))), outputs=())
    profile = Profile(1, 16, 32, 1, 64, 128)
    assert input_shapes(graph, profile) == {"input_ids": ((1, 1), (16, 64), (32, 128)),
                                            "pixels": ((1, 3, 1), (16, 3, 64), (32, 3, 128))}


def test_build_engine_prints_profiles_without_tensorrt(capsys):
    assert main(["--model-repository", str(REPOSITORY), "--print-profiles"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [p["max_length"] for p in printed] == [32, 128, 256]
    assert main(["--model-repository", str(REPOSITORY), "--model", "digits", "--print-profiles"]) == 0
    assert [(p["min_length"], p["max_length"]) for p in json.loads(capsys.readouterr().out)] == [(1, 1)]


def test_build_engine_refuses_a_model_it_cannot_find(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--model-repository", str(tmp_path), "--model", "absent"])
    assert info.value.code == 2
    assert f"no model config at {tmp_path / 'absent' / 'config.pbtxt'}" in capsys.readouterr().err


def test_build_engine_without_tensorrt_says_how_to_get_it():
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed here: the build itself runs in scripts/gpu_check.sh")
    with pytest.raises(SystemExit) as info:
        main(["--model-repository", str(REPOSITORY)])
    assert str(info.value) == ("coalesce build-engine: the 'tensorrt' module is not installed "
                               "(pip install 'coalesce[gpu]', or run inside the Triton container)")
