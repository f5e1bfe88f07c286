"""``coalesce build-engine``: the model's ONNX graph as a TensorRT plan, with profiles from its config.

Writes ``model.plan`` into the model's version folder and ``model.plan.json`` beside it
(profiles, precision, TensorRT version, the ONNX graph's digest), which the TensorRT
runtime reads to match passes to profiles and to refuse a plan built by another
TensorRT. Options: FP16, a timing cache (reused across builds: minutes become seconds),
the length buckets (a model of fixed shape gets one profile). ``--print-profiles`` shows the profiles without TensorRT.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path
from typing import Any

from coalesce.cache.keys import file_digest
from coalesce.core.tensors import GraphIO
from coalesce.runtimes.onnx import read_graph_io
from coalesce.runtimes.profiles import DEFAULT_LENGTH_BUCKETS, Profile, derive_profiles
from coalesce.runtimes.tensorrt import engine_metadata_path
from coalesce.settings import ModelSettings
from coalesce.tasks import TASK_TYPES
from coalesce_tools.config import read_model_config


def read_config_limits(config: dict[str, Any]) -> dict[str, Any]:
    """``max_batch_size``, preferred batch sizes, the row limit of a pass and the longest row, from a config.

    Rows are the graph's: where a task's row feeds the graph several sequences (``similarity``:
    two texts), the batch sizes and the pass limit are multiplied by that many.
    """
    settings = ModelSettings.from_model_config(config)
    has_length = settings.task.task != "tensor" or any(
        -1 in [int(d) for d in t.get("dims", [])] for t in config.get("input", []))
    task = TASK_TYPES.get(settings.task.task)
    per_row = task.graph_rows_per_row if task is not None else 1
    return {"max_batch_size": settings.max_batch_size * per_row,
            "preferred_batch_sizes": [int(v) * per_row for v in (config.get("dynamic_batching") or {})
                                      .get("preferred_batch_size", [])],
            "max_batch_rows": settings.planner.max_batch_rows * per_row,
            "max_sequence_length": settings.task.max_sequence_length if has_length else 1}


def profiles_for(model_dir: Path, length_buckets: tuple[int, ...] = DEFAULT_LENGTH_BUCKETS) -> list[Profile]:
    """The profiles of the model in ``model_dir`` (its ``config.pbtxt``): rows up to the pass limit."""
    limits = read_config_limits(read_model_config(model_dir / "config.pbtxt"))
    max_rows = min(limits["max_batch_rows"], max(limits["max_batch_size"], 1) * 1_000_000)
    return derive_profiles(max_rows=max_rows, max_length=limits["max_sequence_length"],
                           preferred_rows=limits["preferred_batch_sizes"], length_buckets=length_buckets)


def input_shapes(graph: GraphIO, profile: Profile) -> dict[str, tuple[tuple[int, ...], ...]]:
    """(min, opt, max) shape of every graph input under ``profile``: rows on dim 0, its length on every dynamic dim."""
    shapes = {}
    for tensor in graph.inputs:
        per_row = tensor.shape[1:]
        shapes[tensor.name] = tuple(
            (rows, *(length if d is None else d for d in per_row)) for rows, length in profile.shapes())
    return shapes


def build(onnx_path: Path, plan_path: Path, profiles: list[Profile], *, fp16: bool,
          timing_cache: Path | None = None, workspace_bytes: int = 4 << 30) -> dict[str, object]:
    """Build and write the plan and its metadata; return the metadata.

    Raises:
        SystemExit: If TensorRT is missing or cannot parse or build the graph.
    """
    try:
        import tensorrt as trt
    except ImportError:
        raise SystemExit("coalesce build-engine: the 'tensorrt' module is not installed "
                         "(pip install 'coalesce[gpu]', or run inside the Triton container)") from None
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_path.read_bytes(), str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise SystemExit(f"coalesce build-engine: TensorRT cannot parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    cache_bytes = timing_cache.read_bytes() if timing_cache is not None and timing_cache.is_file() else b""
    cache = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(cache, ignore_mismatch=False)
    graph = read_graph_io(onnx_path)
    for profile in profiles:
        trt_profile = builder.create_optimization_profile()
        for name, shapes in input_shapes(graph, profile).items():
            trt_profile.set_shape(name, *shapes)
        config.add_optimization_profile(trt_profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise SystemExit("coalesce build-engine: TensorRT could not build the engine (see its log above)")
    plan_path.write_bytes(bytes(serialized))
    if timing_cache is not None:
        timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
    metadata: dict[str, object] = {
        "tensorrt_version": str(trt.__version__), "precision": "fp16" if fp16 else "fp32",
        "profiles": [dataclasses.asdict(p) for p in profiles], "onnx_sha256": file_digest(onnx_path),
        "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    engine_metadata_path(plan_path).write_text(json.dumps(metadata, indent=2) + "\n")
    return metadata


def main(argv: list[str] | None = None) -> int:
    """Command line of ``coalesce build-engine``."""
    parser = argparse.ArgumentParser(prog="coalesce build-engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--version", default="1")
    parser.add_argument("--fp16", action="store_true", help="allow FP16 kernels (recommended on tensor-core GPUs)")
    parser.add_argument("--timing-cache", type=Path, default=None, help="read and update this timing cache")
    parser.add_argument("--length-buckets", default=",".join(map(str, DEFAULT_LENGTH_BUCKETS)),
                        help="upper token lengths of the profiles below the model's max sequence length")
    parser.add_argument("--print-profiles", action="store_true", help="print the profiles and exit (no TensorRT)")
    args = parser.parse_args(argv)
    model_dir = args.model_repository / args.model
    if not (model_dir / "config.pbtxt").is_file():
        parser.error(f"no model config at {model_dir / 'config.pbtxt'}")
    buckets = tuple(int(v) for v in args.length_buckets.split(",") if v)
    profiles = profiles_for(model_dir, buckets)
    if args.print_profiles:
        sys.stdout.write(json.dumps([dataclasses.asdict(p) for p in profiles], indent=2) + "\n")
        return 0
    version_dir = model_dir / args.version
    onnx_path = version_dir / "model.onnx"
    if not onnx_path.is_file():
        parser.error(f"no ONNX graph at {onnx_path}: run `make setup` (or `coalesce export --out {version_dir}`)")
    metadata = build(onnx_path, version_dir / "model.plan", profiles, fp16=args.fp16, timing_cache=args.timing_cache)
    sys.stderr.write(f"coalesce build-engine: wrote {version_dir / 'model.plan'} "
                     f"(TensorRT {metadata['tensorrt_version']}, {metadata['precision']}, {len(profiles)} profiles)\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
