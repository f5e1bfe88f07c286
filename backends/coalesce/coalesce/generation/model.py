"""A Hugging Face causal LM on torch, run one packed step at a time over a preallocated paged KV cache.

Loads any folder ``AutoModelForCausalLM`` loads from safetensors (weights, ``config.json``)
with the paged attention of ``coalesce.generation.attention``; a probe step at load learns
each layer's key and value shapes, and the KV cache is allocated once from
``kv_cache_bytes``.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Final

import numpy as np
import torch

from coalesce.core.errors import ConfigError
from coalesce.generation.attention import ATTENTION_NAME, STEP_KWARG, DecodeGroup, PrefillPart, StepLayout, register

#: How a CPU model's ``Linear`` weights may be stored (``CausalLM(weights=...)``): ``fp32`` as loaded, ``int8``
#: per output channel with activations quantised per call, ``fp16`` converted back to float32 per call.
WEIGHT_FORMATS: Final = ("fp32", "int8", "fp16")


class PackedLinear(torch.nn.Module):
    """A bias-free or biased ``Linear`` run by fbgemm's dynamic kernels from int8 or fp16 weights.

    A decoding step reads every weight once for a handful of rows, so it is bound by memory
    traffic, not arithmetic: weights of a quarter (int8) or half (fp16) the bytes make the
    step's matrix products that much cheaper. int8 keeps one scale per output channel and
    quantises each call's activations per tensor (7-bit, as fbgemm's AVX2 kernels need),
    so outputs drift from float32; fp16 only rounds the weights.
    """

    def __init__(self, linear: torch.nn.Linear, fmt: str) -> None:
        """Pack ``linear``'s weight (and bias) in ``fmt`` (``int8`` or ``fp16``)."""
        super().__init__()
        weight = linear.weight.detach().float().contiguous()
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.fmt = fmt
        with warnings.catch_warnings():
            # The quantised tensor is only the prepack's input; fbgemm's kernels stay supported.
            warnings.simplefilter("ignore")
            if fmt == "int8":
                scales = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
                zeros = torch.zeros(len(scales), dtype=torch.long)
                quantised = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
                self._packed = torch.ops.quantized.linear_prepack(quantised, bias)
            elif fmt == "fp16":
                self._packed = torch.ops.quantized.linear_prepack_fp16(weight, bias)
            else:
                raise ValueError(f"no packed Linear for weights '{fmt}'")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias`` in float32."""
        if self.fmt == "int8":
            return torch.ops.quantized.linear_dynamic(x, self._packed, True)
        return torch.ops.quantized.linear_dynamic_fp16(x, self._packed)


def pack_linears(model: torch.nn.Module, fmt: str) -> int:
    """Replace every ``torch.nn.Linear`` of ``model`` (the LM head included) by a ``PackedLinear``; how many."""
    found = [(name, module) for name, module in model.named_modules() if type(module) is torch.nn.Linear]
    for name, module in found:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, PackedLinear(module, fmt))
    return len(found)


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """One layer's cached key/value: KV heads, key and value head sizes."""

    heads: int
    key_dim: int
    value_dim: int


class KVCache:
    """Keys and values of every layer, ``slots`` token slots each (``block_tokens`` slots per block).

    Head-major (``[kv heads, slots, dim]``): the attention's queries come as ``[heads, tokens,
    dim]``, so new keys go in and gathered ones come out without a transpose, and a
    sequence's gathered keys of one head lie together.
    """

    def __init__(self, shapes: dict[int, LayerShape], slots: int, *, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the whole pool now (zeros), so memory use is fixed from load on."""
        self.slots = slots
        self._layers = {layer: (torch.zeros(s.heads, slots, s.key_dim, dtype=dtype, device=device),
                                torch.zeros(s.heads, slots, s.value_dim, dtype=dtype, device=device))
                        for layer, s in shapes.items()}

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value tensors of layer ``index``: ``[kv heads, slots, dim]``."""
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


#: What one more group of decoding sequences costs in a step's attention, in (query, cached key) pairs: the
#: gathers and attention call each group adds per layer, weighed against the padding it saves.
GROUP_OVERHEAD_PAIRS: Final = 512


def decode_groups(widths: list[int], overhead: float = GROUP_OVERHEAD_PAIRS) -> list[tuple[int, int]]:
    """Split decoding rows (in order) into ranges ``[start, end)``, each padded to its widest, at the least cost.

    A range costs ``rows x widest`` (the padded pairs it gathers and attends over) plus
    ``overhead``; one exact pass over the prefixes (O(n^2), n the decoding sequences)
    finds the cheapest split. Rows in order of width (as the engine packs them) give the
    best splits; any order is correct.
    """
    count = len(widths)
    best = [0.0] + [float("inf")] * count  # best[i]: cheapest split of the first i rows
    cut = [0] * (count + 1)
    for end in range(1, count + 1):
        widest = 0
        for start in range(end - 1, -1, -1):
            widest = max(widest, widths[start])
            cost = best[start] + (end - start) * widest + overhead
            if cost < best[end]:
                best[end], cut[end] = cost, start
    ranges = []
    end = count
    while end > 0:
        ranges.append((cut[end], end))
        end = cut[end]
    return ranges[::-1]


class CausalLM:
    """A causal LM loaded for packed, paged steps.

    ``group_overhead_pairs`` weighs splitting a step's decoding sequences into groups of
    alike context length (``decode_groups``); infinite pads them all to the longest.
    """

    group_overhead_pairs: float = GROUP_OVERHEAD_PAIRS

    def __init__(self, model_dir: Path, *, device: torch.device, dtype: torch.dtype, name: str = "model",
                 weights: str = "fp32") -> None:
        """Load the weights and probe the layers.

        ``weights`` (one of ``WEIGHT_FORMATS``; not ``fp32`` only on the CPU in float32) packs
        every ``Linear`` as a ``PackedLinear``.

        Raises:
            ConfigError: If the folder holds no loadable causal LM, its attention does not go
                through ``transformers``' attention interface, or ``weights`` does not fit.
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
        if weights not in WEIGHT_FORMATS:
            raise ConfigError(f"model '{name}': no weight format '{weights}' (one of {', '.join(WEIGHT_FORMATS)})")
        if weights != "fp32":
            if device.type != "cpu" or dtype != torch.float32:
                raise ConfigError(f"model '{name}': {weights} weights run on the CPU in float32 only")
            pack_linears(self.model, weights)
        self.weights = weights
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
        layout = StepLayout(slots=torch.zeros(2, dtype=torch.long), decode_count=0, decode_groups=[], prefills=[],
                            probe=probe)
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
        groups = []
        widths = [len(s) for s in step.decode_slots]
        for start, end in decode_groups(widths, self.group_overhead_pairs) if decode_count else ():
            width = max(widths[start:end])
            padded = np.zeros((end - start, width), dtype=np.int64)
            for row, slots in enumerate(step.decode_slots[start:end]):
                padded[row, :len(slots)] = slots
            mask = None
            if any(w < width for w in widths[start:end]):  # no mask where none is padded: a cheaper kernel
                lengths = longs(widths[start:end])
                mask = (torch.arange(width, device=device)[None, :] < lengths[:, None])[:, None, None, :]
            groups.append(DecodeGroup(start, end, longs(padded), mask))
        prefills = []
        for start, end, slots, before in step.prefills:
            mask = None
            if before:
                queries = torch.arange(before, before + end - start, device=device)[:, None]
                mask = torch.arange(len(slots), device=device)[None, :] <= queries
            prefills.append(PrefillPart(start, end, longs(slots), mask))
        layout = StepLayout(slots=longs(step.slots), decode_count=decode_count, decode_groups=groups,
                            prefills=prefills, cache=cache)
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


def weight_format(precision: str, device: torch.device) -> str:
    """How the ``Linear`` weights are stored: ``fp16`` (computed in float32) where fp16 is asked on the CPU.

    A CPU decoding step reads every weight for a handful of rows, so it is bound by memory
    traffic: weights of half the bytes make it cheaper while the arithmetic stays float32.
    """
    return "fp16" if precision == "fp16" and device.type == "cpu" else "fp32"


