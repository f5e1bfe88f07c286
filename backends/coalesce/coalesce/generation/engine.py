"""Continuous batching: one forward pass per step over every active sequence; sequences join and leave each step.

Requests are read and checked in ``submit`` (from Triton's ``execute``; bad input raises
there), queue in priority order (``priority_level``: lower first, first come first
served within a level), and join at the next step when the running set and the KV cache
have room for their prompt and ``max_tokens`` (prefix blocks already computed are
shared, see ``coalesce.generation.blocks``). Each step packs one token per
decoding sequence and chunks of prompts up to ``max_prefill_tokens``, so decoding
never stalls behind a long prompt, runs one forward pass, samples every sequence at once
(``coalesce.generation.sampling``; structured output masks each constrained sequence's
logits first), and answers: a
streaming request gets its new text every step, and a sequence that ends (``max_tokens``,
end of sequence, a stop string, the context) gets its final response and frees its
blocks the same step. A cancelled request is dropped within one step. With
``generation_batching: request`` the engine admits only into an empty batch, which then
runs until its last sequence ends: static batching, for comparison.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from coalesce.core.errors import (
    CancelledError,
    CoalesceError,
    ConfigError,
    InvalidInputError,
    RuntimeFailure,
    UnavailableError,
)
from coalesce.generation.blocks import BlockPool, prefix_digests
from coalesce.generation.contract import ADDITIONAL_OUTPUTS, GenerationRequest, read_request
from coalesce.generation.events import FINISH_LENGTH, FINISH_STOP, GenerationEvent, Sink
from coalesce.generation.model import CausalLM, KVCache, StepInput
from coalesce.generation.sampling import Choice, Penalties, Row, sample
from coalesce.generation.text import IncrementalText
from coalesce.observability.log import Logger
from coalesce.observability.metrics import GenerationMetrics
from coalesce.runtimes.cores import CoreBoard, marked, sharing_note, start_borrowed
from coalesce.settings import GenerateOptions

#: The level of a request that sets no ``priority_level`` (Triton's convention: 1 is the highest).
DEFAULT_PRIORITY_LEVEL = 1


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer (``tokenizers.Tokenizer`` has it)."""

    def encode(self, text: str) -> Any:
        """An encoding whose ``ids`` are the tokens of ``text``, special tokens added."""
        ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``."""
        ...

    def to_str(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (structured output indexes the vocabulary from it)."""
        ...


@dataclasses.dataclass(eq=False)
class _Sequence:
    id: int
    request: GenerationRequest
    prompt: list[int]
    sink: Sink
    is_cancelled: Callable[[], bool] | None
    arrived_s: float
    text: IncrementalText
    generator: torch.Generator | None
    total_tokens: int
    digests: list[bytes]
    #: Admission order: (priority level, arrival number); lower first.
    order: tuple[int, int] = (0, 0)
    penalties: Penalties | None = None
    #: The structured-output matcher (``coalesce.generation.constraints``), or None.
    matcher: Any = None
    cumulative_logprob: float = 0.0
    #: Tokens generated since the last response, and their log-probability entries where asked.
    unsent_tokens: int = 0
    unsent_logprobs: list[dict[str, dict[str, Any]]] = dataclasses.field(default_factory=list)
    generated: list[int] = dataclasses.field(default_factory=list)
    blocks: list[int] = dataclasses.field(default_factory=list)
    #: The cache slot of each position the sequence may fill (its blocks are all taken when it joins).
    slots: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    computed: int = 0
    registered: int = 0
    first_token_s: float = 0.0
    last_token_s: float = 0.0

    def token(self, position: int) -> int:
        return self.prompt[position] if position < len(self.prompt) else self.generated[position - len(self.prompt)]

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.generated)


def _cancelled(sequences: list[_Sequence]) -> list[_Sequence]:
    """Those of ``sequences`` whose client cancelled them."""
    return [s for s in sequences if s.is_cancelled is not None and s.is_cancelled()]


class GenerationEngine:
    """Schedules and runs generation steps on one model, from its own thread (or ``step()`` by hand in tests)."""

    def __init__(self, model: CausalLM, tokenizer: Tokenizer, options: GenerateOptions, *, context_length: int,
                 metrics: GenerationMetrics, logger: Logger, start: bool = True,
                 board: CoreBoard | None = None, grammars: Any = None,
                 declared_outputs: frozenset[str] = frozenset(ADDITIONAL_OUTPUTS),
                 max_request_bytes: int = 0, borrowed_thread_priority: str = "idle") -> None:
        """Allocate the KV cache from ``options.kv_cache_bytes``; start the step thread unless ``start`` is False.

        ``context_length``: most tokens of one sequence, prompt included (capped to what the pool holds).
        ``board``: the server's core board, marked around each forward pass: a step runs on every
        core while no other model computes, else on the board's ``own_threads``, and the
        server's other models keep to their share while this one generates. The torch threads
        it borrows run at ``borrowed_thread_priority`` (``idle``: Linux SCHED_IDLE).
        ``grammars``: compiles structured-output guides (``constraints.GrammarCompiler``;
        None: built on the first request that asks). ``declared_outputs``: the additional
        outputs the model's config declares. ``max_request_bytes``: largest request (0: any).
        """
        self.model = model
        self.grammars = grammars
        self.declared_outputs = declared_outputs
        self.max_request_bytes = max_request_bytes
        self.board = board
        self.borrowed_thread_priority = borrowed_thread_priority
        self.wide_steps = 0
        self._threads_now = 0
        self.tokenizer = tokenizer
        self.options = options
        self.metrics = metrics
        self.logger = logger
        block = options.kv_block_tokens
        per_token = KVCache.bytes_per_token(model.shapes, model.dtype)
        num_blocks = options.kv_cache_bytes // (per_token * block)
        if num_blocks < 1:
            raise ConfigError(f"kv_cache_bytes {options.kv_cache_bytes} holds no block of {block} tokens "
                              f"({per_token * block} bytes each for this model)")
        self.pool = BlockPool(num_blocks, block, prefix_cache=options.prefix_cache)
        self.cache = KVCache(model.shapes, num_blocks * block, dtype=model.dtype, device=model.device)
        self.context_length = min(context_length, num_blocks * block)
        self.bytes_per_token = per_token
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._inbox: list[_Sequence] = []
        self._waiting: list[_Sequence] = []  # sorted by ``order``
        self._running: list[_Sequence] = []
        self._closed = False
        self._abandoned = False
        self.steps = 0
        self._thread: threading.Thread | None = None
        self._checker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="coalesce-cancel")
        self._check: concurrent.futures.Future[list[_Sequence]] | None = None
        self._next_check_s = 0.0
        metrics.kv_blocks_total.set(num_blocks)
        self._report_pool()
        if start:
            self._thread = threading.Thread(target=self._run, name="coalesce-generate", daemon=True)
            self._thread.start()

    # -- requests ------------------------------------------------------------------------------------------

    def prompt_tokens(self, request: GenerationRequest) -> list[int]:
        """The prompt's tokens, checked against the context.

        Raises:
            InvalidInputError: If the prompt leaves no room in the context for one new token.
        """
        ids = list(self.tokenizer.encode(request.prompt).ids)
        if not ids:
            raise InvalidInputError("input 'text_input' holds no tokens")
        if len(ids) >= self.context_length:
            raise InvalidInputError(f"input 'text_input' is {len(ids)} tokens; the context holds "
                                    f"{self.context_length} (prompt and generated tokens together; parameter "
                                    "max_sequence_length, the model's own limit and kv_cache_bytes cap it)")
        return ids

    def read(self, tensors: dict[str, np.ndarray], parameters: str | dict[str, Any] | None) -> GenerationRequest:
        """One request read and checked under the contract (``coalesce.generation.contract``).

        Raises:
            InvalidInputError: Naming what is wrong.
        """
        from coalesce.core.limits import check_request_bytes

        oversize = check_request_bytes(tensors, self.max_request_bytes)
        if oversize is not None:
            raise oversize
        return read_request(tensors, parameters, self.options, declared_outputs=self.declared_outputs)

    def submit(self, tensors: dict[str, np.ndarray], parameters: str | dict[str, Any] | None, sink: Sink, *,
               is_cancelled: Callable[[], bool] | None = None) -> GenerationRequest:
        """Read, check and queue one request; ``sink`` then gets its responses from the step thread.

        Its last event is final (an error included). Returns the request as read.

        Raises:
            InvalidInputError: If the request is bad (nothing is queued, ``sink`` gets nothing).
            UnavailableError: If ``max_waiting_sequences`` wait already, or the model is closing.
        """
        request = self.read(tensors, parameters)
        self.enqueue(request, sink, is_cancelled=is_cancelled)
        return request

    def enqueue(self, request: GenerationRequest, sink: Sink, *,
                is_cancelled: Callable[[], bool] | None = None) -> None:
        """Queue a request already read (``read``); raises as ``submit`` does."""
        now = time.perf_counter()
        ids = self.prompt_tokens(request)
        sampling = request.sampling
        matcher = None
        if sampling.guide is not None:
            matcher = self._grammars().matcher(sampling.guide)
        generator = None
        if sampling.temperature > 0:
            seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            generator = torch.Generator().manual_seed(seed)
        digests = prefix_digests(ids, self.pool.block_tokens) if self.pool.prefix_cache else []
        number = next(self._ids)
        sequence = _Sequence(
            id=number, request=request, prompt=ids, sink=sink, is_cancelled=is_cancelled, arrived_s=now,
            text=IncrementalText(self.tokenizer, sampling.stop, stop_after_tokens=sampling.min_tokens),
            generator=generator, total_tokens=min(len(ids) + sampling.max_tokens, self.context_length),
            digests=digests, order=(request.priority_level or DEFAULT_PRIORITY_LEVEL, number), matcher=matcher,
            penalties=Penalties(ids, self.model.vocab_size) if sampling.penalised else None)
        with self._lock:
            if self._closed:
                raise UnavailableError("the model is being unloaded")
            waiting = len(self._waiting) + len(self._inbox)
            if waiting >= self.options.max_waiting_sequences:
                self.metrics.refusals["queue_full"].increment(1)
                raise UnavailableError(f"{waiting} requests already wait to join (parameter max_waiting_sequences); "
                                       "retry later")
            self._inbox.append(sequence)
            self._lock.notify()

    def _grammars(self) -> Any:
        if self.grammars is None:
            from coalesce.generation.constraints import GrammarCompiler

            self.grammars = GrammarCompiler(self.tokenizer, self.model.vocab_size, self.model.eos_token_ids)
        return self.grammars

    def close(self, *, drain_s: float = 8.0) -> None:
        """Refuse new requests, let queued and running ones finish for up to ``drain_s``, then end the rest.

        The whole close stays within about ``drain_s`` + 3 s, under Triton's shortest usual
        exit timeout (15 s): past it the server gives up on the unload and exits with an error.
        """
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            held = (len(self._running), len(self._waiting) + len(self._inbox))
        if held != (0, 0):
            self.logger.info(f"closing: {held[0]} requests running and {held[1]} waiting get up to {drain_s:g} s")
        if self._thread is not None:
            self._thread.join(timeout=drain_s)
            if self._thread.is_alive():
                self.logger.warning(f"closing: the step thread did not drain in {drain_s:g} s "
                                    f"({len(self._running)} running, {len(self._waiting)} waiting); ending them")
            self._abandoned = True  # past the drain: the thread stops after the step it is in
            self._thread.join(timeout=3)
        with self._lock:
            left = self._inbox + list(self._waiting)
            self._inbox.clear()
            self._waiting.clear()
        for sequence in left:
            self._fail(sequence, UnavailableError("the model was unloaded before the request joined"), running=False)
        for sequence in list(self._running):
            self._fail(sequence, UnavailableError("the model was unloaded before the request finished"))
        self._checker.shutdown(wait=False)

    @property
    def prefilling(self) -> int:
        """Requests whose prompt is not all computed yet: queued, waiting, or joined and prefilling."""
        return (len(self._inbox) + len(self._waiting)
                + sum(1 for s in self._running if s.computed < len(s.prompt)))

    @property
    def busy(self) -> bool:
        """Whether any request is queued or running."""
        return bool(self._inbox or self._waiting or self._running)

    # -- the step loop ---------------------------------------------------------------------------------------

    def _use_threads(self, threads: object) -> None:
        """Run the coming forward pass on ``threads`` torch threads (what the board allows; None: unchanged)."""
        if not isinstance(threads, int):
            return
        if threads != self._threads_now:
            torch.set_num_threads(threads)  # per calling thread: the step thread's own OpenMP team
            self._threads_now = threads
        if self.board is not None and threads > self.board.own_threads:
            self.wide_steps += 1

    def _borrow_threads(self) -> None:
        """Start the step thread's OpenMP workers for every core now, at ``borrowed_thread_priority``.

        torch sizes its team per calling thread; the extra workers start at the first wide
        parallel region, so one is run here and the threads that appeared are lowered: a
        neighbour that starts computing gets its core back at once.
        """
        board = self.board
        if board is None or board.cores <= board.own_threads or self.model.device.type != "cpu":
            return
        def wide_region() -> None:
            torch.set_num_threads(board.cores)
            with torch.inference_mode():
                torch.ones(1 << 20).mul_(2)  # an elementwise op large enough to run in parallel
                torch.ones(256, 256) @ torch.ones(256, 256)

        _, count = start_borrowed(wide_region, self.borrowed_thread_priority)
        torch.set_num_threads(board.own_threads)
        self._threads_now = board.own_threads
        self.logger.info(sharing_note(board, board.own_threads, count, self.borrowed_thread_priority, unit="step"))

    def _run(self) -> None:
        self._borrow_threads()
        while not self._abandoned:
            with self._lock:
                while not self._closed and not (self._inbox or self._waiting or self._running):
                    self._lock.wait()
                if self._closed and not (self._inbox or self._waiting or self._running):
                    return
            try:
                self.step()
            except Exception as exc:
                self.logger.error(f"generation step failed: {exc!r}; failing its {len(self._running)} sequences")
                self.metrics.step_failures.increment(1)
                for sequence in list(self._running):
                    self._fail(sequence, RuntimeFailure(f"generation step failed: {exc}"))
            if self._waiting and not self._running:
                time.sleep(0.001)  # waiting for the KV cache with nothing running: only expiry can change it

    def step(self) -> bool:
        """Admit, run one forward pass, sample and answer; False if there was nothing to run.

        Whether each request was cancelled is asked from another thread, at most every
        ``cancel_check_interval_ms`` (in Triton each ask is a round trip to the server);
        the step never waits for the answers: a request found cancelled leaves at the end
        of the step during which the answer came, or at the start of the next.
        """
        now = time.perf_counter()
        with self._lock:
            for sequence in self._inbox:
                bisect.insort(self._waiting, sequence, key=lambda s: s.order)
            self._inbox.clear()
        self._collect_cancelled()
        if self._check is None and now >= self._next_check_s:
            watched = [s for s in (*self._running, *self._waiting) if s.is_cancelled is not None]
            if watched:
                self._check = self._checker.submit(_cancelled, watched)
                self._next_check_s = now + self.options.cancel_check_interval_ms / 1000
        self._admit(now)
        ran = bool(self._running)
        if ran:
            step, members = self._plan()
            with marked(self.board) as threads:
                self._use_threads(threads)
                logits = self.model.forward(step, self.cache)
            self.steps += 1
            self._advance(members, logits)
        self._collect_cancelled()
        self.metrics.waiting_sequences.set(len(self._waiting))
        self.metrics.active_sequences.set(len(self._running))
        self._report_pool()
        return ran

    def _collect_cancelled(self) -> None:
        """End the requests the last finished check found cancelled (an unfinished check is left running)."""
        if self._check is None or not self._check.done():
            return
        check, self._check = self._check, None
        for sequence in check.result():
            running = sequence in self._running
            if not running and sequence not in self._waiting:
                continue  # it ended meanwhile
            self.logger.info(f"cancelling request {sequence.id} ({len(sequence.generated)} tokens generated)")
            if not running:
                self._waiting.remove(sequence)
            self.metrics.cancelled.increment(1)
            self._fail(sequence, CancelledError("the request was cancelled"), running=running)
            self.logger.info(f"cancelled request {sequence.id}: answered CANCELLED, its KV blocks freed")

    def _admit(self, now: float) -> None:
        options = self.options
        if options.generation_batching == "request" and self._running:
            return  # static batching: the batch runs until its last sequence ends
        while self._waiting and len(self._running) < options.max_active_sequences:
            sequence = self._waiting[0]  # the first in priority order: no later one overtakes it
            reusable = sequence.digests[:(len(sequence.prompt) - 1) // self.pool.block_tokens]
            allocation = self.pool.allocate(sequence.total_tokens, reusable)
            if allocation is None:
                break
            self._waiting.pop(0)
            sequence.blocks = allocation.blocks
            block = self.pool.block_tokens
            sequence.slots = (np.asarray(allocation.blocks, dtype=np.int64)[:, None] * block
                              + np.arange(block, dtype=np.int64)).reshape(-1)
            sequence.computed = allocation.cached_tokens
            sequence.registered = allocation.cached_tokens // self.pool.block_tokens
            self.metrics.prompt_tokens.increment(len(sequence.prompt))
            self.metrics.prefix_hit_tokens.increment(allocation.cached_tokens)
            self.metrics.queue_seconds.observe(now - sequence.arrived_s)
            self._running.append(sequence)
        limit_s = options.max_queue_wait_ms / 1000
        for sequence in [s for s in self._waiting if now - s.arrived_s > limit_s]:
            self._waiting.remove(sequence)
            usage = self.pool.usage()
            self.metrics.refusals["kv_full"].increment(1)
            self._fail(sequence, UnavailableError(
                f"waited {(now - sequence.arrived_s) * 1000:.0f} ms for room in the KV cache (parameter "
                f"max_queue_wait_ms): {usage.used} of {self.pool.num_blocks} blocks held by {len(self._running)} "
                f"sequences, this one needs {self.pool.blocks_for(sequence.total_tokens)}; retry later"),
                running=False)

    def _plan(self) -> tuple[StepInput, list[tuple[_Sequence, int, bool]]]:
        """Pack the step: decoding sequences first (one token each), then prompt chunks within the prefill budget.

        Decoding sequences go longest context first, so that the model's attention can
        group alike lengths (``coalesce.generation.model.decode_groups``).
        """
        step = StepInput(ids=[], positions=[], slots=[], decode_slots=[], prefills=[], logits_rows=[])
        members: list[tuple[_Sequence, int, bool]] = []  # (sequence, tokens computed this step, wants logits)
        prefilling = [s for s in self._running if s.computed < len(s.prompt)]
        decoding = [s for s in self._running if s.computed >= len(s.prompt)]
        for sequence in sorted(decoding, key=lambda s: s.computed, reverse=True):
            position = sequence.computed
            step.logits_rows.append(len(step.ids))
            step.ids.append(sequence.token(position))
            step.positions.append(position)
            step.slots.append(int(sequence.slots[position]))
            step.decode_slots.append(sequence.slots[:position + 1])
            members.append((sequence, 1, True))
        budget = self.options.max_prefill_tokens
        for sequence in prefilling:
            if budget <= 0:
                break
            start = sequence.computed
            count = min(len(sequence.prompt) - start, budget)
            budget -= count
            packed = len(step.ids)
            step.ids.extend(sequence.prompt[start:start + count])
            step.positions.extend(range(start, start + count))
            step.slots.extend(sequence.slots[start:start + count].tolist())
            step.prefills.append((packed, packed + count, sequence.slots[:start + count], start))
            done = start + count == len(sequence.prompt)
            if done:
                step.logits_rows.append(packed + count - 1)
            members.append((sequence, count, done))
        return step, members

    def _advance(self, members: list[tuple[_Sequence, int, bool]], logits: torch.Tensor) -> None:
        now = time.perf_counter()
        wanting = [sequence for sequence, _, wants in members if wants]
        choices = self._sample(wanting, logits)
        chosen = dict(zip((id(s) for s in wanting), choices, strict=True))
        for sequence, count, wants in members:
            sequence.computed += count
            self._register_prefix(sequence)
            if not wants:
                continue
            choice = chosen[id(sequence)]
            token = choice.token
            sequence.generated.append(token)
            self.metrics.generated_tokens.increment(1)
            if len(sequence.generated) == 1:
                sequence.first_token_s = now
                self.metrics.time_to_first_token_seconds.observe(now - sequence.arrived_s)
            else:
                self.metrics.inter_token_seconds.observe(now - sequence.last_token_s)
            sequence.last_token_s = now
            if sequence.penalties is not None:
                sequence.penalties.add(token)
            if sequence.matcher is not None and not sequence.matcher.accept(token):
                # Only a grammar the masks let astray (a limit hit mid-way) gets here: the request ends
                # with the library's reason rather than with output that breaks its schema.
                self._fail(sequence, RuntimeFailure(f"structured output failed after {len(sequence.generated)} "
                                                   f"tokens: {sequence.matcher.error}"))
                continue
            before = len(sequence.text.text)
            if token not in self.model.eos_token_ids and token not in sequence.request.sampling.stop_token_ids:
                sequence.text.add(token)
            finish = self._finish_reason(sequence, token)
            if finish is not None:
                sequence.text.finish()
            sequence.unsent_tokens += 1
            if sequence.request.wants_logprobs:
                self._record_logprob(sequence, choice, sequence.text.text[before:])
            self._answer(sequence, finish)
            if finish is not None:
                self._release(sequence)
                self.metrics.finished[finish].increment(1)

    def _sample(self, sequences: list[_Sequence], logits: torch.Tensor) -> list[Choice]:
        """Each sequence's next token: structured-output masks, then one batched sampling over all of them."""
        guided = [(row, s.matcher) for row, s in enumerate(sequences) if s.matcher is not None]
        if guided:
            from coalesce.generation.constraints import apply_bitmask, new_bitmask

            bitmask = new_bitmask(len(sequences), logits.shape[1])
            for row, matcher in guided:
                matcher.fill(bitmask, row)
            apply_bitmask(logits, bitmask, [row for row, _ in guided])
        rows = []
        for sequence in sequences:
            sampling = sequence.request.sampling
            banned: tuple[int, ...] = ()
            if len(sequence.generated) < sampling.min_tokens:
                banned = (*self.model.eos_token_ids, *sampling.stop_token_ids)
            rows.append(Row(sampling, sequence.generator, sequence.penalties, banned,
                            logprobs=(sampling.logprobs or 0) if sequence.request.wants_logprobs else None))
        return sample(logits, rows)

    def _record_logprob(self, sequence: _Sequence, choice: Choice, text: str) -> None:
        """Add the sampled token's log probability, and its entry (vLLM's shape) where ``logprobs`` was asked."""
        sequence.cumulative_logprob += choice.logprob
        if sequence.request.sampling.logprobs is None:
            return
        # The sampled token's text is what it added to the output, so the entries' rank-1 texts
        # add up to the text; the other tokens are decoded alone, as vLLM does.
        entry = {str(choice.token): {"logprob": choice.logprob, "rank": choice.rank, "decoded_token": text}}
        for rank, (token, logprob) in enumerate(choice.top, start=1):
            if token != choice.token:
                entry[str(token)] = {"logprob": logprob, "rank": rank,
                                     "decoded_token": self.tokenizer.decode([token], skip_special_tokens=False)}
        sequence.unsent_logprobs.append(entry)

    def _finish_reason(self, sequence: _Sequence, token: int) -> str | None:
        sampling = sequence.request.sampling
        if token in self.model.eos_token_ids and not sampling.ignore_eos:
            return FINISH_STOP
        if token in sampling.stop_token_ids or sequence.text.stopped:
            return FINISH_STOP
        if sequence.matcher is not None and sequence.matcher.is_finished:
            return FINISH_STOP
        if len(sequence.generated) >= sampling.max_tokens or sequence.length >= sequence.total_tokens:
            return FINISH_LENGTH
        return None

    def _answer(self, sequence: _Sequence, finish: str | None) -> None:
        request = sequence.request
        final = finish is not None
        if not request.stream and not final:
            return
        text = sequence.text.take(final=final)
        if not text and not final:
            return
        if request.prepend_prompt:
            text = request.prompt + text
        self._send(sequence, GenerationEvent(
            text=text, final=final, finish_reason=finish, prompt_tokens=len(sequence.prompt),
            generated_tokens=len(sequence.generated), new_tokens=sequence.unsent_tokens,
            cumulative_logprob=sequence.cumulative_logprob, logprobs=tuple(sequence.unsent_logprobs),
            request=request))
        sequence.unsent_tokens = 0
        sequence.unsent_logprobs = []

    def _register_prefix(self, sequence: _Sequence) -> None:
        full = min(sequence.computed, len(sequence.prompt)) // self.pool.block_tokens
        for index in range(sequence.registered, min(full, len(sequence.digests))):
            self.pool.register(sequence.blocks[index], sequence.digests[index])
        sequence.registered = max(sequence.registered, full)

    def _release(self, sequence: _Sequence) -> None:
        if sequence in self._running:
            self._running.remove(sequence)
        if sequence.blocks:
            self.pool.release(sequence.blocks)
            sequence.blocks = []

    def _fail(self, sequence: _Sequence, error: CoalesceError, *, running: bool = True) -> None:
        if running:
            self._release(sequence)
        self.metrics.failures.increment(1)
        self._send(sequence, GenerationEvent(final=True, error=error, prompt_tokens=len(sequence.prompt),
                                             generated_tokens=len(sequence.generated), request=sequence.request))

    def _send(self, sequence: _Sequence, event: GenerationEvent) -> None:
        try:
            sequence.sink(event)
        except Exception as exc:
            self.logger.warning(f"sending a response of request {sequence.id} failed: {exc!r}; dropping it")
            if not event.final:
                self._release(sequence)

    def _report_pool(self) -> None:
        usage = self.pool.usage()
        self.metrics.kv_blocks["used"].set(usage.used)
        self.metrics.kv_blocks["cached"].set(usage.cached)
        self.metrics.kv_blocks["free"].set(usage.free)
