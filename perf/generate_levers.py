"""One decoding step of a ``generate`` model in process: where the time goes, and what the speed levers buy.

Drives ``CausalLM.forward`` by hand (no engine, no server): prefills 16 sequences of
``--context`` seeded tokens into a KV cache per variant, then times decoding steps of 1 and
16 of them (each step rewrites the same slot, so the context stays fixed) on 1 and 2 torch
threads. Variants (``--variants``): ``fp32`` (as loaded), ``int8`` and ``fp16`` (every
``Linear``, the LM head included, packed for fbgemm's dynamic kernels: ``PackedLinear``),
``bf16`` (the whole model in bfloat16). Cells are interleaved per round (variant inside
sequences inside threads), so a noisy neighbour on the cores hits every variant alike; a
cell's number is the median over rounds of the median step in the round.

``--profile`` adds a ``torch.profiler`` breakdown of one step per variant and sequence count
(matrix products, of which the LM head; attention kernels, gathers and cache writes; the
rest). ``--agreement`` decodes ``PROMPTS`` greedily (``--tokens`` each) with every variant
and with ``transformers``' own ``generate`` on the plain model, and counts identical outputs
and matching tokens against float32.

``python -m perf.generate_levers`` writes ``perf/results/generate-levers-<yyyymmdd>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = ROOT / "model_repository" / "smollm2" / "1" / "hf"
#: Cache slots each benchmark sequence owns (its context plus the decoded token fit).
SPAN = 1024
#: Fixed prompts of the agreement check: plain text, a few kinds of continuation.
PROMPTS: tuple[str, ...] = (
    "The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
    "The three primary colors are", "Water boils at a temperature of", "To make a cup of tea, first",
    "The largest planet in the solar system is", "import numpy as np\n\n# Compute the mean of",
    "A haiku about autumn:\n", "The theory of relativity was proposed by", "List of fruits: apple, banana,",
    "In machine learning, overfitting means", "The quick brown fox", "SELECT name FROM users WHERE",
    "My favourite book is", "Photosynthesis is the process by which")


def load(variant: str, model_dir: Path) -> Any:
    """The ``CausalLM`` of ``variant`` on the CPU (``+padded``: decoding sequences in one group, as before grouping)."""
    import torch

    from coalesce.generation.model import CausalLM

    base, _, tag = variant.partition("+")
    if tag not in ("", "padded"):
        raise SystemExit(f"variant {variant!r}: the only suffix is '+padded'")
    dtype = torch.bfloat16 if base == "bf16" else torch.float32
    lm = CausalLM(model_dir, device=torch.device("cpu"), dtype=dtype, name=variant,
                  weights=base if base in ("int8", "fp16") else "fp32")
    if tag == "padded":
        lm.group_overhead_pairs = float("inf")
    return lm


def contexts(sequences: int, context: int, mixed: bool) -> list[int]:
    """Each sequence's context, longest first (as the engine packs them): all ``context``, or log-uniform 16..it."""
    if not mixed:
        return [context] * sequences
    rng = np.random.default_rng(1)
    drawn = np.exp(rng.uniform(np.log(16), np.log(context), sequences)).astype(int)
    return sorted(drawn.tolist(), reverse=True)


def new_cache(lm: Any, sequences: int) -> Any:
    """A KV cache of ``sequences`` x ``SPAN`` slots in the model's dtype."""
    import torch

    from coalesce.generation.model import KVCache

    return KVCache(lm.shapes, sequences * SPAN, dtype=lm.dtype, device=torch.device("cpu"))


def prefill_step(ids: list[int], index: int) -> Any:
    """A step prefilling ``ids`` as sequence ``index`` (slots from ``index * SPAN``), logits of its last token."""
    from coalesce.generation.model import StepInput

    slots = np.arange(index * SPAN, index * SPAN + len(ids))
    return StepInput(ids=list(ids), positions=list(range(len(ids))), slots=slots.tolist(), decode_slots=[],
                     prefills=[(0, len(ids), slots, 0)], logits_rows=[len(ids) - 1])


def decode_step(tokens: list[int], lengths: list[int]) -> Any:
    """A step decoding sequences ``0..n-1``: token ``tokens[i]`` at position ``lengths[i]``."""
    from coalesce.generation.model import StepInput

    return StepInput(ids=list(tokens), positions=list(lengths),
                     slots=[i * SPAN + n for i, n in enumerate(lengths)],
                     decode_slots=[np.arange(i * SPAN, i * SPAN + n + 1) for i, n in enumerate(lengths)],
                     prefills=[], logits_rows=list(range(len(tokens))))


def time_cell(lm: Any, cache: Any, lengths: list[int], steps: int) -> float:
    """Median ms of ``steps`` decoding steps of sequences of ``lengths`` (logits, then argmax as the engine does)."""
    step = decode_step([100 + i for i in range(len(lengths))], lengths)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        lm.forward(step, cache).argmax(dim=-1).tolist()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def profile_step(lm: Any, cache: Any, lengths: list[int]) -> dict[str, float]:
    """Milliseconds per step (profiled, so inflated) by kind of work, over 5 steps."""
    from torch.profiler import ProfilerActivity, profile

    step = decode_step([100 + i for i in range(len(lengths))], lengths)
    lm.forward(step, cache)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(5):
            lm.forward(step, cache)
    vocab = str(lm.vocab_size)
    kinds = {"matmul (layers)": 0.0, "matmul (LM head)": 0.0, "attention kernel": 0.0,
             "KV gather + cache write": 0.0, "rest (norms, rotary, activations, Python)": 0.0}
    for event in prof.key_averages(group_by_input_shape=True):
        ms = event.self_cpu_time_total / 5e3
        name = event.key
        if name in ("aten::mm", "aten::addmm", "aten::bmm", "quantized::linear_dynamic",
                    "quantized::linear_dynamic_fp16", "aten::_weight_int8pack_mm"):
            # Packed weights show no shapes, so a packed head counts with the layers ("LM head alone" has it).
            head = any(vocab in str(shape) for shape in (event.input_shapes or []))
            kinds["matmul (LM head)" if head else "matmul (layers)"] += ms
        elif "scaled_dot_product" in name:
            kinds["attention kernel"] += ms
        elif name in ("aten::index_select", "aten::index_copy_"):
            kinds["KV gather + cache write"] += ms
        else:
            kinds["rest (norms, rotary, activations, Python)"] += ms
    return kinds


def head_ms(lm: Any, sequences: int, reps: int = 9) -> float:
    """Median ms of the LM head alone over ``sequences`` rows (the profiler cannot tell packed heads apart)."""
    import torch

    hidden = torch.randn(1, sequences, lm.model.config.hidden_size, dtype=lm.dtype)
    times = []
    with torch.inference_mode():
        for _ in range(reps):
            start = time.perf_counter()
            lm.model.lm_head(hidden)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def greedy(lm: Any, prompt_ids: list[int], tokens: int) -> list[int]:
    """``tokens`` greedy tokens after ``prompt_ids``, one sequence, through ``CausalLM.forward``."""
    cache = new_cache(lm, 1)
    out = [int(lm.forward(prefill_step(prompt_ids, 0), cache).argmax(dim=-1)[0])]
    while len(out) < tokens:
        logits = lm.forward(decode_step([out[-1]], [len(prompt_ids) + len(out) - 1]), cache)
        out.append(int(logits.argmax(dim=-1)[0]))
    return out


def reference(model_dir: Path, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """``transformers``' greedy ``generate`` (its default attention) on the plain float32 model."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            outs.append(out[0, len(ids):].tolist())
    return outs


def compare(outs: list[list[int]], base: list[list[int]]) -> dict[str, Any]:
    """Identical outputs, tokens matching position by position, and the mean common prefix, against ``base``."""
    same = sum(a == b for a, b in zip(outs, base, strict=True))
    matching = sum(x == y for a, b in zip(outs, base, strict=True) for x, y in zip(a, b, strict=False))
    total = sum(len(b) for b in base)
    prefixes = []
    for a, b in zip(outs, base, strict=True):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefixes.append(n)
    return {"identical": same, "prompts": len(base), "token_match": round(matching / total, 4),
            "mean_common_prefix": round(statistics.mean(prefixes), 2)}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write the results."""
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, default=SMOLLM2)
    parser.add_argument("--variants", default="fp32,int8,fp16,bf16")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--sequences", default="1,16")
    parser.add_argument("--context", type=int, default=128, help="tokens each sequence holds when it decodes")
    parser.add_argument("--mixed", action="store_true",
                        help="contexts log-uniform from 16 to --context (seeded), not all --context")
    parser.add_argument("--steps", type=int, default=6, help="decoding steps timed per cell and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--agreement", action="store_true")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None,
                        help="results stem (default perf/results/generate-levers-<date>)")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    threads = [int(t) for t in args.threads.split(",")]
    counts = [int(n) for n in args.sequences.split(",")]
    stem = args.out or ROOT / "perf" / "results" / f"generate-levers-{datetime.date.today():%Y%m%d}"

    models = {v: load(v, args.model_dir) for v in variants}
    caches = {}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, args.context).tolist() for _ in range(max(counts))]
    torch.set_num_threads(threads[0])
    for v, lm in models.items():
        caches[v] = new_cache(lm, max(counts))
        for i, ids in enumerate(prompts):
            lm.forward(prefill_step(ids, i), caches[v])
    samples: dict[tuple[str, int, int], list[float]] = {}
    for round_ in range(args.rounds):
        for t in threads:
            torch.set_num_threads(t)
            for n in counts:
                for v in variants:
                    ms = time_cell(models[v], caches[v], contexts(n, args.context, args.mixed), args.steps)
                    samples.setdefault((v, t, n), []).append(ms)
                    print(f"round {round_} threads {t} sequences {n} {v}: {ms:.1f} ms", flush=True)
    cells = [{"variant": v, "threads": t, "sequences": n, "ms_per_step": round(statistics.median(s), 1),
              "tokens_per_s": round(n * 1e3 / statistics.median(s), 1), "rounds_ms": [round(x, 1) for x in s]}
             for (v, t, n), s in samples.items()]
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "model": str(args.model_dir.relative_to(ROOT)
                                                                if args.model_dir.is_relative_to(ROOT)
                                                                else args.model_dir),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__, "context": args.context, "mixed_contexts": args.mixed, "steps": args.steps,
        "rounds": args.rounds,
        "cells": cells}
    if args.profile:
        torch.set_num_threads(1)
        result["profile_1_thread"] = {f"{v} x{n}": {**{k: round(x, 1) for k, x in
                                                        profile_step(models[v], caches[v],
                                                                     contexts(n, args.context, args.mixed)).items()},
                                                     "LM head alone": round(head_ms(models[v], n), 1)}
                                      for v in variants for n in counts}
    if args.agreement:
        torch.set_num_threads(max(threads))
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(args.model_dir / "tokenizer.json"))
        ids = [tokenizer.encode(p).ids for p in PROMPTS]
        outs = {v: [greedy(models[v], p, args.tokens) for p in ids] for v in variants}
        base = outs.get("fp32") or reference(args.model_dir, ids, args.tokens)
        agreement = {"transformers generate vs fp32 (paged)": compare(base, reference(args.model_dir, ids,
                                                                                         args.tokens))}
        agreement.update({f"{v} vs fp32": compare(outs[v], base) for v in variants if v != "fp32"})
        result["agreement"] = {"tokens": args.tokens, **agreement}
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "cells"}, indent=2))
    for c in cells:
        print(f"{c['variant']:>5} threads {c['threads']} x{c['sequences']:<3} {c['ms_per_step']:7.1f} ms/step "
              f"{c['tokens_per_s']:6.1f} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
