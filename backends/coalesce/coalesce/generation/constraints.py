"""Structured output: ``guided_json``, ``guided_regex`` and ``guided_choice`` as a token mask per sequence per step.

A request's guide (read by :func:`read_guide` from its sampling parameters) is compiled once
per distinct source by the model's :class:`GrammarCompiler` and each constrained sequence
gets its own :class:`Matcher`. The library is llguidance, chosen by measurement in
``perf/results/grammars-20261207.md``: compiles in about a millisecond (xgrammar: tens to
hundreds), never lets through output its schema forbids (it refuses what it does not
implement, where xgrammar silently drops allOf, uniqueItems and not), and has no
dependencies; its mask per step is slower than xgrammar's on structured paths (0.7 against
0.1 ms for 16 rows) and faster inside free strings. Every step the engine:

1. fills each constrained sequence's row of one shared bitmask (:meth:`Matcher.fill`);
2. applies all rows at once to the step's logits (:func:`apply_bitmask`: disallowed
   tokens to ``-inf``, in place), before temperature, top-k and top-p;
3. samples as usual;
4. advances each matcher by its sampled token (:meth:`Matcher.accept`) and ends the
   sequence with finish reason ``stop`` once :attr:`Matcher.is_finished` (the grammar is
   complete: only EOS could follow), or when the token is EOS.

Filling releases the GIL, so step 1 may run on another thread while the forward pass runs
(the mask depends only on tokens already accepted).

The bitmask holds one bit per token id (bit ``t % 32`` of int32 word ``t // 32``, set:
allowed), ``ceil(vocab_size / 32)`` words per row, on the CPU where the library writes it.
llguidance is imported on first use, so a model that never sees a guide loads without it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol

import torch

from coalesce.core.errors import InvalidInputError, UnavailableError
from coalesce.core.protocol import GUIDED_KEYS

if TYPE_CHECKING:
    import llguidance

#: The longest guide source accepted, in characters: compiling is bounded by llguidance's own limits, this bounds
#: the text a request can make the server parse and cache.
MAX_GUIDE_CHARS: Final = 64 * 1024
#: Options of ``guided_choice`` at most.
MAX_CHOICES: Final = 1024
#: Compiled guides kept per model. A compiled JSON schema is tens to hundreds of KiB; 256 covers a service's
#: handful of schemas many times over while bounding what distinct request schemas can pin.
COMPILE_CACHE_ENTRIES: Final = 256
#: JSON is generated compact (no whitespace between tokens): flexible whitespace lets a weak model pad
#: newlines and spaces without end.
_JSON_OPTIONS: Final = {"whitespace_flexible": False}
_BITS_PER_WORD: Final = 32

GuideKind = Literal["json", "regex", "choice"]
_KEY_OF_KIND: Final[dict[str, str]] = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice"}


@dataclasses.dataclass(frozen=True)
class Guide:
    """One request's constraint: its kind and canonical source (compact JSON for ``json`` and ``choice``).

    Equal guides compile once: the source is canonical so that a schema sent as an object and
    as a string share a cache entry.
    """

    kind: GuideKind
    source: str

    @property
    def key(self) -> str:
        """The sampling-parameter key this guide came from (for messages)."""
        return _KEY_OF_KIND[self.kind]


def read_guide(raw: Mapping[str, Any], where: str) -> Guide | None:
    """The guide among a sampling-parameter object's ``GUIDED_KEYS``, or None if it sets none.

    ``guided_json`` is a JSON Schema as an object or as a string holding one (``{"type":
    "object"}`` asks for any JSON object, OpenAI's ``json_object``); ``guided_regex`` a
    regular expression (Rust ``regex`` syntax, matched against the whole output);
    ``guided_choice`` a list of strings, the output being exactly one of them. A key set to
    null counts as absent. Only the shape is checked here; :meth:`GrammarCompiler.matcher`
    checks the schema or regex itself.

    Raises:
        InvalidInputError: Two guides at once, or a value of the wrong type or size, naming the key.
    """
    present = [key for key in GUIDED_KEYS if raw.get(key) is not None]
    if not present:
        return None
    if len(present) > 1:
        raise InvalidInputError(f"{where}: give at most one of {', '.join(GUIDED_KEYS)}; got "
                                f"{' and '.join(present)}")
    key = present[0]
    value = raw[key]
    if key == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidInputError(f"{where}: 'guided_json' is not valid JSON: {exc.msg} at character "
                                        f"{exc.pos}") from None
        if not isinstance(value, dict):
            raise InvalidInputError(f"{where}: 'guided_json' must be a JSON Schema object (or a string holding "
                                    f"one), not {type(value).__name__}")
        guide = Guide("json", json.dumps(value, separators=(",", ":"), ensure_ascii=False))
    elif key == "guided_regex":
        if not isinstance(value, str) or not value:
            raise InvalidInputError(f"{where}: 'guided_regex' must be a non-empty string, not {value!r:.80}")
        guide = Guide("regex", value)
    else:
        if (not isinstance(value, list) or not value
                or not all(isinstance(choice, str) and choice for choice in value)):
            raise InvalidInputError(f"{where}: 'guided_choice' must be a non-empty list of non-empty strings")
        if len(value) > MAX_CHOICES:
            raise InvalidInputError(f"{where}: 'guided_choice' has {len(value)} options; at most {MAX_CHOICES}")
        guide = Guide("choice", json.dumps(value, separators=(",", ":"), ensure_ascii=False))
    if len(guide.source) > MAX_GUIDE_CHARS:
        raise InvalidInputError(f"{where}: '{key}' is {len(guide.source)} characters; at most {MAX_GUIDE_CHARS}")
    return guide


def _llguidance() -> Any:
    """The llguidance module, imported on first use (a model without guides never needs it)."""
    try:
        import llguidance
    except ImportError as exc:
        raise UnavailableError("structured output (guided_json, guided_regex, guided_choice) needs the "
                               "'llguidance' package, which is not installed here (pip install "
                               f"'coalesce[generate]'): {exc}") from exc
    return llguidance


class SerialisedTokenizer(Protocol):
    """A loaded tokenizer that gives its ``tokenizer.json`` text (``tokenizers.Tokenizer`` does)."""

    def to_str(self) -> str:
        """The tokenizer as ``tokenizer.json`` text."""
        ...


class Matcher:
    """One sequence's position in its guide's grammar; used by one thread at a time (the engine's step loop)."""

    def __init__(self, inner: llguidance.LLMatcher, guide: Guide) -> None:
        """Wrap a fresh llguidance matcher of ``guide`` (made by :meth:`GrammarCompiler.matcher`)."""
        self._inner = inner
        self.guide = guide

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask`` (from :func:`new_bitmask`).

        Once the grammar is complete only EOS is allowed; after an error, too (so the
        sequence ends rather than sampling from nothing).
        """
        view = bitmask[row]
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not view.is_contiguous():
            raise ValueError("the bitmask must be a contiguous int32 CPU tensor from new_bitmask()")
        # The library writes the row in place (it releases the GIL meanwhile); its length is checked there.
        self._inner.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())

    def accept(self, token: int) -> bool:
        """Advance by the sampled ``token``; False if the grammar does not allow it (see :attr:`error`).

        With the mask applied before sampling this is True, EOS included (which finishes
        the matcher).
        """
        return bool(self._inner.consume_token(token))

    @property
    def is_finished(self) -> bool:
        """The grammar is complete: nothing but EOS may follow (also True after an error)."""
        return bool(self._inner.is_stopped())

    @property
    def error(self) -> str | None:
        """Why the matcher stopped on an error (a rejected token, a limit hit), or None."""
        if not self._inner.is_error():
            return None
        return _one_line(self._inner.get_error()) or "unknown error"


class GrammarCompiler:
    """Compiles guides against one model's tokenizer; built once per model, shared by its requests.

    Thread-safe: the cache is locked, and compiling releases the GIL. Compiled guides are
    kept in an LRU of :data:`COMPILE_CACHE_ENTRIES`; each :meth:`matcher` copies one (a few
    microseconds), so a schema every request repeats compiles once.
    """

    def __init__(self, tokenizer: str | Path | SerialisedTokenizer, vocab_size: int,
                 eos_token_ids: Iterable[int], cache_entries: int = COMPILE_CACHE_ENTRIES) -> None:
        """Index the tokenizer's vocabulary for masking (about 0.2 s for a 49k vocabulary).

        Args:
            tokenizer: The model's ``tokenizer.json`` path, or a loaded ``tokenizers.Tokenizer``
                (anything with its ``to_str``).
            vocab_size: The logits width (the model's ``vocab_size``; may exceed the tokenizer's
                vocabulary, whose extra ids are never allowed).
            eos_token_ids: The tokens that end a sequence; allowed where the grammar may end.
            cache_entries: Compiled guides kept.

        Raises:
            UnavailableError: llguidance is not installed.
            ValueError: No EOS token, or a tokenizer llguidance cannot read.
        """
        llg = _llguidance()
        eos = sorted(set(eos_token_ids))
        if not eos:
            raise ValueError("structured output needs the model's EOS token ids; none were given")
        text = Path(tokenizer).read_text("utf-8") if isinstance(tokenizer, (str, Path)) else tokenizer.to_str()
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(eos)
        self._llg = llg
        self._tokenizer = llg.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=eos)
        # Default limits bound compile and per-step work against hostile schemas; verbose errors would put the
        # parser state and the whole grammar into a request's error message.
        self._limits = llg.LLParserLimits(verbose_errors=False)
        self._cache: collections.OrderedDict[Guide, llguidance.LLMatcher | str] = collections.OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.Lock()

    def matcher(self, guide: Guide) -> Matcher:
        """A fresh matcher for one sequence under ``guide``, compiling it on first sight.

        Raises:
            InvalidInputError: The schema or regex is invalid or beyond the library's limits,
                naming the key and giving the library's reason.
        """
        with self._lock:
            compiled = self._cache.get(guide)
            if compiled is not None:
                self._cache.move_to_end(guide)
        if compiled is None:
            compiled = self._compile(guide)  # outside the lock: a slow schema must not hold up other requests
            with self._lock:
                self._cache[guide] = compiled
                self._cache.move_to_end(guide)
                while len(self._cache) > self._cache_entries:
                    self._cache.popitem(last=False)
        if isinstance(compiled, str):
            raise InvalidInputError(compiled)
        return Matcher(compiled.deep_copy(), guide)

    def _compile(self, guide: Guide) -> llguidance.LLMatcher | str:
        """The guide's template matcher, or the message of why it is invalid (cached too: cheap to repeat)."""
        llg = self._llg
        try:
            if guide.kind == "json":
                grammar = llg.LLMatcher.grammar_from_json_schema(guide.source, overrides=_JSON_OPTIONS)
            elif guide.kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(guide.source)
            else:
                grammar = llg.grammar_from("choice", guide.source)
        except ValueError as exc:
            return f"'{guide.key}' is not a valid {_WHAT[guide.kind]}: {_one_line(str(exc))}"
        compiled = llg.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        if compiled.is_error():
            return f"'{guide.key}' is not a valid {_WHAT[guide.kind]}: {_one_line(compiled.get_error())}"
        return compiled


_WHAT: Final = {"json": "JSON Schema (or uses a feature not supported)", "regex": "regular expression",
                "choice": "list of choices"}


def _one_line(message: str) -> str:
    """A library message on one line (regex errors come as a multi-line drawing)."""
    return " ".join(message.replace("<non-verbose/>", "").split())


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask of ``rows`` rows for ``vocab_size`` tokens, every token allowed (int32, CPU, ``[rows, words]``)."""
    words = (vocab_size + _BITS_PER_WORD - 1) // _BITS_PER_WORD
    return torch.full((rows, words), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor) -> None:
    """Set the logits of disallowed tokens to ``-inf`` in place, for the constrained ``rows`` in one batched op.

    ``bitmask`` row ``r`` applies to ``logits`` row ``r`` (the engine fills the rows of its
    constrained sequences and passes their indices); other rows are left alone. Logits
    columns past the bitmask's width are disallowed. ``logits`` (float, ``[batch, vocab]``)
    may be on any device; the bitmask rows are copied there. Runs in inference mode, so the
    logits a model returned in inference mode may be changed in place.
    """
    index = torch.as_tensor(rows, dtype=torch.long).cpu()
    if index.numel() == 0:
        return
    with torch.inference_mode():
        _apply_bitmask(logits, bitmask, index)


def _apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, index: torch.Tensor) -> None:
    batch, vocab = logits.shape
    # Each mask byte looks up its 8 additive biases (0 allowed, -inf not): a gather and an add, both vectorised
    # and independent of the mask's contents (masked_fill_ on the unpacked bits measured 2-5x slower on CPU).
    table = _bias_table(logits.device, logits.dtype)
    packed = bitmask.index_select(0, index).contiguous().view(torch.uint8).reshape(-1)
    bias = table.index_select(0, packed.to(logits.device, non_blocking=True).long()).view(index.numel(), -1)
    width = bias.shape[-1]
    if width > vocab:
        bias = bias[:, :vocab]
    elif width < vocab:
        bias = torch.cat([bias, bias.new_full((index.numel(), vocab - width), float("-inf"))], dim=-1)
    if index.numel() == batch and torch.equal(index, torch.arange(batch)):
        logits.add_(bias)  # every row constrained
    else:
        logits.index_add_(0, index.to(logits.device), bias)


_BIAS_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _bias_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[256, 8]``: row ``b`` holds 0 where bit ``k`` of byte ``b`` is set, else ``-inf`` (little-endian bits)."""
    table = _BIAS_TABLES.get((device, dtype))
    if table is None:
        bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
        table = torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf")).to(device=device, dtype=dtype)
        _BIAS_TABLES[(device, dtype)] = table
    return table
