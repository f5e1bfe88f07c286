"""precision int8: the quantised graph, its accuracy guard at load, its cache key, and how export makes it."""

import json

import numpy as np
import pytest

from coalesce import loader
from coalesce.cache.keys import file_digest
from coalesce.core.errors import ConfigError
from coalesce.loader import load_pipeline, read_settings
from coalesce.observability.log import Logger
from coalesce.runtimes.guard_texts import GUARD_TEXTS
from coalesce.runtimes.onnx import OnnxRuntime
from coalesce.runtimes.quantized import agreement, cpu_name, int8_pays
from coalesce.settings import ModelSettings, SettingsError
from coalesce_tools import quantize
from coalesce_tools.quantize import quantize_int8
from tests.conftest import built, model_config
from tests.unit.fakes import answers, texts

FIXED_COST = "0.001,0.000001,0"


class Lines(Logger):
    def __init__(self):
        super().__init__("test")
        self.lines = []

    def info(self, message):
        self.lines.append(message)


def link(folder, *names):
    for name in names:
        (folder / name).symlink_to(built("minilm") / name)
    return folder


@pytest.fixture(scope="module")
def default_dynamic(tmp_path_factory):
    """A version folder whose INT8 graph is ONNX Runtime's default dynamic quantisation (per tensor, every op)."""
    from onnxruntime.quantization import quantize_dynamic

    folder = link(tmp_path_factory.mktemp("dynamic"), "model.onnx", "tokenizer.json")
    quantize_dynamic(str(folder / "model.onnx"), str(folder / "model.int8.onnx"))
    return folder


def test_int8_is_for_embedding_and_similarity_on_onnx_runtime():
    with pytest.raises(SettingsError, match=r"'precision' has bad value 'int8'.*task 'classify'"):
        ModelSettings.from_model_config(model_config("minilm_cross_encoder", precision="int8"))
    assert ModelSettings.from_model_config(model_config("minilm_rerank", precision="int8")).runtime.precision == "int8"
    assert ModelSettings.from_model_config(model_config("minilm_cross_encoder", precision="auto")).runtime.precision \
        == "auto"  # auto is for any task: it serves FP32 where INT8 does not apply
    with pytest.raises(SettingsError, match=r"'precision' has bad value 'int8'.*runtime 'torch'"):
        ModelSettings.from_model_config(model_config("minilm", precision="int8", runtime="torch"))
    with pytest.raises(SettingsError, match=r"'int8_onnx_file'.*relative"):
        ModelSettings.from_model_config(model_config("minilm", int8_onnx_file="/tmp/model.int8.onnx"))
    with pytest.raises(SettingsError, match="int8_min_cosine"):
        ModelSettings.from_model_config(model_config("minilm", int8_min_cosine="1.5"))


def test_the_shipped_int8_graph_passes_its_guard_and_serves_close_to_fp32():
    """precision int8 forced: the shipped auto serves the INT8 graph only where it pays on this CPU."""
    logger = Lines()
    int8 = load_pipeline(model_config("minilm", cost_model=FIXED_COST, precision="int8"), built("minilm"),
                         logger=logger)
    assert int8.runtime.path == built("minilm") / "model.int8.onnx"
    (guard,) = [line for line in logger.lines if "INT8 accuracy guard passed" in line]
    assert f"over {len(GUARD_TEXTS)} texts" in guard and "needs mean >= 0.99, minimum >= 0.98" in guard
    fp32 = load_pipeline(model_config("minilm", cost_model=FIXED_COST, precision="fp32"), built("minilm"))
    assert fp32.runtime.path == built("minilm") / "model.onnx"
    request = {"TEXT": texts("the quick brown fox", "a longer sentence about coalescing requests into passes")}
    (got,), (want,) = answers(int8, request), answers(fp32, request)
    assert ((got["EMBEDDING"] * want["EMBEDDING"]).sum(axis=1) >= 0.98).all()
    assert np.abs(got["EMBEDDING"] - want["EMBEDDING"]).max() > 0  # really the other graph


def test_a_graph_that_fails_the_guard_is_refused_with_its_numbers(default_dynamic):
    config = model_config("minilm", cost_model=FIXED_COST, precision="int8")
    with pytest.raises(ConfigError) as failure:
        load_pipeline(config, default_dynamic)
    message = str(failure.value)
    assert "model 'minilm': the INT8 graph model.int8.onnx is too far from the FP32 graph model.onnx" in message
    assert f"over {len(GUARD_TEXTS)} texts" in message
    assert "needs mean >= 0.99, minimum >= 0.98 (settings int8_min_mean_cosine, int8_min_cosine)" in message
    mean = float(message.split("mean cosine ")[1].split(",")[0])
    least = float(message.split("minimum ")[1].split(" ")[0])
    assert least < 0.98 and least <= mean < 1
    # The thresholds are the model's to set: below what the graph reaches, it loads.
    lenient = model_config("minilm", cost_model=FIXED_COST, precision="int8", int8_min_mean_cosine=f"{mean - 0.01:.4f}",
                           int8_min_cosine=f"{least - 0.01:.4f}")
    assert load_pipeline(lenient, default_dynamic).runtime.path == default_dynamic / "model.int8.onnx"


def test_a_missing_int8_graph_says_how_to_make_it(tmp_path):
    link(tmp_path, "model.onnx", "tokenizer.json")
    with pytest.raises(ConfigError, match=r"precision int8 needs the quantised graph .*model.int8.onnx; make it with "
                                          r"`coalesce export --int8`"):
        load_pipeline(model_config("minilm", cost_model=FIXED_COST, precision="int8"), tmp_path)


def test_precision_and_the_graph_run_are_in_the_cache_key():
    config = model_config("minilm", cost_model=FIXED_COST, cache_bytes="4096", precision="int8")
    int8 = load_pipeline(config, built("minilm"))
    fp32_config = model_config("minilm", cost_model=FIXED_COST, cache_bytes="4096", precision="fp32")
    fp32 = load_pipeline(fp32_config, built("minilm"))
    assert int8.fingerprint != fp32.fingerprint
    fields = loader.runtime_fingerprint(read_settings(config), int8.runtime, built("minilm"))
    assert fields == {"runtime": "onnxruntime", "precision": "int8",
                      "onnx_sha256": file_digest(built("minilm") / "model.int8.onnx")}


def test_agreement_takes_the_worst_of_batched_and_alone():
    pipeline = load_pipeline(model_config("minilm", cost_model=FIXED_COST, precision="fp32"), built("minilm"))
    same = agreement(pipeline.task, pipeline.runtime.run, pipeline.runtime.run, GUARD_TEXTS[:20])
    assert same.texts == 20 and same.min_cosine > 0.99999 and same.passes(0.99, 0.98)
    int8 = OnnxRuntime(built("minilm") / "model.int8.onnx")
    drift = agreement(pipeline.task, pipeline.runtime.run, int8.run, GUARD_TEXTS[:20])
    assert drift.min_cosine < same.min_cosine and not drift.passes(0.99, 0.99999)
    assert drift.worst_text in GUARD_TEXTS[:20]


def test_export_makes_the_int8_graph_once_and_refuses_what_cannot_pass(tmp_path, monkeypatch):
    (tmp_path / "1").mkdir()
    version = link(tmp_path / "1", "model.onnx", "tokenizer.json")
    config = model_config("minilm")
    lines = []
    assert quantize_int8(version, config, log=lines.append)
    record = json.loads((version / "model.int8.onnx.json").read_text())
    assert record["guard_min_cosine"] >= 0.98 and record["guard_mean_cosine"] >= 0.99
    assert record["fp32_sha256"] == file_digest(version / "model.onnx")
    # Both families were made and guarded here; those that passed were timed, the faster on this CPU kept.
    assert record["guard_min_cosine"] >= 0.983 and record["chosen"] in record["texts_per_s_over_fp32"]
    assert any(name.startswith("MatMulNBits block") for name in record["guard_tried"])
    assert any(name.startswith("dynamic, ") for name in record["guard_tried"])
    assert record["texts_per_s_over_fp32"][record["chosen"]] == max(record["texts_per_s_over_fp32"].values())
    assert record["cpu"] == cpu_name()
    assert ("MatMulNBits" if record["chosen"].startswith("MatMulNBits") else "MatMulInteger") in record["quantization"]
    assert lines and lines[-1].startswith(f"coalesce export --int8: {version}: kept {record['chosen']}: ")
    assert not quantize_int8(version, config, log=lines.append)  # current: not rebuilt
    load_pipeline(model_config("minilm", cost_model=FIXED_COST, precision="int8"), version)  # passes the load's guard
    strict = model_config("minilm", int8_min_cosine="0.99999", precision="int8")
    monkeypatch.setattr(quantize, "BLOCK_SIZES", (256,))  # one candidate of each family: none can pass
    monkeypatch.setattr(quantize, "FP32_FRACTIONS", (0.0,))
    with pytest.raises(SystemExit, match=r"no INT8 graph reached mean cosine >= 0\.993 and minimum >= 1 \(the "
                                         r"thresholds plus 0\.003\) against the FP32 graph \(MatMulNBits at block "
                                         r"sizes 256; dynamic"):
        quantize_int8(version, strict, log=lines.append)
    # Under precision auto, no passing graph is not an error: the record says why, and FP32 serves.
    assert quantize_int8(version, {**strict, "parameters": {**strict["parameters"],
                                                             "precision": {"string_value": "auto"}}},
                         log=lines.append)
    assert not (version / "model.int8.onnx").exists()
    assert int8_pays(version / "model.int8.onnx")[0] is False
    assert "no INT8 graph passed the accuracy guard" in int8_pays(version / "model.int8.onnx")[1]
    with pytest.raises(SystemExit, match="task 'classify'; INT8 is for tasks embedding and similarity"):
        quantize_int8(version, model_config("minilm_cross_encoder"), log=lines.append)


def _record(folder, **fields):
    (folder / "model.int8.onnx").write_bytes(b"graph")
    (folder / "model.int8.onnx.json").write_text(json.dumps(fields))
    return folder / "model.int8.onnx"


def test_precision_auto_takes_int8_only_where_the_record_says_it_pays(tmp_path):
    assert int8_pays(tmp_path / "model.int8.onnx") == (
        False, "no INT8 graph measured here (model.int8.onnx.json missing; `coalesce export --int8` makes one)")
    fast = _record(tmp_path, chosen="dynamic, 6 of 36 MatMuls in FP32", cpu=cpu_name(),
                   texts_per_s_over_fp32={"dynamic, 6 of 36 MatMuls in FP32": 1.3, "MatMulNBits block 256": 0.7})
    assert int8_pays(fast) == (True, "the INT8 graph (dynamic, 6 of 36 MatMuls in FP32) ran 1.30x FP32's texts/s "
                                     "at export")
    slow = _record(tmp_path, chosen="MatMulNBits block 256", cpu="Another CPU (avx512_vnni)",
                   texts_per_s_over_fp32={"MatMulNBits block 256": 0.7})
    pays, why = int8_pays(slow)
    assert not pays and why.endswith(f"ran 0.70x FP32's texts/s at export (measured on Another CPU (avx512_vnni), "
                                     f"not this {cpu_name()})")
    (tmp_path / "model.int8.onnx.json").write_text("{not json")
    assert int8_pays(slow)[0] is False and "unreadable" in int8_pays(slow)[1]


def test_precision_auto_resolves_at_load_and_says_why(tmp_path):
    link(tmp_path, "model.onnx", "tokenizer.json")
    _record(tmp_path, chosen="x", texts_per_s_over_fp32={"x": 0.5})
    logger = Lines()
    pipeline = load_pipeline(model_config("minilm", cost_model=FIXED_COST, precision="auto"), tmp_path, logger=logger)
    assert pipeline.runtime.path == tmp_path / "model.onnx"  # slower: FP32 serves (the fake INT8 file never loads)
    assert any("precision auto: fp32: the INT8 graph (x) ran 0.50x" in line for line in logger.lines)
    fp32 = load_pipeline(model_config("minilm", cost_model=FIXED_COST, precision="fp32"), tmp_path)
    assert pipeline.fingerprint == fp32.fingerprint  # the row cache's key: what was served, not what was asked
    logger = Lines()
    settings = loader.resolve_precision(read_settings(model_config("minilm", precision="auto")), built("minilm"),
                                        logger)
    assert settings.runtime.precision == ("int8" if int8_pays(built("minilm") / "model.int8.onnx")[0] else "fp32")
    gpu = loader.resolve_precision(read_settings(model_config("minilm", precision="auto")), built("minilm"), logger,
                                   instance_kind="GPU")
    assert gpu.runtime.precision == "fp32" and "this is a GPU instance" in logger.lines[-1]
