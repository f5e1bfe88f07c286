"""Sampling controls, additional outputs and priority in the continuous batch, against transformers alone.

Penalties batched with neighbours must give the tokens transformers' ``generate`` gives
the request alone with the same penalties (its own ``repetition_penalty``, and a logits
processor with vLLM's presence and frequency formula); the additional outputs must
follow the vLLM backend's contract; priority orders admission when the batch is full.
"""

from __future__ import annotations

import itertools
import json
import math
import re

import numpy as np
import pytest

from coalesce.core.errors import InvalidInputError
from coalesce.generation.contract import read_request, response_outputs
from tests.unit.generation.conftest import make_engine
from tests.unit.generation.test_engine import WORDS, prompts, run, submit

torch = pytest.importorskip("torch")


class _OutputPenalties:
    """vLLM's presence and frequency penalties over the output tokens, as a transformers logits processor."""

    def __init__(self, prompt_length: int, presence: float, frequency: float) -> None:
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        output = input_ids[:, self.prompt_length:]
        counts.scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


_models: dict = {}


def reference(version, prompt: str, max_tokens: int, tokenizer, **penalties) -> str:
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    model = _models.setdefault(str(version), AutoModelForCausalLM.from_pretrained(str(version / "hf")).eval())
    ids = tokenizer.encode(prompt).ids
    processors = LogitsProcessorList()
    if penalties.get("presence_penalty") or penalties.get("frequency_penalty"):
        processors.append(_OutputPenalties(len(ids), penalties.get("presence_penalty", 0.0),
                                           penalties.get("frequency_penalty", 0.0)))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_tokens, do_sample=False, logits_processor=processors,
                             repetition_penalty=penalties.get("repetition_penalty", 1.0))
    return tokenizer.decode(out[0, len(ids):].tolist())


@pytest.mark.parametrize("penalties", [
    {"repetition_penalty": 1.5}, {"presence_penalty": 1.2, "frequency_penalty": 0.7},
    {"repetition_penalty": 0.8, "frequency_penalty": -0.5},
])
def test_penalised_greedy_batched_equals_transformers_alone(llama_dir, penalties):
    engine, _ = make_engine(llama_dir)
    cases = prompts(8, seed=11)
    sinks = [submit(engine, prompt, max_tokens=max_tokens, **(penalties if i % 2 == 0 else {}))
             for i, (prompt, max_tokens) in enumerate(cases)]
    run(engine)
    for i, ((prompt, max_tokens), sink) in enumerate(zip(cases, sinks, strict=True)):
        own = penalties if i % 2 == 0 else {}
        assert sink.final is not None and sink.final.error is None
        assert sink.text == prompt + reference(llama_dir, prompt, max_tokens, engine.tokenizer, **own), own
    changed = [sinks[i].text != cases[i][0] + reference(llama_dir, *cases[i], engine.tokenizer)
               for i in range(0, len(cases), 2)]
    assert any(changed), "the penalty changed some greedy text"


def test_seeded_sampling_with_penalties_is_the_same_alone_and_batched(llama_dir):
    params = {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 5, "repetition_penalty": 1.3,
              "presence_penalty": 0.5, "max_tokens": 16}
    alone_engine, _ = make_engine(llama_dir)
    alone = submit(alone_engine, "import os", **params)
    run(alone_engine)
    engine, _ = make_engine(llama_dir)
    others = [submit(engine, p, temperature=1.0, max_tokens=m) for p, m in prompts(5, seed=2)]
    batched = submit(engine, "import os", **params)
    run(engine)
    assert batched.text == alone.text and all(o.final.error is None for o in others)


def test_stop_token_ids_end_the_sequence_and_min_tokens_holds_them_off(llama_dir):
    engine, _ = make_engine(llama_dir)
    free = submit(engine, "def f", max_tokens=8, logprobs=0, return_logprobs=True)
    run(engine)
    first = int(next(iter(free.final.logprobs[0])))
    stopped = submit(engine, "def f", max_tokens=8, stop_token_ids=[first], stream=True,
                     return_finish_reason=True)
    held = submit(engine, "def f", max_tokens=8, stop_token_ids=f"[{first}]", min_tokens="3")
    run(engine)
    assert stopped.final.finish_reason == "stop" and stopped.final.generated_tokens == 1
    assert stopped.text == "", "the stop token is not part of the text"
    assert held.final.generated_tokens >= 3 and held.final.error is None


def test_additional_outputs_follow_the_vllm_contract(llama_dir):
    engine, _ = make_engine(llama_dir)
    flags = {name: np.array([True]) for name in ("return_finish_reason", "return_cumulative_logprob",
                                                  "return_logprobs", "return_num_input_tokens",
                                                  "return_num_output_tokens")}
    events = []
    tensors = {"text_input": np.array([b"def main"], dtype=object), "stream": np.array([True]), **flags}
    request = engine.submit(tensors, {"temperature": "0", "max_tokens": "12", "logprobs": "2",
                                      "ignore_eos": "true"}, events.append)
    run(engine)
    assert [e.final for e in events][-1] and all(e.error is None for e in events)
    outputs = [response_outputs(request, e, batched=False) for e in events]
    reasons = [o["finish_reason"][0].decode() for o in outputs]
    assert reasons[:-1] == ["None"] * (len(events) - 1) and reasons[-1] == "length"
    counts = [int(o["num_output_tokens"][0]) for o in outputs]
    prompt_tokens = len(engine.tokenizer.encode("def main").ids)
    assert sum(counts) == 12 and all(int(o["num_input_tokens"][0]) == prompt_tokens for o in outputs)
    cumulative = [float(o["cumulative_logprob"][0]) for o in outputs]
    assert all(b < a for a, b in itertools.pairwise(cumulative)), cumulative
    texts = []
    for output, count in zip(outputs, counts, strict=True):
        entries = json.loads(output["logprobs"][0])
        assert len(entries) == count
        for entry in entries:
            assert 1 <= len(entry) <= 3
            ranks = sorted(v["rank"] for v in entry.values())
            assert ranks[0] == 1, "greedy: the sampled token is the most likely"
            texts.append(next(v["decoded_token"] for v in entry.values() if v["rank"] == 1))
    assert "".join(texts) == "".join(e.text for e in events), "rank-1 tokens spell the text"
    total = sum(max(v["logprob"] for v in entry.values())
                for o in outputs for entry in json.loads(o["logprobs"][0]))
    assert math.isclose(total, cumulative[-1], rel_tol=1e-4)
    whole = engine.submit({"text_input": np.array([b"def main"], dtype=object), "return_logprobs": np.array([True])},
                          {"temperature": 0, "max_tokens": 3}, events.append)
    run(engine)
    assert json.loads(response_outputs(whole, events[-1], batched=True)["logprobs"][0, 0]) is None, \
        "logprobs not set: null, as vLLM"


def test_an_output_the_config_does_not_declare_cannot_be_asked_for():
    from coalesce.settings import GenerateOptions

    tensors = {"text_input": np.array([b"hi"], dtype=object), "return_logprobs": np.array([True])}
    with pytest.raises(InvalidInputError, match="declares no output 'logprobs'"):
        read_request(tensors, None, GenerateOptions(), declared_outputs=frozenset({"finish_reason"}))


def test_priority_orders_admission_when_the_batch_is_full_fifo_within_a_level(llama_dir):
    engine, _ = make_engine(llama_dir, max_active_sequences="1")
    running = submit(engine, "def a", max_tokens=4)
    engine.step()
    order: list[str] = []
    sinks = {}
    for name, level in (("low", 3), ("default", 0), ("mid-1", 2), ("high", 1), ("mid-2", 2)):
        sink = submit(engine, "def " + name, max_tokens=2, priority_level=level)
        sinks[name] = sink
    while engine.step():
        for name, sink in sinks.items():
            if sink.final is not None and name not in order:
                order.append(name)
    assert running.final.error is None
    # 0 is the default level, 1: the highest; lower levels first, first come first served within one.
    assert order == ["default", "high", "mid-1", "mid-2", "low"]


def test_bad_values_of_the_new_controls_name_the_field(llama_dir):
    engine, _ = make_engine(llama_dir)
    for parameters, field in (({"min_tokens": 20, "max_tokens": 4}, "min_tokens"),
                              ({"stop_token_ids": ["a"]}, "stop_token_ids"),
                              ({"repetition_penalty": 0}, "repetition_penalty"),
                              ({"presence_penalty": 3}, "presence_penalty"), ({"logprobs": 21}, "logprobs"),
                              ({"priority_level": -1}, "priority_level")):
        with pytest.raises(InvalidInputError, match=f"'{field}'"):
            engine.submit({"text_input": np.array([" ".join(WORDS).encode()], dtype=object)}, parameters,
                          lambda event: None)


def test_constrained_sequences_in_the_batch_follow_their_guides_alone_and_batched(llama_dir):
    """Guides mixed with free neighbours: every output fits its guide, and equals the same request alone.

    The test model's tokenizer is a real one (tinylm's), its weights random: without the mask
    its text is never JSON, with it every text parses and validates.
    """
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    schema = {"type": "object", "additionalProperties": False, "required": ["id", "ok"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}}}
    guides = [{"guided_json": schema}, {"guided_json": json.dumps(schema)}, {"guided_regex": "[a-c]{2,4}!"},
              {"guided_choice": ["red", "green", "blue"]}]
    params = [dict(max_tokens=24, **guide) for guide in guides]
    params.append({"max_tokens": 12, "temperature": 0.7, "seed": 3, "guided_regex": "[0-9]+-[0-9]+"})
    alone = []
    for p in params:
        engine, _ = make_engine(llama_dir)
        alone.append(submit(engine, "Answer:", **p))
        run(engine)
    engine, _ = make_engine(llama_dir)
    free = [submit(engine, prompt, max_tokens=max_tokens) for prompt, max_tokens in prompts(4, seed=7)]
    batched = [submit(engine, "Answer:", **p) for p in params]
    run(engine)
    assert all(sink.final.error is None for sink in (*free, *batched, *alone))
    texts = [sink.text.removeprefix("Answer:") for sink in batched]
    assert [sink.text for sink in batched] == [sink.text for sink in alone]
    jsonschema.validate(json.loads(texts[0]), schema)
    jsonschema.validate(json.loads(texts[1]), schema)
    assert re.fullmatch("[a-c]{2,4}!", texts[2]) and texts[3] in ("red", "green", "blue"), texts
    assert re.fullmatch("[0-9]+-[0-9]+", texts[4]) or batched[4].final.finish_reason == "length", texts


@pytest.mark.parametrize("guide, reason", [({"guided_json": {"type": "nonsense"}}, "guided_json"),
                                            ({"guided_regex": "(["}, "guided_regex"),
                                            ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "one of")])
def test_a_bad_guide_is_refused_naming_it(llama_dir, guide, reason):
    engine, _ = make_engine(llama_dir)
    sink = submit(engine, "x", max_tokens=4, **guide)
    assert isinstance(sink.final.error, InvalidInputError) and reason in str(sink.final.error), sink.final.error


def test_a_step_runs_on_every_core_while_no_neighbour_computes(llama_dir, tmp_path):
    """The core board decides each step's torch threads: all cores alone, ``own_threads`` beside a busy neighbour."""
    from coalesce.runtimes.cores import CoreBoard

    engine, _ = make_engine(llama_dir)
    board = CoreBoard(own_threads=1, cores=2, path=tmp_path / "board")
    neighbour = CoreBoard(own_threads=1, cores=2, path=tmp_path / "board")
    engine.board = board
    threads = torch.get_num_threads()
    try:
        sink = submit(engine, "def f", max_tokens=2)
        engine.step()
        assert torch.get_num_threads() == 2 and engine.wide_steps == 1
        with neighbour.computing():
            engine.step()
            assert torch.get_num_threads() == 1 and engine.wide_steps == 1
        run(engine)
        assert sink.final.error is None
    finally:
        torch.set_num_threads(threads)
        neighbour.close()
        board.close()
