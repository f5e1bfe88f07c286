"""Loading a ``generate`` model: settings checked, the causal LM and tokenizer loaded, the engine started."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from coalesce.core.errors import ConfigError
from coalesce.core.task import version_file
from coalesce.generation.contract import check_contract
from coalesce.observability.log import Logger
from coalesce.observability.metrics import GenerationMetrics, InMemoryMetricFactory, MetricFactory
from coalesce.settings import ModelSettings


def load_engine(config: Mapping[str, Any], version_dir: Path, *, settings: ModelSettings, version: str = "1",
                metric_factory: MetricFactory | None = None, logger: Logger | None = None,
                instance_kind: str = "CPU", device_id: int = 0, start: bool = True) -> Any:
    """The model's generation engine, its step thread started (unless ``start`` is False).

    Raises:
        ConfigError: If the config, the weights or the tokenizer do not fit.
    """
    try:
        import torch
        import transformers  # noqa: F401 - the model is loaded through it
    except ImportError as exc:
        raise ConfigError(f"model '{settings.model_name}': task 'generate' runs on torch and transformers, which "
                          f"this Python lacks ({exc.name}): pip install 'coalesce[generate]' (or the gpu extra)"
                          ) from None
    from tokenizers import Tokenizer

    from coalesce.generation.engine import GenerationEngine
    from coalesce.generation.model import CausalLM, model_dtype, torch_device, weight_format

    name = settings.model_name
    logger = logger or Logger(name)
    declared_outputs = check_contract(name, config)
    model_dir = version_file(version_dir, settings.runtime.torch_model_dir)
    tokenizer_path = model_dir / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise ConfigError(f"model '{name}': {tokenizer_path} is missing (the model folder's tokenizer)")
    threads = settings.runtime.intra_op_threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    device = torch_device(instance_kind, device_id)
    dtype = model_dtype(settings.runtime.precision, device)
    weights = weight_format(settings.runtime.precision, device)
    model = CausalLM(model_dir, device=device, dtype=dtype, name=name, weights=weights)
    tokenizer: Any = Tokenizer.from_file(str(tokenizer_path))
    options = settings.generate
    context = min(settings.task.max_sequence_length, model.context_length)
    metrics = GenerationMetrics(metric_factory or InMemoryMetricFactory(), model=name, version=version)
    try:
        board = None
        if settings.runtime.share_idle_cores and device.type == "cpu":
            from coalesce.runtimes.cores import open_board

            board = open_board(threads, logger.warning)
        engine = GenerationEngine(model, tokenizer, options, context_length=context, metrics=metrics, logger=logger,
                                  start=start, board=board, declared_outputs=declared_outputs,
                                  max_request_bytes=settings.task.max_request_bytes,
                                  borrowed_thread_priority=settings.runtime.borrowed_thread_priority)
    except ConfigError as exc:
        raise ConfigError(f"model '{name}': {exc}") from None
    logger.info(f"generate: {model.model.config.model_type} on {device} ({str(dtype).removeprefix('torch.')}, "
                f"{weights} weights, "
                f"{threads} threads), {len(model.shapes)} layers; KV cache {engine.pool.num_blocks} blocks x "
                f"{options.kv_block_tokens} tokens ({engine.bytes_per_token} bytes a token), context "
                f"{engine.context_length} tokens; batching {options.generation_batching}, prefix cache "
                f"{'on' if options.prefix_cache else 'off'}")
    return engine
