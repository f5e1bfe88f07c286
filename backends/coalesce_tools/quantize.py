"""Making the INT8 graph of an embedding model: ``model.int8.onnx`` beside ``model.onnx`` (``coalesce export --int8``).

ONNX Runtime's 8-bit ``MatMulNBits`` (``onnxruntime.quantization.matmul_nbits_quantizer``):
each constant-weight MatMul gets INT8 weights with one scale per block of ``block_size``
inputs, and with accuracy level 4 its CPU kernel quantises the activations per row and
block too, and multiplies in INT8. Dynamic quantisation (``quantize_dynamic``) is faster
still but takes one activation scale per pass, so a short text next to a long one loses
its precision: on MiniLM it failed the guard (perf/results/int8-*.md). Larger blocks run
faster and drift further, so the block sizes are tried largest first, and the first graph
that passes the accuracy guard the backend runs at load (the same built-in text set and
thresholds, ``coalesce.runtimes.quantized``) is kept. How it was made and the guard's
numbers go to ``model.int8.onnx.json``, which also keeps the graph from being rebuilt while
the FP32 graph and the thresholds are unchanged.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

from coalesce.cache.keys import file_digest
from coalesce.settings import INT8_TASKS, ModelSettings

#: Bump when the quantisation changes, so stale INT8 graphs are rebuilt.
QUANTIZE_FORMAT: Final = 2
#: The record of how the INT8 graph was made, beside it.
RECORD_SUFFIX: Final = ".json"


#: Block sizes tried, fastest first.
BLOCK_SIZES: Final = (256, 128, 64, 32)
#: ``MatMulNBits`` accuracy level 4: INT8 activations, per block, and INT8 multiplication (the fast CPU kernels).
ACCURACY_LEVEL: Final = 4


def quantize_blocks(fp32_path: Path, out_path: Path, block_size: int) -> None:
    """Write ``fp32_path`` with every constant-weight MatMul as an 8-bit ``MatMulNBits`` of ``block_size``."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(str(fp32_path)), bits=8, block_size=block_size, is_symmetric=True,
                                     accuracy_level=ACCURACY_LEVEL)
    quantizer.process()
    quantizer.model.save_model_to_file(str(out_path), use_external_data_format=False)


def quantize_int8(version_dir: Path, config: Mapping[str, Any], *, force: bool = False,
                  log: Callable[[str], None] = print) -> bool:
    """Write the version's INT8 graph unless a current one is there; True if it was written.

    ``config`` is the model's config (JSON form): its task and text settings decide the
    vectors the guard compares, its thresholds (``int8_min_mean_cosine``, ``int8_min_cosine``)
    what passes.

    Raises:
        SystemExit: If no quantised graph passes the guard, even with every candidate kept in FP32.
    """
    from coalesce.core.errors import ConfigError
    from coalesce.runtimes.onnx import OnnxRuntime
    from coalesce.runtimes.quantized import agreement
    from coalesce.tasks import create_task

    parameters = {**(config.get("parameters") or {}), "precision": {"string_value": "fp32"}}
    settings = ModelSettings.from_model_config({**config, "parameters": parameters})
    options = settings.runtime
    if settings.task.task not in INT8_TASKS:
        raise SystemExit(f"coalesce export --int8: model '{settings.model_name}' has task '{settings.task.task}'; "
                         f"INT8 is for tasks {' and '.join(INT8_TASKS)}")
    fp32_path = version_dir / options.onnx_file
    int8_path = version_dir / options.int8_onnx_file
    record_path = int8_path.with_name(int8_path.name + RECORD_SUFFIX)
    wanted = {"format": QUANTIZE_FORMAT, "fp32_sha256": file_digest(fp32_path),
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
    with tempfile.TemporaryDirectory(dir=version_dir) as scratch:
        tmp = Path(scratch) / "model.int8.onnx"
        for block_size in BLOCK_SIZES:
            quantize_blocks(fp32_path, tmp, block_size)
            found = agreement(task, reference.run, OnnxRuntime(tmp).run)
            log(f"coalesce export --int8: {version_dir}: 8-bit blocks of {block_size}: {found.describe()}")
            if found.passes(options.int8_min_mean_cosine, options.int8_min_cosine):
                tmp.replace(int8_path)
                record = {**wanted, "quantization": f"MatMulNBits, 8 bits, symmetric, block {block_size}, "
                                                    f"accuracy level {ACCURACY_LEVEL}",
                          "guard_mean_cosine": round(found.mean_cosine, 5),
                          "guard_min_cosine": round(found.min_cosine, 5),
                          "guard_texts": found.texts, "seconds": round(time.perf_counter() - start, 1)}
                record_path.write_text(json.dumps(record, indent=2) + "\n")
                return True
    raise SystemExit(f"coalesce export --int8: {version_dir}: no INT8 graph reached mean cosine >= "
                     f"{options.int8_min_mean_cosine} and minimum >= {options.int8_min_cosine} against the FP32 "
                     f"graph at any block size ({', '.join(map(str, BLOCK_SIZES))}); serve it with precision fp32")
