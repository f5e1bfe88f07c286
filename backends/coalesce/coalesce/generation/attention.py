"""Attention over the paged KV cache, plugged into ``transformers`` models through their attention interface.

A step's tokens (one per decoding sequence, a chunk of prompt per prefilling one) are
packed into one row and run through the model's own modules; only attention differs:
registered under ``ATTENTION_NAME`` and handed the step's layout as a keyword argument,
it writes each layer's new keys and values to the sequences' cache slots, then lets each
query attend to its own sequence's cached keys (decoding queries together, padded and
masked; prompt chunks one by one, causally). Any ``transformers`` model whose attention
calls the attention interface (Llama, Mistral, Qwen, GPT-2, ... in transformers 5) runs
unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

import torch
import torch.nn.functional as F

#: Name of the attention implementation (``attn_implementation``) and of the keyword argument carrying the layout.
ATTENTION_NAME: Final = "coalesce_paged"
STEP_KWARG: Final = "coalesce_step"
#: Keyword arguments that change attention in ways this implementation does not do.
UNSUPPORTED_KWARGS: Final = ("softcap", "s_aux", "sinks")


@dataclasses.dataclass
class PrefillPart:
    """One sequence's prompt chunk in a step: packed positions ``start:end``, attending to ``slots`` (its cache)."""

    start: int
    end: int
    slots: torch.Tensor
    mask: torch.Tensor | None


@dataclasses.dataclass
class DecodeGroup:
    """Decoding queries ``start:end`` (of the step's first ``decode_count``), padded alike.

    ``slots`` (``[queries, width]``) are each query's cache slots, padded on the right;
    ``mask`` says which are real (None: none is padded).
    """

    start: int
    end: int
    slots: torch.Tensor
    mask: torch.Tensor | None


@dataclasses.dataclass
class StepLayout:
    """Where one step's packed tokens go in the cache and what each attends to.

    The first ``decode_count`` packed tokens are decoding sequences' (one each), split into
    ``decode_groups`` of alike context length so that a short context is not padded to the
    longest; the rest are prompt chunks. ``cache`` is None for the load-time probe, which
    only records shapes.
    """

    slots: torch.Tensor
    decode_count: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillPart]
    cache: Any = None
    probe: dict[int, tuple[int, int, int, torch.dtype]] | None = None


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention interface's signature: ``query`` ``[1, heads, tokens, dim]``, keys and values likewise.

    Returns the output as ``[1, tokens, heads, dim]``, as the interface's other implementations do.
    """
    step: StepLayout | None = kwargs.get(STEP_KWARG)
    if step is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' runs only inside the generation engine's steps")
    layer = getattr(module, "layer_idx", None)
    if step.probe is not None:
        unsupported = [name for name in UNSUPPORTED_KWARGS if kwargs.get(name) is not None]
        if unsupported or layer is None:
            raise RuntimeError(f"this model's attention needs {unsupported or 'a layer index'}, which the paged "
                               "attention of the generate task does not provide")
        step.probe[int(layer)] = (key.shape[1], key.shape[3], value.shape[3], key.dtype)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2), None
    key_cache, value_cache = step.cache.layer(int(layer))  # type: ignore[arg-type]
    key_cache.index_copy_(1, step.slots, key[0].to(key_cache.dtype))
    value_cache.index_copy_(1, step.slots, value[0].to(value_cache.dtype))
    if len(step.decode_groups) == 1 and not step.prefills:
        # One group of decoding sequences only (the steady state): its output is the whole output, no copy.
        return _decode(query, key_cache, value_cache, step.decode_groups[0], scaling).permute(2, 0, 1, 3), None
    out = torch.empty_like(query)
    for group in step.decode_groups:
        out[0, :, group.start:group.end] = _decode(query, key_cache, value_cache, group,
                                                   scaling).squeeze(2).transpose(0, 1)
    for part in step.prefills:
        q = query[:, :, part.start:part.end]
        k = key_cache.index_select(1, part.slots).unsqueeze(0).to(query.dtype)
        v = value_cache.index_select(1, part.slots).unsqueeze(0).to(query.dtype)
        out[:, :, part.start:part.end] = F.scaled_dot_product_attention(
            q, k, v, attn_mask=part.mask, is_causal=part.mask is None, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2), None


def _decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, group: DecodeGroup,
            scaling: float | None) -> torch.Tensor:
    """One group's decoding queries over their sequences' cache: ``[sequences, heads, 1, dim]``."""
    q = query[0, :, group.start:group.end].transpose(0, 1).unsqueeze(2)  # [sequences, heads, 1, dim]
    k = _gather(key_cache, group.slots).to(query.dtype)  # [sequences, kv heads, ctx, dim]
    v = _gather(value_cache, group.slots).to(query.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scaling, enable_gqa=True)


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache`` (``[heads, slots, dim]``) at ``slots`` (``[sequences, context]``): ``[sequences, heads, ctx, dim]``.

    ``index_select`` on the flattened slots, not advanced indexing: several times faster on the CPU.
    """
    return cache.index_select(1, slots.reshape(-1)).view(cache.shape[0], *slots.shape, cache.shape[2]).transpose(0, 1)


def no_mask(*args: Any, **kwargs: Any) -> None:
    """The model builds no attention mask: the layout says what each query attends to."""
    return None


def register() -> None:
    """Make ``ATTENTION_NAME`` an attention implementation ``transformers`` models can be loaded with."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, no_mask)
