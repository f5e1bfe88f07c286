"""The causal LM's speed levers: packed ``Linear`` weights, the head-major KV cache, decode groups, unpadded steps."""

from __future__ import annotations

import numpy as np
import pytest

from coalesce.core.errors import ConfigError

torch = pytest.importorskip("torch")


def _linear(bias: bool) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(96, 40, bias=bias)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_fp16_linear_matches_float32_to_fp16_rounding(bias):
    from coalesce.generation.model import PackedLinear

    linear = _linear(bias)
    x = torch.randn(1, 5, 96)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear, "fp16")(x), linear(x), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_int8_linear_stays_close_to_float32(bias):
    from coalesce.generation.model import PackedLinear

    linear = _linear(bias)
    x = torch.randn(3, 96)
    with torch.inference_mode():
        got, want = PackedLinear(linear, "int8")(x), linear(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.99


def test_pack_linears_replaces_every_linear_the_head_included():
    from coalesce.generation.model import PackedLinear, pack_linears

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(8, 4)))
    assert pack_linears(model, "int8") == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert model(torch.randn(2, 8)).shape == (2, 4)


def _prefill(lm, ids: list[int]):
    from coalesce.generation.model import KVCache, StepInput

    cache = KVCache(lm.shapes, 64, dtype=lm.dtype, device=torch.device("cpu"))
    slots = np.arange(len(ids))
    step = StepInput(ids=ids, positions=list(range(len(ids))), slots=slots.tolist(), decode_slots=[],
                     prefills=[(0, len(ids), slots, 0)], logits_rows=list(range(len(ids))))
    return lm.forward(step, cache), cache


@pytest.mark.parametrize("weights", ["int8", "fp16"])
def test_causal_lm_with_packed_weights_keeps_the_float32_logits_close(llama_dir, weights):
    from coalesce.generation.model import CausalLM, PackedLinear

    cpu = torch.device("cpu")
    plain = CausalLM(llama_dir / "hf", device=cpu, dtype=torch.float32)
    packed = CausalLM(llama_dir / "hf", device=cpu, dtype=torch.float32, weights=weights)
    assert isinstance(packed.model.lm_head, PackedLinear)
    ids = [5, 17, 300, 42, 9, 77]
    want, _ = _prefill(plain, ids)
    got, _ = _prefill(packed, ids)
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cosine.min() > (0.999 if weights == "fp16" else 0.98)


@pytest.mark.parametrize("weights, dtype", [("int4", torch.float32), ("int8", torch.bfloat16)])
def test_unfit_weight_formats_are_config_errors(llama_dir, weights, dtype):
    from coalesce.generation.model import CausalLM

    with pytest.raises(ConfigError, match=weights):
        CausalLM(llama_dir / "hf", device=torch.device("cpu"), dtype=dtype, weights=weights)


def test_cache_is_head_major_and_decoding_with_or_without_padding_gives_the_same_logits(llama_dir):
    from coalesce.generation.model import CausalLM, StepInput

    lm = CausalLM(llama_dir / "hf", device=torch.device("cpu"), dtype=torch.float32)
    ids = [5, 17, 300, 42]
    _, cache = _prefill(lm, ids)
    key, _ = cache.layer(0)
    shape = lm.shapes[0]
    assert key.shape == (shape.heads, 64, shape.key_dim)
    # The same sequence twice: once unpadded (no mask), once beside a longer neighbour (padded, masked).
    # The neighbour shares the prompt's slots but writes its own new slot (11), so the cache row
    # the first sequence reads is the same in both steps.
    own = np.arange(len(ids) + 1)
    alone = StepInput(ids=[8], positions=[len(ids)], slots=[len(ids)], decode_slots=[own], prefills=[],
                      logits_rows=[0])
    want = lm.forward(alone, cache)
    longer = np.array([*range(len(ids)), 10, 11])
    padded = StepInput(ids=[8, 8], positions=[len(ids), len(ids) + 1], slots=[len(ids), 11],
                       decode_slots=[own, longer], prefills=[], logits_rows=[0])
    torch.testing.assert_close(lm.forward(padded, cache), want)


def test_decode_groups_is_the_cheapest_split_into_ranges():
    import itertools

    from coalesce.generation.model import decode_groups

    def cost(ranges, widths, overhead):
        return sum((end - start) * max(widths[start:end]) + overhead for start, end in ranges)

    rng = np.random.default_rng(0)
    for _ in range(50):
        widths = sorted(rng.integers(1, 400, rng.integers(1, 8)).tolist(), reverse=True)
        overhead = float(rng.choice([0, 64, 512, 4096]))
        got = decode_groups(widths, overhead)
        assert got[0][0] == 0 and got[-1][1] == len(widths)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(got))
        # Every split is a choice of cut points between rows: the brute force over all of them.
        best = min(cost(list(zip((0, *c), (*c, len(widths)), strict=True)), widths, overhead)
                   for k in range(len(widths)) for c in itertools.combinations(range(1, len(widths)), k))
        assert cost(got, widths, overhead) == best
    assert decode_groups([300, 290, 20, 18], 512) == [(0, 2), (2, 4)]
    assert decode_groups([300, 290, 280], 512) == [(0, 3)]
    assert decode_groups([300, 20], float("inf")) == [(0, 2)]


def test_grouped_decoding_gives_the_logits_of_one_padded_group(llama_dir):
    from coalesce.generation.model import CausalLM, StepInput

    lm = CausalLM(llama_dir / "hf", device=torch.device("cpu"), dtype=torch.float32)
    ids = list(range(5, 45))
    _, cache = _prefill(lm, ids)
    # Three sequences over the same prompt slots, decoding at very different lengths.
    lengths = [40, 38, 3]
    step = StepInput(ids=[8, 9, 10], positions=lengths, slots=[50, 51, 52],
                     decode_slots=[np.array([*range(n), 50 + i]) for i, n in enumerate(lengths)], prefills=[],
                     logits_rows=[0, 1, 2])
    lm.group_overhead_pairs = 0  # no overhead: every sequence its own group
    grouped = lm.forward(step, cache)
    lm.group_overhead_pairs = float("inf")
    torch.testing.assert_close(grouped, lm.forward(step, cache))
