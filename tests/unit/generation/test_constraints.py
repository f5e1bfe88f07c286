"""Structured output: guides read from sampling parameters, compiled by llguidance, masks applied in one batched op.

Generations here are driven by seeded random logits (a model that wants anything at all)
through the same steps the engine takes: fill -> apply_bitmask -> argmax -> accept, until
the matcher is finished or EOS is chosen; the text must then parse and validate.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from coalesce.core.errors import InvalidInputError, UnavailableError
from coalesce.generation import constraints
from coalesce.generation.constraints import (
    GrammarCompiler,
    Guide,
    Matcher,
    apply_bitmask,
    new_bitmask,
    read_guide,
)

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance", reason="structured output needs llguidance (the generate extra)")
tokenizers = pytest.importorskip("tokenizers")

HF = Path(__file__).resolve().parents[3] / "model_repository" / "smollm2" / "1" / "hf"
TOKENIZER = HF / "tokenizer.json"
VOCAB = 49152
EOS = 2
MAX_STEPS = 400

pytestmark = pytest.mark.skipif(not TOKENIZER.exists(),
                                reason=f"{TOKENIZER} is absent (make setup builds smollm2)")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 10},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "active": {"type": "boolean"},
        "score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    },
    "required": ["name", "age", "role", "address", "tags", "active"],
    "additionalProperties": False,
}
REGEX = r"[A-Z]{2}-[0-9]{3,4}-(alpha|beta)"
CHOICES = ["yes", "no", 'say "maybe"\n', "naïve \\ ok"]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    # The masks are small tensors: on a busy two-core machine a second OpenMP thread turns 0.2 ms into 20 ms of waiting.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer() -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(TOKENIZER))


@pytest.fixture(scope="module")
def compiler(tokenizer: tokenizers.Tokenizer) -> GrammarCompiler:
    # The model's logits width is the tokenizer's here; 7 extra columns check that ids past the vocabulary are masked.
    return GrammarCompiler(TOKENIZER, VOCAB + 7, [EOS])


def generate(matchers: list[Matcher | None], seed: int, vocab: int = VOCAB + 7) -> list[list[int]]:
    """Greedy over seeded random logits, all rows one batch, as the engine steps; None rows are unconstrained."""
    bitmask = new_bitmask(len(matchers), vocab)
    generated: list[list[int]] = [[] for _ in matchers]
    live = [row for row, m in enumerate(matchers) if m is not None]
    for step in range(MAX_STEPS):
        if not live:
            return generated
        for row in live:
            matchers[row].fill(bitmask, row)  # type: ignore[union-attr]
        logits = torch.randn(len(matchers), vocab, generator=torch.Generator().manual_seed(seed * 1000 + step))
        apply_bitmask(logits, bitmask, live)
        tokens = logits.argmax(dim=-1).tolist()
        for row in list(live):
            matcher = matchers[row]
            assert matcher is not None and matcher.accept(tokens[row]), matcher and matcher.error
            if tokens[row] == EOS or matcher.is_finished:
                live.remove(row)
            if tokens[row] != EOS:
                generated[row].append(tokens[row])
    raise AssertionError(f"rows {live} did not finish within {MAX_STEPS} steps")


def guide(**raw: object) -> Guide:
    found = read_guide(raw, "sampling_parameters")
    assert found is not None
    return found


@pytest.mark.parametrize("seed", range(4))
def test_json_output_parses_and_validates(compiler, tokenizer, seed):
    [tokens] = generate([compiler.matcher(guide(guided_json=SCHEMA))], seed)
    text = tokenizer.decode(tokens)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("seed", range(4))
def test_regex_output_full_matches(compiler, tokenizer, seed):
    [tokens] = generate([compiler.matcher(guide(guided_regex=REGEX))], seed)
    assert re.fullmatch(REGEX, tokenizer.decode(tokens))


@pytest.mark.parametrize("seed", range(4))
def test_choice_output_is_one_of_the_options(compiler, tokenizer, seed):
    [tokens] = generate([compiler.matcher(guide(guided_choice=CHOICES))], seed)
    assert tokenizer.decode(tokens) in CHOICES


def test_any_json_object_for_openai_json_object(compiler, tokenizer):
    # Unbounded strings and nesting: a random model may not close it in MAX_STEPS, so follow a text instead.
    matcher = compiler.matcher(guide(guided_json={"type": "object"}))
    bitmask = new_bitmask(1, compiler.vocab_size)
    for token in tokenizer.encode('{"a":[1,{"b":null}]}', add_special_tokens=False).ids:
        matcher.fill(bitmask, 0)
        assert bitmask[0, token // 32] >> (token % 32) & 1
        assert matcher.accept(token)
    assert matcher.is_finished, "a complete object allows only EOS"


def test_mixed_batch_masks_only_constrained_rows(compiler, tokenizer):
    matchers: list[Matcher | None] = [compiler.matcher(guide(guided_json=SCHEMA)), None,
                                      compiler.matcher(guide(guided_regex=REGEX)), None,
                                      compiler.matcher(guide(guided_choice=CHOICES))]
    out = generate(matchers, seed=7)
    jsonschema.validate(json.loads(tokenizer.decode(out[0])), SCHEMA)
    assert re.fullmatch(REGEX, tokenizer.decode(out[2]))
    assert tokenizer.decode(out[4]) in CHOICES
    logits = torch.randn(3, 40)
    before = logits.clone()
    bitmask = new_bitmask(3, 40)
    bitmask[2, 0] = 0b101  # row 2: only tokens 0 and 2 of the first word; none of the second
    bitmask[2, 1] = 0
    apply_bitmask(logits, bitmask, [2])
    assert torch.equal(logits[:2], before[:2]), "unconstrained rows are left alone"
    allowed = torch.isfinite(logits[2]).nonzero().flatten().tolist()
    assert allowed == [0, 2]


def test_apply_bitmask_matches_the_unpacked_bits():
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, 3), dtype=torch.int32)
    logits = torch.randn(4, 70)  # wider than 3 words of bits: columns 96.. do not exist, 70 < 96 fine
    expected = logits.clone()
    for row in range(4):
        for token in range(70):
            if not (int(bitmask[row, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    apply_bitmask(logits, bitmask, torch.arange(4))
    assert torch.equal(logits, expected)
    wide = torch.zeros(1, 100)
    apply_bitmask(wide, new_bitmask(1, 64), [0])
    assert torch.isinf(wide[0, 64:]).all() and (wide[0, :64] == 0).all(), "columns past the mask are disallowed"


def test_finished_grammar_allows_only_eos_and_an_error_stops(compiler, tokenizer):
    matcher = compiler.matcher(guide(guided_choice=["yes", "no"]))
    for token in tokenizer.encode("yes", add_special_tokens=False).ids:
        assert matcher.accept(token)
    assert matcher.is_finished
    bitmask = new_bitmask(1, compiler.vocab_size)
    matcher.fill(bitmask, 0)
    logits = torch.zeros(1, compiler.vocab_size)
    apply_bitmask(logits, bitmask, [0])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]
    assert matcher.accept(EOS) and matcher.error is None
    wrong = compiler.matcher(guide(guided_choice=["yes", "no"]))
    assert not wrong.accept(tokenizer.encode("maybe", add_special_tokens=False).ids[0])
    assert wrong.error and wrong.is_finished


def test_same_guide_compiles_once(compiler):
    as_object = guide(guided_json={"type": "object", "properties": {"x": {"type": "integer"}}})
    as_string = guide(guided_json='{"type": "object", "properties": {"x": {"type": "integer"}}}')
    assert as_object == as_string
    compiler.matcher(as_object)
    cached = len(compiler._cache)
    compiler.matcher(as_string)
    assert len(compiler._cache) == cached


def test_cache_is_bounded(tokenizer):
    small = GrammarCompiler(tokenizer, VOCAB, [EOS], cache_entries=2)
    for n in range(4):
        small.matcher(guide(guided_regex=f"a{{{n + 1}}}"))
    assert len(small._cache) == 2


@pytest.mark.parametrize(("raw", "message"), [
    ({"guided_json": {"type": "objekt"}}, r"'guided_json' is not a valid JSON Schema.*objekt"),
    ({"guided_json": {"$ref": "#/$defs/missing"}}, r"'guided_json'.*missing"),
    ({"guided_json": {"type": "string", "pattern": "[a-"}}, r"'guided_json'.*unclosed character class"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, r"'guided_json'.*uniqueItems"),
    ({"guided_regex": "[a-"}, r"'guided_regex' is not a valid regular expression.*unclosed character class"),
    ({"guided_regex": "(ab"}, r"'guided_regex' is not a valid regular expression"),
])
def test_bad_schema_or_regex_is_invalid_input_with_the_reason(compiler, raw, message):
    found = read_guide(raw, "sampling_parameters")
    assert found is not None
    with pytest.raises(InvalidInputError, match=message) as caught:
        compiler.matcher(found)
    assert "\n" not in str(caught.value)
    with pytest.raises(InvalidInputError, match=message):
        compiler.matcher(found)  # the verdict is cached, and given again


@pytest.mark.parametrize(("raw", "message"), [
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, r"give at most one of .*guided_json and guided_regex"),
    ({"guided_json": "{not json"}, r"'guided_json' is not valid JSON"),
    ({"guided_json": [1, 2]}, r"'guided_json' must be a JSON Schema object"),
    ({"guided_json": "[1, 2]"}, r"'guided_json' must be a JSON Schema object"),
    ({"guided_json": 5}, r"'guided_json' must be a JSON Schema object"),
    ({"guided_regex": 5}, r"'guided_regex' must be a non-empty string"),
    ({"guided_regex": ""}, r"'guided_regex' must be a non-empty string"),
    ({"guided_choice": "yes"}, r"'guided_choice' must be a non-empty list of non-empty strings"),
    ({"guided_choice": []}, r"'guided_choice' must be a non-empty list"),
    ({"guided_choice": ["a", 1]}, r"'guided_choice' must be a non-empty list of non-empty strings"),
    ({"guided_choice": ["a", ""]}, r"'guided_choice' must be a non-empty list of non-empty strings"),
    ({"guided_regex": "a" * (constraints.MAX_GUIDE_CHARS + 1)}, r"'guided_regex' is \d+ characters"),
])
def test_wrong_shapes_are_invalid_input_naming_the_key(raw, message):
    with pytest.raises(InvalidInputError, match=f"^sampling_parameters: {message}"):
        read_guide(raw, "sampling_parameters")


def test_no_guide_and_null_guides_are_none():
    assert read_guide({"temperature": 0}, "x") is None
    assert read_guide({"guided_json": None, "guided_regex": None}, "x") is None
    assert read_guide({"guided_json": None, "guided_regex": "a+"}, "x") == Guide("regex", "a+")


def test_missing_library_is_a_clear_error_at_use(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(UnavailableError, match="needs the 'llguidance' package"):
        GrammarCompiler(TOKENIZER, VOCAB, [EOS])
