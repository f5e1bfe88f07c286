"""Making the INT8 graph of an embedding model: ``model.int8.onnx`` beside ``model.onnx`` (``coalesce export --int8``).

Which INT8 graph is fastest depends on the CPU, and how far its vectors drift on the model,
so the graph is chosen by measurement on the machine that builds it, among two families:

- ONNX Runtime's 8-bit ``MatMulNBits`` (``matmul_nbits_quantizer``): INT8 weights with one scale
  per block of ``block_size`` inputs; at accuracy level 4 its CPU kernel quantises the
  activations per row and block too. Accurate, and fast where the CPU has AVX512-VNNI; on an
  AVX2-only CPU slower than FP32 (perf/results/int8-*.md).
- dynamic quantisation (``quantize_dynamic``, per-channel INT8 weights, ``MatMulInteger``):
  fast on AVX2 too, but one activation scale per pass, so a MatMul whose input has outlier
  channels (MiniLM's feed-forward inputs: one channel ~15x the others) loses the rest of its
  precision. The MatMuls are ranked by their inputs' outlier ratio on the guard texts, and
  the graph that passes the guard with the fewest of the worst kept in FP32 is the family's
  candidate.

Each family's candidate must pass the accuracy guard the backend runs at load (the same
built-in text set and thresholds, ``coalesce.runtimes.quantized``, with ``EXPORT_HEADROOM``
to spare); the passing ones and the
FP32 graph are then timed on one thread over the guard texts (interleaved repeats), and the
fastest INT8 graph is kept. How it was made, the guard's numbers and the speeds go to
``model.int8.onnx.json``, which also keeps the graph from being rebuilt while the FP32 graph,
the guard's texts and the thresholds are unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from coalesce.cache.keys import file_digest
from coalesce.runtimes.guard_texts import GUARD_TEXTS
from coalesce.runtimes.quantized import RECORD_SUFFIX, cpu_name
from coalesce.settings import INT8_TASKS, ModelSettings

#: Bump when the quantisation changes, so stale INT8 graphs are rebuilt.
QUANTIZE_FORMAT: Final = 4


#: ``MatMulNBits`` block sizes tried, fastest first.
BLOCK_SIZES: Final = (256, 128, 64, 32)
#: ``MatMulNBits`` accuracy level 4: INT8 activations, per block, and INT8 multiplication (the fast CPU kernels).
ACCURACY_LEVEL: Final = 4
#: Dynamic quantisation: fractions of the MatMuls kept in FP32 (worst outlier ratio first), tried in order.
FP32_FRACTIONS: Final = (0.0, 1 / 12, 1 / 6, 1 / 4, 1 / 3, 1 / 2)
#: What a candidate must clear the load's thresholds by: the guard's texts are a sample, and a text outside
#: it may drift a little further (the load itself checks the plain thresholds).
EXPORT_HEADROOM: Final = 0.003
#: Timing of the passing candidates: interleaved repeats over the guard texts, on one thread.
TIMING_REPEATS: Final = 3


def quantize_blocks(fp32_path: Path, out_path: Path, block_size: int) -> None:
    """Write ``fp32_path`` with every constant-weight MatMul as an 8-bit ``MatMulNBits`` of ``block_size``."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(str(fp32_path)), bits=8, block_size=block_size, is_symmetric=True,
                                     accuracy_level=ACCURACY_LEVEL)
    quantizer.process()
    quantizer.model.save_model_to_file(str(out_path), use_external_data_format=False)


def quantize_dynamic_except(fp32_path: Path, out_path: Path, keep_fp32: Sequence[str]) -> None:
    """Write ``fp32_path`` with every constant-weight MatMul but ``keep_fp32`` (node names) dynamically quantised.

    Per-channel INT8 weights (signed: the fast AVX2 kernels take u8 activations and s8 weights);
    attention's activation-by-activation MatMuls stay FP32.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(fp32_path), str(out_path), weight_type=QuantType.QInt8, per_channel=True,
                     op_types_to_quantize=["MatMul"], nodes_to_exclude=list(keep_fp32),
                     extra_options={"MatMulConstBOnly": True})


def outlier_ranking(fp32_path: Path, feeds: Sequence[Mapping[str, np.ndarray]]) -> list[tuple[str, float]]:
    """Constant-weight MatMuls and their input's outlier ratio over ``feeds``, worst first.

    The ratio is the largest per-channel maximum of |input| over the median one, on the
    positions the attention mask keeps (every position where the graph has no mask).
    """
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    model = onnx.load(str(fp32_path))
    weights = {i.name: i for i in model.graph.initializer}
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights
               and len(numpy_helper.to_array(weights[n.input[1]]).shape) == 2]
    inputs = sorted({n.input[0] for n in matmuls})
    for name in inputs:
        model.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep the tensors by name
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    peak: dict[str, np.ndarray] = {}
    for feed in feeds:
        values = session.run(inputs, dict(feed))
        mask = feed.get("attention_mask")
        for name, value in zip(inputs, values, strict=True):
            kept = value[mask.astype(bool)] if mask is not None and mask.shape == value.shape[:-1] else \
                value.reshape(-1, value.shape[-1])
            channel_max = np.abs(kept).max(axis=0)
            peak[name] = channel_max if name not in peak else np.maximum(peak[name], channel_max)
    ratio = {name: float(v.max() / max(float(np.median(v)), 1e-12)) for name, v in peak.items()}
    return sorted(((n.name, ratio[n.input[0]]) for n in matmuls), key=lambda item: -item[1])


def texts_per_s(task: Any, run: Callable[..., Any], texts: Sequence[str]) -> float:
    """Texts per second of length-sorted passes of ``GUARD_PASS_ROWS`` rows over ``texts``."""
    from coalesce.runtimes.quantized import GUARD_PASS_ROWS, embed

    start = time.perf_counter()
    embed(task, run, texts, pass_rows=GUARD_PASS_ROWS)
    return len(texts) / (time.perf_counter() - start)


def guard_feeds(task: Any, texts: Sequence[str]) -> list[dict[str, np.ndarray]]:
    """The guard's batched passes over ``texts`` as graph feeds (calibration for the outlier ranking)."""
    from coalesce.runtimes.quantized import GUARD_PASS_ROWS, sorted_passes

    return [dict(batch.feeds) for batch in sorted_passes(task.guarded_task(), texts, pass_rows=GUARD_PASS_ROWS)]


def quantize_int8(version_dir: Path, config: Mapping[str, Any], *, force: bool = False,
                  log: Callable[[str], None] = print) -> bool:
    """Write the version's INT8 graph unless a current one is there; True if it was written.

    ``config`` is the model's config (JSON form): its task and text settings decide the
    vectors the guard compares, its thresholds (``int8_min_mean_cosine``, ``int8_min_cosine``)
    what passes.

    Where no graph of either family passes the guard, the record says so (precision ``auto``
    then serves FP32), unless the config asks for ``int8``.

    Raises:
        SystemExit: If no quantised graph passes the guard and the config's precision is ``int8``.
    """
    from coalesce.core.errors import ConfigError
    from coalesce.runtimes.onnx import OnnxRuntime
    from coalesce.runtimes.quantized import Agreement, agreement
    from coalesce.tasks import create_task

    required = ModelSettings.from_model_config(config).runtime.precision == "int8"
    parameters = {**(config.get("parameters") or {}), "precision": {"string_value": "fp32"}}
    settings = ModelSettings.from_model_config({**config, "parameters": parameters})
    options = settings.runtime
    if settings.task.task not in INT8_TASKS:
        raise SystemExit(f"coalesce export --int8: model '{settings.model_name}' has task '{settings.task.task}'; "
                         f"INT8 is for tasks {' and '.join(INT8_TASKS)}")
    fp32_path = version_dir / options.onnx_file
    int8_path = version_dir / options.int8_onnx_file
    record_path = int8_path.with_name(int8_path.name + RECORD_SUFFIX)
    texts_digest = hashlib.sha256("\0".join(GUARD_TEXTS).encode()).hexdigest()
    wanted = {"format": QUANTIZE_FORMAT, "fp32_sha256": file_digest(fp32_path), "guard_texts_sha256": texts_digest,
              "min_mean_cosine": options.int8_min_mean_cosine, "min_cosine": options.int8_min_cosine}
    if not force and int8_path.is_file() and record_path.is_file():
        record = json.loads(record_path.read_text())
        if {key: record.get(key) for key in wanted} == wanted:
            return False

    try:
        task = create_task(settings, config, version_dir)
        reference = OnnxRuntime(fp32_path)
        task.bind(reference.graph)
    except ConfigError as exc:
        raise SystemExit(f"coalesce export --int8: {exc}") from None
    start = time.perf_counter()
    thresholds = (min(options.int8_min_mean_cosine + EXPORT_HEADROOM, 1.0),
                  min(options.int8_min_cosine + EXPORT_HEADROOM, 1.0))
    where = f"coalesce export --int8: {version_dir}"
    with tempfile.TemporaryDirectory(dir=version_dir) as scratch:
        passing: dict[str, tuple[Path, Agreement, str]] = {}  # short name: graph, guard, how it was made
        tried: dict[str, list[float]] = {}  # short name: guard mean and minimum
        for block_size in BLOCK_SIZES:  # the largest block that passes
            path = Path(scratch) / f"blocks{block_size}.onnx"
            with _quiet():
                quantize_blocks(fp32_path, path, block_size)
            found = agreement(task, reference.run, OnnxRuntime(path).run)
            tried[f"MatMulNBits block {block_size}"] = [round(found.mean_cosine, 5), round(found.min_cosine, 5)]
            log(f"{where}: MatMulNBits, 8-bit blocks of {block_size}: {found.describe()}")
            if found.passes(*thresholds):
                passing[f"MatMulNBits block {block_size}"] = (path, found, f"MatMulNBits, 8 bits, symmetric, block "
                                                                           f"{block_size}, accuracy level "
                                                                           f"{ACCURACY_LEVEL}")
                break
        ranking = outlier_ranking(fp32_path, guard_feeds(task, GUARD_TEXTS))

        def dynamic(count: int) -> bool:
            path = Path(scratch) / f"dynamic{count}.onnx"
            with _quiet():
                quantize_dynamic_except(fp32_path, path, [name for name, _ in ranking[:count]])
            found = agreement(task, reference.run, OnnxRuntime(path).run)
            tried[f"dynamic, {count} of {len(ranking)} MatMuls in FP32"] = [round(found.mean_cosine, 5),
                                                                            round(found.min_cosine, 5)]
            log(f"{where}: dynamic INT8, {count} of {len(ranking)} MatMuls in FP32: {found.describe()}")
            if not found.passes(*thresholds):
                return False
            worst = ", ".join(f"{name} ({ratio:.1f}x)" for name, ratio in ranking[:count]) or "none"
            passing[f"dynamic, {count} of {len(ranking)} MatMuls in FP32"] = (
                path, found, f"dynamic INT8 (MatMulInteger, per-channel s8 weights, u8 activations per pass); "
                f"{count} of {len(ranking)} MatMuls kept in FP32, those whose input has the largest outlier ratio "
                f"(channel max over median): {worst}")
            return True

        failed = -1
        for count in sorted({round(fraction * len(ranking)) for fraction in FP32_FRACTIONS}):
            if dynamic(count):  # then the counts between the last that failed and this one, fewest first
                any(dynamic(fewer) for fewer in range(failed + 1, count))
                break
            failed = count
        if not passing:
            why = (f"no INT8 graph reached mean cosine >= {thresholds[0]:g} and minimum >= {thresholds[1]:g} (the "
                   f"thresholds plus {EXPORT_HEADROOM}) against the FP32 graph (MatMulNBits at block sizes "
                   f"{', '.join(map(str, BLOCK_SIZES))}; dynamic INT8 with up to half the MatMuls in FP32)")
            if required:
                raise SystemExit(f"{where}: {why}; serve it with precision fp32 (or auto)")
            int8_path.unlink(missing_ok=True)
            record_path.write_text(json.dumps({**wanted, "chosen": None, "why": why, "cpu": cpu_name(),
                                               "guard_tried": tried}, indent=2) + "\n")
            log(f"{where}: {why}; precision auto serves FP32")
            return True
        speed = _relative_speed(task, fp32_path, {name: path for name, (path, _, _) in passing.items()})
        chosen = max(passing, key=lambda name: speed[name])
        path, found, how = passing[chosen]
        path.replace(int8_path)
    log(f"{where}: kept {chosen}: {speed[chosen]:.2f}x FP32's texts/s on one thread"
        + ("" if speed[chosen] > 1 else " (slower than FP32 on this CPU: precision auto serves FP32)"))
    record = {**wanted, "quantization": how, "guard_mean_cosine": round(found.mean_cosine, 5),
              "guard_min_cosine": round(found.min_cosine, 5), "guard_texts": found.texts,
              "texts_per_s_over_fp32": {name: round(ratio, 3) for name, ratio in speed.items()}, "chosen": chosen,
              "cpu": cpu_name(), "guard_tried": tried,
              "timing": f"one thread, the {len(GUARD_TEXTS)} guard texts in sorted passes, median of "
                        f"{TIMING_REPEATS} interleaved repeats, ratio to FP32 per repeat",
              "seconds": round(time.perf_counter() - start, 1)}
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    return True


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """ONNX Runtime's quantisers log every node at INFO (and configure the root logger): keep set-up's output short."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def _relative_speed(task: Any, fp32_path: Path, candidates: Mapping[str, Path]) -> dict[str, float]:
    """Each candidate's texts/s over the FP32 graph's on one thread: the median of same-repeat ratios."""
    from coalesce.runtimes.onnx import OnnxRuntime

    runs = {name: OnnxRuntime(path, intra_op_threads=1, thread_spinning=False).run
            for name, path in {"fp32": fp32_path, **candidates}.items()}
    guarded = task.guarded_task()
    for run in runs.values():  # sessions warm, allocations made
        texts_per_s(guarded, run, GUARD_TEXTS[:32])
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(TIMING_REPEATS):
        for name, run in runs.items():
            rates[name].append(texts_per_s(guarded, run, GUARD_TEXTS))
    return {name: statistics.median(a / b for a, b in zip(rates[name], rates["fp32"], strict=True))
            for name in candidates}
