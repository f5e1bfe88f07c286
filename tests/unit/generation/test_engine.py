"""The continuous-batching engine against transformers' own ``generate``, on seeded Llama and GPT-2 models."""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import numpy as np
import pytest

from coalesce.core.errors import CoalesceError
from coalesce.generation.engine import GenerationEngine
from coalesce.generation.events import GenerationEvent
from tests.unit.generation.conftest import make_engine

torch = pytest.importorskip("torch")

WORDS = ["def", "class", "return", "import", "self", "value", "name", "data", "for", "while", "if", "else", "with",
         "try", "except"]


class Collect:
    """A request's sink: every event, in order."""

    def __init__(self) -> None:
        self.events: list[GenerationEvent] = []

    def __call__(self, event: GenerationEvent) -> None:
        self.events.append(event)

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    @property
    def final(self) -> GenerationEvent | None:
        return self.events[-1] if self.events and self.events[-1].final else None


def submit(engine: GenerationEngine, prompt: str, **sampling) -> Collect:
    parameters = {"temperature": 0, **sampling}
    stream = parameters.pop("stream", False)
    tensors = {"text_input": np.array([prompt.encode()], dtype=object), "stream": np.array([stream])}
    sink = Collect()
    try:
        engine.submit(tensors, parameters, sink)
    except CoalesceError as exc:  # what the Triton adapter does with a refusal: the request's only response
        sink(GenerationEvent(final=True, error=exc))
    return sink


def run(engine: GenerationEngine, limit: int = 10_000) -> int:
    steps = 0
    while engine.step():
        steps += 1
        assert steps < limit
    return steps


def reference(version, prompt: str, max_tokens: int, tokenizer) -> str:
    """transformers' ``generate``, greedy, on the request alone: the text after the prompt."""
    from transformers import AutoModelForCausalLM

    model = _reference_models.setdefault(str(version), AutoModelForCausalLM.from_pretrained(str(version / "hf")))
    ids = tokenizer.encode(prompt).ids
    with torch.no_grad():
        out = model.eval().generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=max_tokens, do_sample=False)
    return tokenizer.decode(out[0, len(ids):].tolist())


_reference_models: dict = {}


def prompts(count: int, seed: int = 0) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 80))), rng.randint(1, 40)) for _ in range(count)]


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_greedy_batched_output_equals_generate_alone_token_for_token(architecture, request):
    version = request.getfixturevalue(f"{architecture}_dir")
    engine, _ = make_engine(version)
    cases = prompts(16)
    sinks = [submit(engine, prompt, max_tokens=max_tokens) for prompt, max_tokens in cases]
    steps = run(engine)
    assert steps < sum(m for _, m in cases), "sequences ran together, not one after another"
    for (prompt, max_tokens), sink in zip(cases, sinks, strict=True):
        assert sink.final is not None and sink.final.error is None
        assert sink.text == prompt + reference(version, prompt, max_tokens, engine.tokenizer)


def test_chunked_prefill_keeps_decodes_flowing_and_changes_no_token(llama_dir):
    engine, _ = make_engine(llama_dir, max_prefill_tokens="7")
    short = submit(engine, "def f", max_tokens=30, stream=True)
    engine.step()
    engine.step()
    long_prompt = " ".join(WORDS * 4)
    long = submit(engine, long_prompt, max_tokens=5)
    before = len(short.events)
    for _ in range(5):
        engine.step()
    assert len(short.events) >= before + 4, "the running sequence got a token while the long prompt was prefilled"
    run(engine)
    assert long.text == long_prompt + reference(llama_dir, long_prompt, 5, engine.tokenizer)
    assert short.text == reference(llama_dir, "def f", 30, engine.tokenizer)


def test_a_shared_prefix_is_computed_once_and_gives_the_same_tokens(llama_dir):
    engine, metrics = make_engine(llama_dir, kv_block_tokens="8")
    system = "You are a helpful assistant. " * 6
    first = submit(engine, system + "def a")
    run(engine)
    assert metrics.value("coalesce_generate_prefix_cache_hit_tokens_total", model="lm", version="1") == 0
    second = submit(engine, system + "class b", max_tokens=12)
    run(engine)
    hits = metrics.value("coalesce_generate_prefix_cache_hit_tokens_total", model="lm", version="1")
    assert hits >= 8 * (len(engine.tokenizer.encode(system).ids) // 8 - 1)
    for prompt, sink, max_tokens in ((system + "def a", first, 16), (system + "class b", second, 12)):
        assert sink.text == prompt + reference(llama_dir, prompt, max_tokens, engine.tokenizer)


def test_seeded_sampling_gives_the_same_text_alone_and_batched(llama_dir):
    alone_engine, _ = make_engine(llama_dir)
    alone = submit(alone_engine, "import os", temperature=1.0, top_k=50, top_p=0.9, seed=42, max_tokens=20)
    run(alone_engine)
    engine, _ = make_engine(llama_dir)
    others = [submit(engine, p, temperature=1.0, max_tokens=m) for p, m in prompts(6, seed=3)]
    batched = submit(engine, "import os", temperature=1.0, top_k=50, top_p=0.9, seed=42, max_tokens=20)
    other_seed = submit(engine, "import os", temperature=1.0, top_k=50, top_p=0.9, seed=43, max_tokens=20)
    run(engine)
    assert all(s.final and s.final.error is None for s in others)
    assert batched.text == alone.text
    assert other_seed.text != alone.text


def test_finish_reasons_and_streamed_pieces(llama_dir):
    engine, metrics = make_engine(llama_dir)
    whole = submit(engine, "def main", max_tokens=12)
    streamed = submit(engine, "def main", max_tokens=12, stream=True)
    run(engine)
    assert whole.final.finish_reason == "length" and whole.final.generated_tokens == 12
    assert len(whole.events) == 1, "without stream one response carries everything"
    assert len(streamed.events) > 1 and "def main" + streamed.text == whole.text
    generated = whole.text[len("def main"):]
    stop = generated[len(generated) // 2:][:3]
    stopped = submit(engine, "def main", max_tokens=12, stop=[stop])
    run(engine)
    assert stopped.final.finish_reason == "stop"
    assert stopped.text == "def main" + generated[:generated.find(stop)]
    assert metrics.value("coalesce_generate_finished_total", model="lm", version="1", reason="stop") == 1


def test_end_of_sequence_ends_a_request_unless_ignored(llama_dir):
    engine, _ = make_engine(llama_dir)
    eos = next(iter(engine.model.eos_token_ids))
    lm_head = engine.model.model.get_output_embeddings()
    saved = lm_head.weight.data.clone()
    try:
        with torch.no_grad():
            lm_head.weight[eos] = 0
            lm_head.weight[eos, 0] = 1e4  # the model now always prefers end of sequence
        ended = submit(engine, "def f", max_tokens=10)
        ignored = submit(engine, "def f", max_tokens=10, ignore_eos=True)
        run(engine)
    finally:
        lm_head.weight.data.copy_(saved)
    assert ended.final.finish_reason == "stop" and ended.final.generated_tokens == 1 and ended.text == "def f"
    assert ignored.final.finish_reason == "length" and ignored.final.generated_tokens == 10


def test_a_full_kv_cache_makes_requests_wait_then_refuses_them(llama_dir):
    per_block = 2 * 2 * (2 * 16) * 4 * 16  # 2 layers x 2 KV heads x (key + value dims) x fp32 x 16 tokens
    engine, metrics = make_engine(llama_dir, kv_cache_bytes=str(per_block * 4), max_queue_wait_ms="600000")
    assert engine.pool.num_blocks == 4 and engine.context_length == 64
    first = submit(engine, "def a", max_tokens=40)   # 3 blocks
    second = submit(engine, "def b", max_tokens=40)  # waits
    engine.step()
    assert engine.pool.usage().used == 3 and not second.events
    run(engine)
    assert first.final.error is None and second.final.error is None, "the second joined once the first ended"
    engine.options = dataclasses.replace(engine.options, max_queue_wait_ms=50.0)
    blocker = submit(engine, "def a", max_tokens=40)
    refused = submit(engine, "def c", max_tokens=40)
    engine.step()
    time.sleep(0.06)
    engine.step()
    assert refused.final is not None and refused.final.error.code == "UNAVAILABLE"
    assert "KV cache" in str(refused.final.error)
    assert metrics.value("coalesce_generate_refusals_total", model="lm", version="1", reason="kv_full") == 1
    run(engine)
    assert blocker.final.error is None


def test_too_many_waiting_and_too_long_prompts_are_refused(llama_dir):
    engine, _ = make_engine(llama_dir, max_waiting_sequences="2", max_sequence_length="40")
    sinks = [submit(engine, "def a", max_tokens=3) for _ in range(3)]
    assert sinks[2].final is not None and sinks[2].final.error.code == "UNAVAILABLE"
    long = submit(engine, " ".join(WORDS * 5), max_tokens=3)
    assert long.final.error.code == "INVALID_ARG" and "text_input" in str(long.final.error)
    run(engine)
    assert all(s.final.error is None for s in sinks[:2])


def test_a_cancelled_request_leaves_within_a_few_steps_when_asked_every_step(llama_dir):
    engine, metrics = make_engine(llama_dir, cancel_check_interval_ms="0")
    cancelled = threading.Event()
    sink = Collect()
    tensors = {"text_input": np.array([b"def a"], dtype=object)}
    engine.submit(tensors, {"max_tokens": 100, "temperature": 0}, sink, is_cancelled=cancelled.is_set)
    neighbour = submit(engine, "def b", max_tokens=20)
    engine.step()
    held = engine.pool.usage().used
    cancelled.set()
    # The ask runs beside the step, which never waits for it: it is collected at the end of the
    # step when done by then (an Event answers at once), else at the next step's start; a busy
    # machine may delay the asking thread by a step or so, never by the 99 tokens left.
    for _ in range(10):
        engine.step()
        time.sleep(0.005)
        if sink.final is not None:
            break
    assert sink.final is not None and sink.final.error.code == "CANCELLED"
    assert engine.pool.usage().used < held
    run(engine)
    assert neighbour.final.error is None
    assert metrics.value("coalesce_generate_cancelled_total", model="lm", version="1") == 1


@pytest.mark.parametrize("interval_ms, most_asks", [("0", 6), ("60000", 1)])
def test_cancellation_is_asked_at_most_every_cancel_check_interval(llama_dir, interval_ms, most_asks):
    engine, _ = make_engine(llama_dir, cancel_check_interval_ms=interval_ms)
    asks = []
    tensors = {"text_input": np.array([b"def a"], dtype=object)}
    sink = Collect()
    engine.submit(tensors, {"max_tokens": 20, "temperature": 0}, sink, is_cancelled=lambda: asks.append(1) or False)
    for _ in range(6):
        engine.step()
        time.sleep(0.01)  # let each ask finish, so that only the interval holds the next one back
    assert 1 <= len(asks) <= most_asks and (interval_ms != "0" or len(asks) >= 3)
    run(engine)
    assert sink.final.error is None


def test_request_batching_admits_only_into_an_empty_batch(llama_dir):
    engine, _ = make_engine(llama_dir, generation_batching="request")
    first = submit(engine, "def a", max_tokens=10)
    engine.step()
    late = submit(engine, "def b", max_tokens=2)
    for _ in range(5):
        engine.step()
    assert not late.events, "a static batch takes no newcomer"
    run(engine)
    assert first.final.error is None and late.final.error is None


def test_the_step_thread_answers_concurrent_submitters_and_close_drains(llama_dir):
    from coalesce.generation.loader import load_engine
    from coalesce.settings import ModelSettings
    from tests.unit.generation.conftest import generate_config

    config = generate_config()
    engine = load_engine(config, llama_dir, settings=ModelSettings.from_model_config(config))
    sinks: list[Collect] = []
    threads = [threading.Thread(target=lambda: sinks.append(submit(engine, "def x", max_tokens=8)))
               for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    engine.close(drain_s=30)
    assert len(sinks) == 8 and all(s.final is not None and s.final.error is None for s in sinks)
    assert len({s.text for s in sinks}) == 1
    late = submit(engine, "def y")
    assert late.final.error.code == "UNAVAILABLE"


def test_a_failed_step_fails_its_sequences_and_the_engine_carries_on(llama_dir, monkeypatch):
    from coalesce.generation.loader import load_engine
    from coalesce.settings import ModelSettings
    from tests.unit.generation.conftest import generate_config

    config = generate_config()
    engine = load_engine(config, llama_dir, settings=ModelSettings.from_model_config(config), start=True)
    original = engine.model.forward
    calls = {"n": 0}

    def flaky(step, cache):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device lost")
        return original(step, cache)

    monkeypatch.setattr(engine.model, "forward", flaky)
    failed = submit(engine, "def a", max_tokens=4)
    deadline = time.monotonic() + 30
    while failed.final is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert failed.final.error.code == "INTERNAL" and "device lost" in str(failed.final.error)
    ok = submit(engine, "def b", max_tokens=4)
    while ok.final is None and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.close()
    assert ok.final.error is None
    assert engine.pool.usage().used == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_on_cuda_the_engine_matches_generate_there(llama_dir, precision):
    from transformers import AutoModelForCausalLM

    from coalesce.generation.loader import load_engine
    from coalesce.settings import ModelSettings
    from tests.unit.generation.conftest import generate_config

    config = generate_config(precision=precision)
    engine = load_engine(config, llama_dir, settings=ModelSettings.from_model_config(config), instance_kind="GPU",
                         start=False)
    assert engine.model.device.type == "cuda"
    assert engine.model.dtype == (torch.float16 if precision == "fp16" else torch.float32)
    cases = prompts(8, seed=5)
    sinks = [submit(engine, prompt, max_tokens=max_tokens) for prompt, max_tokens in cases]
    run(engine)
    model = AutoModelForCausalLM.from_pretrained(str(llama_dir / "hf"), dtype=engine.model.dtype).to("cuda").eval()
    equal = 0
    for (prompt, max_tokens), sink in zip(cases, sinks, strict=True):
        ids = engine.tokenizer.encode(prompt).ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=max_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"))
        equal += sink.text == prompt + engine.tokenizer.decode(out[0, len(ids):].tolist())
    # fp32 must match token for token; fp16 rounding may flip a near-tie on a few.
    assert equal == len(cases) if precision == "fp32" else equal >= len(cases) - 2
