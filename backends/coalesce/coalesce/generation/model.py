"""A Hugging Face causal LM on torch, run one packed step at a time over a preallocated paged KV cache.

Loads any folder ``AutoModelForCausalLM`` loads from safetensors (weights, ``config.json``)
with the paged attention of ``coalesce.generation.attention``; a probe step at load learns
each layer's key and value shapes, and the KV cache is allocated once from
``kv_cache_bytes``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from coalesce.core.errors import ConfigError
from coalesce.generation.attention import ATTENTION_NAME, STEP_KWARG, PrefillPart, StepLayout, register


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """One layer's cached key/value: KV heads, key and value head sizes."""

    heads: int
    key_dim: int
    value_dim: int


class KVCache:
    """Keys and values of every layer, ``slots`` token slots each (``block_tokens`` slots per block)."""

    def __init__(self, shapes: dict[int, LayerShape], slots: int, *, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the whole pool now (zeros), so memory use is fixed from load on."""
        self.slots = slots
        self._layers = {layer: (torch.zeros(slots, s.heads, s.key_dim, dtype=dtype, device=device),
                                torch.zeros(slots, s.heads, s.value_dim, dtype=dtype, device=device))
                        for layer, s in shapes.items()}

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value tensors of layer ``index``: ``[slots, kv heads, dim]``."""
        return self._layers[index]

    @staticmethod
    def bytes_per_token(shapes: dict[int, LayerShape], dtype: torch.dtype) -> int:
        """Bytes one token's keys and values take over all layers."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(s.heads * (s.key_dim + s.value_dim) for s in shapes.values()) * size


@dataclasses.dataclass
class StepInput:
    """One step's packed tokens: ids, positions, their cache slots, what attends to what, and whose logits to return.

    ``decode_slots`` holds, per decoding sequence, its cache slots up to and including the
    new token's (padded on the right with slot 0); ``decode_lengths`` how many are real.
    """

    ids: list[int]
    positions: list[int]
    slots: list[int]
    decode_slots: list[np.ndarray]
    prefills: list[tuple[int, int, np.ndarray, int]]  # (start, end, context slots, tokens before the chunk)
    logits_rows: list[int]


class CausalLM:
    """A causal LM loaded for packed, paged steps."""

    def __init__(self, model_dir: Path, *, device: torch.device, dtype: torch.dtype, name: str = "model") -> None:
        """Load the weights and probe the layers.

        Raises:
            ConfigError: If the folder holds no loadable causal LM, or its attention does not
                go through ``transformers``' attention interface.
        """
        from transformers import AutoModelForCausalLM

        register()
        if not (model_dir / "config.json").is_file():
            raise ConfigError(f"model '{name}': no Hugging Face model folder at {model_dir} (config.json missing)")
        if not any(model_dir.glob("*.safetensors")):
            raise ConfigError(f"model '{name}': {model_dir} holds no *.safetensors weights (only safetensors are "
                              "loaded: pickled weights can run code)")
        try:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation=ATTENTION_NAME,
                                                         dtype=dtype, use_safetensors=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"model '{name}': transformers could not load a causal LM from {model_dir}: "
                              f"{exc}") from None
        self.model = model.to(device).eval()  # type: ignore[arg-type]
        self.device = device
        self.dtype = dtype
        text = model.config.get_text_config()
        limits = [getattr(text, key, None) for key in ("max_position_embeddings", "n_positions", "max_seq_len")]
        self.context_length = min((int(v) for v in limits if isinstance(v, int) and v > 0), default=1 << 20)
        window = getattr(text, "sliding_window", None)
        if isinstance(window, int) and window > 0 and getattr(text, "use_sliding_window", True) is not False:
            # Inside the window full attention is exact; beyond it the model would attend less.
            self.context_length = min(self.context_length, window)
        eos = getattr(model.generation_config, "eos_token_id", None) or getattr(text, "eos_token_id", None)
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.vocab_size = int(text.vocab_size)
        self.shapes = self._probe(name)

    def _probe(self, name: str) -> dict[int, LayerShape]:
        probe: dict[int, tuple[int, int, int, torch.dtype]] = {}
        layout = StepLayout(slots=torch.zeros(2, dtype=torch.long), decode_count=0, decode_slots=None,
                            decode_mask=None, prefills=[], probe=probe)
        try:
            with torch.inference_mode():
                self.model(input_ids=torch.tensor([[1, 2]], device=self.device),
                           position_ids=torch.tensor([[0, 1]], device=self.device), use_cache=False,
                           **{STEP_KWARG: layout})
        except RuntimeError as exc:
            raise ConfigError(f"model '{name}': {exc}") from None
        if not probe:
            raise ConfigError(f"model '{name}': its attention does not go through transformers' attention interface "
                              f"(model type '{self.model.config.model_type}'), so the generate task cannot run it")
        return {layer: LayerShape(heads, key_dim, value_dim) for layer, (heads, key_dim, value_dim, _) in probe.items()}

    def forward(self, step: StepInput, cache: KVCache) -> torch.Tensor:
        """Run one packed step; the logits of ``step.logits_rows`` (packed positions), as float32 on the CPU."""
        device = self.device

        def longs(values: list[int] | list[list[int]] | np.ndarray) -> torch.Tensor:
            return torch.as_tensor(values, dtype=torch.long).to(device)

        decode_count = len(step.decode_slots)
        decode_slots: torch.Tensor | None = None
        decode_mask: torch.Tensor | None = None
        if decode_count:
            width = max(len(s) for s in step.decode_slots)
            padded = np.zeros((decode_count, width), dtype=np.int64)
            for row, slots in enumerate(step.decode_slots):
                padded[row, :len(slots)] = slots
            decode_slots = longs(padded)
            lengths = longs([len(s) for s in step.decode_slots])
            decode_mask = (torch.arange(width, device=device)[None, :] < lengths[:, None])[:, None, None, :]
        prefills = []
        for start, end, slots, before in step.prefills:
            mask = None
            if before:
                queries = torch.arange(before, before + end - start, device=device)[:, None]
                mask = torch.arange(len(slots), device=device)[None, :] <= queries
            prefills.append(PrefillPart(start, end, longs(slots), mask))
        layout = StepLayout(slots=longs(step.slots), decode_count=decode_count, decode_slots=decode_slots,
                            decode_mask=decode_mask, prefills=prefills, cache=cache)
        with torch.inference_mode():
            out = self.model(input_ids=longs([step.ids]), position_ids=longs([step.positions]),
                             use_cache=False, logits_to_keep=longs(step.logits_rows), **{STEP_KWARG: layout})
        return out.logits[0].float().cpu()


def torch_device(instance_kind: str, device_id: int) -> torch.device:
    """The device of a Triton instance: its GPU where it is a GPU instance and CUDA is there, else the CPU."""
    if instance_kind.upper() == "GPU" and torch.cuda.is_available():
        return torch.device(f"cuda:{device_id}")
    return torch.device("cpu")


def model_dtype(precision: str, device: torch.device) -> torch.dtype:
    """fp16 where asked and on CUDA; float32 otherwise (the CPU's fp16 matmuls are slow)."""
    return torch.float16 if precision == "fp16" and device.type == "cuda" else torch.float32


