"""The shipped generate model, ``smollm2`` (SmolLM2-135M-Instruct), served as shipped through a real tritonserver.

A real instruct LM: greedy decoding answers a plain completion and a chat-templated
question, and stops at the end-of-turn token its generation config names. A few tokens
each (a step of this model takes about 0.1 s on two cores).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import built
from tests.integration.test_generate import post, stream

pytest.importorskip("torch")

MODEL = "smollm2"
GREEDY = {"temperature": 0}


def test_greedy_completion_knows_the_capital_of_france(server):
    status, body = post(server, f"{MODEL}/generate", {"text_input": "The capital of France is",
                                                      "exclude_input_in_output": True,
                                                      "parameters": {"max_tokens": 4, **GREEDY}})
    assert status == 200, body
    answer = json.loads(body)["text_output"]
    assert "Paris" in answer, answer


def test_a_chat_templated_question_is_answered_and_ends_at_the_end_of_turn(server):
    """The prompt is the model's own chat template (tokenizer_config.json) applied by transformers, as a client does."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(built(MODEL) / "hf"))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    max_tokens = 24
    texts, errors = stream(server, MODEL, prompt, parameters={"max_tokens": max_tokens, **GREEDY})
    assert not errors, errors
    reply = "".join(texts)  # a stream sends the new text of each step only
    assert "Paris" in reply, reply
    # <|im_end|> (generation_config.json's eos_token_id) ended the turn before max_tokens, and is not in the text.
    assert "<|im_end|>" not in reply and len(tokenizer(reply)["input_ids"]) < max_tokens, reply
